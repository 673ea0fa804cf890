#!/usr/bin/env bash
# Train the retrieval model in the background on one GPU of the device machine, so training runs on
# across several device calls (and beside other GPU work in them) while the machine stays held.
#
#   TRAIN_GPU=0 TRAIN_MINUTES=14 bash bench/train_bg.sh start   # detached (setsid): survives the call
#   bash bench/train_bg.sh status                              # last log lines, running or not
#   bash bench/train_bg.sh wait                                # block until training has exited
#   bash bench/train_bg.sh stop                                # kill this training (its process group)
#   bash bench/train_bg.sh collect [full]                      # pack into $OUT: the shipped model as
#                                                              # model.tar.NN (15 MiB parts), logs;
#                                                              # `full` adds the trainer state (resume)
#
# The schedule is fitted to TRAIN_MINUTES (`--steps 0`: a short probe times a step at every
# curriculum length first). TRAIN_ARGS appends flags to python -m longctx.train (later flags win);
# TRAIN_SAVE_EVERY: steps between checkpoints (100: what `collect` brings back if the machine is lost).
# Run from the repo root on the device machine; see docs/training.md.
set -uo pipefail
WORK=${TRAIN_WORK:-/tmp/longctx-train}
CKPT=$WORK/ckpt
LOG=$WORK/stdout.log
PY=${PYTHON:-python3}
cmd=${1:-status}

case "$cmd" in
start)
  mkdir -p "$WORK"
  rm -rf "$CKPT" "$WORK/done"
  read -r -a EXTRA <<<"${TRAIN_ARGS:-}"
  CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0} PYTHONUNBUFFERED=1 setsid nohup bash -c '
    "$0" -m longctx.train --config configs/retrieval.json --out "$1" --steps 0 --max-minutes "$2" \
      --print-every 100 --save-every "$4" --num-workers 8 "${@:5}" >"$3" 2>&1
    echo $? >"$(dirname "$1")/done"' \
    "$PY" "$CKPT" "${TRAIN_MINUTES:-14}" "$LOG" "${TRAIN_SAVE_EVERY:-100}" "${EXTRA[@]}" </dev/null >/dev/null 2>&1 &
  echo $! >"$WORK/pid"  # setsid made it a process group leader: `stop` kills that group only
  sleep 1
  echo "training started on GPU ${TRAIN_GPU:-0} for ${TRAIN_MINUTES:-14} min; log $LOG"
  ;;
status)
  [ -f "$WORK/done" ] && echo "training exited with $(cat "$WORK/done")" || echo "training running"
  grep -v '^\s*$' "$LOG" 2>/dev/null | tail -n "${2:-4}" | cut -c1-400
  exit 0
  ;;
wait)
  while [ ! -f "$WORK/done" ]; do sleep 5; done
  echo "training exited with $(cat "$WORK/done")"
  ;;
stop)
  [ -f "$WORK/pid" ] && kill -- -"$(cat "$WORK/pid")" 2>/dev/null
  echo "training stopped"
  ;;
collect)
  OUT=${OUT:-.out/train}
  mkdir -p "$OUT"
  [ -f "$CKPT/model.safetensors" ] || { echo "no checkpoint in $CKPT yet"; exit 1; }
  rm -rf "$WORK/pack" && mkdir -p "$WORK/pack"
  if [ "${2:-}" = full ]; then
    cp -r "$CKPT" "$WORK/pack/ckpt"
  else
    "$PY" -c "import sys; from longctx.train.checkpoint import export_model; export_model(sys.argv[1], sys.argv[2])" \
      "$CKPT" "$WORK/pack/ckpt"
    cp "$CKPT"/train_log.jsonl "$WORK/pack/ckpt/" 2>/dev/null
  fi
  cp "$LOG" "$WORK/pack/ckpt/train_stdout.log"
  rm -f "$OUT"/model.tar.*
  tar -C "$WORK/pack" -cf - ckpt | split -b 15m -d -a 2 - "$OUT/model.tar."
  ls -l "$OUT"
  ;;
*)
  echo "usage: bench/train_bg.sh start|status|wait|stop|collect [full]"; exit 2
  ;;
esac
