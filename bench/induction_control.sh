#!/usr/bin/env bash
# The GPU control for induction (issue 10; docs/training.md "Run 32"): what keeps the retrieval model from
# copying a repeated string by induction. Every variant trains at once on GPU 0 (the models are small
# enough to share it), on pair rows alone (`--copy-pairs-fraction 1.0`: each string twice among random
# chunks, so only the earlier occurrence predicts the repeat) at 1024 bytes, no PoSE, rate LR:
#
#   gpt           bench.gpt_control: a plain GPT of the retrieval model's width and depth (no MLA, MoE,
#                 indexer), probing itself every minute: whether these rows form induction at all
#   dense_fresh   python -m longctx.train, configs/retrieval.json from a fresh initialisation, dense
#                 attention the whole run
#   sparse_fresh  the same with the indexer's top-k selection from step 0 (the inference model)
#   dense_pre     from INIT_FROM (default models-shipped/retrieval-wip: retrieves, no induction), dense
#   sparse_pre    from INIT_FROM, sparse (what run 32's first stage did, there among other rows)
#
#   MINUTES=15 bash bench/induction_control.sh start   # detached (setsid): runs on across device calls
#   bash bench/induction_control.sh status
#   bash bench/induction_control.sh probe TAG          # bench.copy_probe on each variant's newest checkpoint
#   OUT=$OUT bash bench/induction_control.sh collect   # results.tgz: logs, probes, the GPT's curve
#
# Knobs: VARIANTS (default all five), MINUTES (15), LR (1e-3), SEQ (1024), INIT_FROM, CONTROL_DIR (the work
# directory, /tmp/longctx-induction). Probes copy a checkpoint first (a training may be writing it) and use
# the engine's torch kernels (nothing to compile on a fresh machine).
set -uo pipefail
S=${CONTROL_DIR:-/tmp/longctx-induction}
PY=${PYTHON:-python3}
VARIANTS=${VARIANTS:-gpt dense_fresh sparse_fresh dense_pre sparse_pre}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$S/triton-cache
cmd=${1:-status}

train_args() {
  # $1: a longctx.train variant -> its flags after bench/train_bg.sh's own
  local seq=${SEQ:-1024} init="" dense=0
  case "$1" in
    *_pre) init="--init-from ${INIT_FROM:-models-shipped/retrieval-wip}" ;;
  esac
  case "$1" in
    dense_*) dense=1000000000 ;;  # past the nominal schedule: dense the whole run
  esac
  echo "$init --lr ${LR:-1e-3} --warmup-steps 100 --dense-warmup-steps $dense --curriculum 0:$seq \
--tokens-per-step $((32 * seq)) --copy-fraction 1.0 --copy-pairs-fraction 1.0 --copy-upper-fraction 0 \
--copy-hex-fraction 0 --text-fraction 0 --chat-fraction 0 --document-fraction 0 --replay-fraction 0 \
--pose-max 0 --lm-weight 1.0 --needle-weight 0 --index-local-window 64 --kl-share --select torch --seed 33"
}

case "$cmd" in
start)
  mkdir -p "$S/logs"
  rm -rf "$S/src" && mkdir -p "$S/src"
  trees=(bench configs kernels longctx pyproject.toml)
  [ -d models-candidates ] && trees+=(models-candidates)
  tar -cf - "${trees[@]}" | tar -xf - -C "$S/src"
  cd "$S/src" || exit 1
  for v in $VARIANTS; do
    if [ "$v" = gpt ]; then
      CUDA_VISIBLE_DEVICES=0 setsid nohup "$PY" -m bench.gpt_control --minutes "${MINUTES:-15}" --device cuda \
        --seq "${SEQ:-1024}" --lr "${LR:-1e-3}" --out "$S/gpt" >"$S/logs/gpt.log" 2>&1 </dev/null &
      echo $! >"$S/gpt.pid"
    else
      TRAIN_WORK=$S/$v TRAIN_GPU=0 TRAIN_MINUTES=${MINUTES:-15} TRAIN_ARGS="$(train_args "$v")" \
        TRAIN_SAVE_EVERY=50 bash bench/train_bg.sh start
    fi
  done
  echo "started: $VARIANTS (work dir $S)"
  ;;
status)
  for v in $VARIANTS; do
    echo "== $v"
    if [ "$v" = gpt ]; then tail -n 2 "$S/logs/gpt.log" 2>/dev/null | cut -c1-300
    else TRAIN_WORK=$S/$v bash bench/train_bg.sh status 2; fi
  done
  ;;
probe)
  tag=${2:-now}
  cd "$S/src" || exit 1
  for v in $VARIANTS; do
    [ "$v" = gpt ] && continue
    [ -f "$S/$v/ckpt/model.safetensors" ] || { echo "$v: no checkpoint yet"; continue; }
    snap=$S/snap/$v-$tag
    rm -rf "$snap" && mkdir -p "$snap" && cp "$S/$v"/ckpt/*.json "$S/$v/ckpt/model.safetensors" "$snap/" 2>/dev/null
    cp "$S/$v/ckpt/train_log.jsonl" "$S/logs/$v-train_log.jsonl" 2>/dev/null
    CUDA_VISIBLE_DEVICES=0 "$PY" -m bench.copy_probe --model "$snap" --device cuda --backend torch --hops 1 \
      --samples 2 --out "$S/probe/$v-$tag" >"$S/logs/probe-$v-$tag.log" 2>&1 &
  done
  wait
  for v in $VARIANTS; do
    if [ -f "$S/probe/$v-$tag/copy-probe.md" ]; then
      echo "== $v ($tag)"
      head -n 9 "$S/probe/$v-$tag/copy-probe.md"
    fi
  done
  if [ -f "$S/gpt/gpt-control.json" ]; then
    "$PY" -c 'import json, sys; from bench.gpt_control import table; print(table(json.load(open(sys.argv[1]))))' \
      "$S/gpt/gpt-control.json"
  fi
  ;;
collect)
  OUT=${OUT:-.out/induction}
  mkdir -p "$OUT"
  for v in $VARIANTS; do
    [ "$v" = gpt ] && continue
    cp "$S/$v/stdout.log" "$S/logs/$v-stdout.log" 2>/dev/null
    cp "$S/$v/ckpt/train_log.jsonl" "$S/logs/$v-train_log.jsonl" 2>/dev/null
  done
  (cd "$S" && find logs probe gpt -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' \) \
    -print0 2>/dev/null | tar --null -czf "$OUT/results.tgz" -T -)
  ls -l "$OUT"
  ;;
stop)
  for v in $VARIANTS; do
    if [ "$v" = gpt ]; then [ -f "$S/gpt.pid" ] && kill -- -"$(cat "$S/gpt.pid")" 2>/dev/null
    else TRAIN_WORK=$S/$v bash bench/train_bg.sh stop >/dev/null; fi
  done
  echo stopped
  ;;
*)
  echo "usage: bench/induction_control.sh start|status|probe TAG|collect|stop"; exit 2
  ;;
esac
