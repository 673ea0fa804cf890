#!/usr/bin/env bash
# One device session's GPU work, run detached so it goes on between device calls (the machine stays
# held while calls follow each other; each call is <= 10 minutes and the machine is given back 30 s
# after the last one ends):
#
#   bash bench/session.sh start     # launch both lanes (setsid) and return
#   bash bench/session.sh status    # what each lane is doing, last lines of its log
#   bash bench/session.sh collect   # pack what is done so far into $OUT (safe to repeat)
#   bash bench/session.sh until N   # wait while the lanes run (N seconds at most), then status, collect
#   bash bench/session.sh stop      # kill both lanes
#
# Lane A (GPU 0): train the retrieval model for TRAIN_MINUTES (bench/train_bg.sh, TRAIN_ARGS as
#   there; default: from models-shipped/retrieval-wip), then score it through longctx
#   (bench/retrieval_eval.py, uncapped: 4k, 32k, the documents form at 4k), HiSparse at 128K with a
#   RULER prompt (bench/long_context.py --prompt ruler; then that decode profiled capped and uncapped,
#   bench/step_profile.py --prompt ruler), 128k, then uncapped 1M samples until stopped.
# Lane B (GPU 1): the GPU checks (bench/gpu_check.py: graph vs eager tokens, transformers parity),
#   decode / prefill profiles (bench/step_profile.py), bench/vs_transformers.py, the indexer kernels,
#   then, once the model exists, HiSparse-capped 1M samples until stopped. With one GPU the checks
#   and profiles run first (undisturbed; CHECKS=0 leaves them out), then lane A, with the capped 1M
#   samples beside lane A's evaluation once its timed part (long_context and the profiles at 128K) is done.
# LANE_B=train (two GPUs): lane B instead trains a second recipe (TRAIN_ARGS_B; default run 26 without its
#   256K rows, run 26b) on GPU 1 and scores it
#   as lane A does, under $SESSION/b (its model in $OUT/b); no checks, no capped 1M lane, and neither lane
#   takes issue 5's HiSparse figures unless HISPARSE=1: an A/B of two recipes in one session.
# The lanes run from a copy of the tree in $SESSION/src (installed there), so a later call's carry
# that replaces the checkout does not pull the files out from under them.
# The evaluation is gated: 4K first, and 32K/128K/1M (and the capped 1M lane) only when the 4K
# average reaches EVAL_GATE (default 20 of 100).
# Every job's output lands under $SESSION (default /tmp/longctx-session); `collect` copies the small
# files into $OUT/results.tgz and the trained model into $OUT/model.tar.NN.
# Knobs (environment): TRAIN_MINUTES, TRAIN_ARGS (bench/train_bg.sh), PROFILES (the step profiles of
#   the checks), RULER_PROFILES=0 (no lane A profiles of the trained model's 128K decode), VS=0 (no
#   vs_transformers / indexer kernels in the checks), EVAL=0 (train only), CHECKS=0 (no lane B checks
#   and profiles at all: on one GPU, training starts at once), LANE_B=train and TRAIN_ARGS_B (above),
#   HISPARSE=0 (no long_context / RULER profiles / place_bench / hit_rate in lane A), FORK=0 / KEEP_AB=0 (no
#   second capped run with LONGCTX_HISPARSE_FORK=0 / LONGCTX_CAND_KEEP=0), PARITY=0 (no
#   bench.long_parity at 1M in lane A) and PARITY_SECONDS (its bound, 480), MID_LENGTHS, TOPK_1M,
#   CAPPED=0 (one GPU: no capped 1M lane beside lane A's evaluation), TRAIN=0 (lane A scores EVAL_MODEL,
#   default the shipped model, without training), WINDOW=W (every score, needle recall and parity with
#   `--index-local-window W`), TOPK=K (the same with `--index-topk K`, the capped 1M lane's too),
#   CAPPED_SAMPLES / CAPPED_TASKS (the capped 1M lane's samples a task, 5, and tasks, niah_single_1 and
#   niah_multikey_1), EARLY_1M=N (N niah_single_1 samples at 1M right after the 4K gate;
#   EARLY_1M_INDICES=I,J,...: those sample indices instead; SCORE_32K=0: no 32K or documents scores,
#   e.g. a TRAIN=0 call on weights an earlier call trained and scored there; DIAG_1M=P: below P of 100 on them,
#   bench.needle_context at 128K and 1M on the shipped and the trained model and the shipped model's near
#   1M needles with the top DIAG_TOPK (128) before the other scores),
#   ALT_WINDOW=W (4 of them with another window before the last 1M run), PARITY_MODEL (the 1M parity's
#   weights; default the scored model), CAPPED_FIRST=N (two GPUs, the default lane B: N niah_single_1
#   samples at 1M of the shipped model, CAPPED_FIRST_MODEL, under a 10% HiSparse cap while lane A trains;
#   on one GPU once lane A's timed figures are done), TRAIN_LR, NEEDLE_FORM, NEEDLE_WEIGHT, COPY_HEX,
#   POSE_FAR and CURRICULUM (default_train_args' rate, 2e-4, needle form, bytes, needle weight, 1.0, UUID
#   copy rows, 0, far PoSE skips, 0, and curriculum, rows on to 256K),
#   BF16KV_FIRST=N (then N of them uncapped with a bf16 KV cache), PARITY_FORMS (bench.long_parity's forms).
#   KV_AB=1 (after the 4K gate, the 4K scores again with `--kv-dtype bf16` into eval/bf16kv).
#   TRAIN_EXTRA (flags after the rest of default_train_args'; later flags win).
#   TRAIN_SEED / TASK_WEIGHTS / INIT_FROM (default_train_args' rows seed, 26, `--task-weights`, and the
#   weights it starts from, the shipped model's), VT_HOPS (`--vt-hops`), COPY_UPPER (`--copy-upper-fraction`), COPY_PAIRS (`--copy-pairs-fraction`), KEY_BINDING=1
#   (bench.key_binding at 4K on the scored and the shipped model after the 4K gate); CURRICULUM_B /
#   INIT_FROM_B (LANE_B=train's own curriculum and starting weights).
#   PRE_MINUTES=N PRE_ARGS="flags": lane A first trains N minutes with PRE_ARGS after its flags, then
#   trains TRAIN_MINUTES from those weights (e.g. PRE_ARGS="--task-weights vt=1,... --curriculum 0:2048").
#   COPY_PROBE=1: bench.copy_probe on the first training's weights and on the trained ones as each is
#   saved (into copy_probe/pre and copy_probe/main, ~1 minute each on the GPU).
# LANE_A=score1m: no training; SCORE_1M (20) samples of SCORE_TASKS (niah_single_1) at 1M of EVAL_MODEL
#   uncapped and capped, after issue 5's HiSparse figures on it (lane_score_1m; two GPUs: the capped samples
#   on GPU 1).
# LANE_B=eval (two GPUs): lane B scores EVAL_MODEL with WINDOW_B (default 64; ALT_WINDOW_B) under $S/b
#   beside lane A's training.
# Triton's cache: `collect` writes $OUT/triton-cache.tgz; copy it to .cache/triton-cache.tgz and name that
#   path in the next session's device calls' carry, and `start` unpacks it (TRITON_CACHE_TGZ).
# Budget (30 device minutes): ~1.5 min machine start + TRAIN_MINUTES (16) + ~8 min of evaluation;
# end every call with `collect`, since the machine (and /tmp) goes back 30 s after the last call.
set -uo pipefail
S=${SESSION:-/tmp/longctx-session}
PY=${PYTHON:-python3}
TRAIN_WORK=$S/train
export TRAIN_WORK PYTHONUNBUFFERED=1
MODEL=$TRAIN_WORK/ckpt
# sha256 of the shipped weights that bench/results/training/eval-run36a-1m-h200.jsonl scored (lane_score_1m's seeds)
SEED_1M_SHA=328887d846ff98164119d92a9d5c245509ff4918eb7de1106ce4a50885149877
[ "${TRAIN:-1}" = 0 ] && MODEL=${EVAL_MODEL:-models-shipped/retrieval-wip}  # (TRAIN=0: lane A's model)
# Triton's compiled kernels live at one path every session (its cache entries name their files by
# absolute path), so a cache carried from an earlier session (below) is found again
export TRITON_CACHE_DIR=$S/triton-cache
export S PY MODEL SEED_1M_SHA
cmd=${1:-status}
ngpu() { "$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0; }

checks_pass() {
  # $1: a bench.gpu_kernel_check JSON; exit 0 when every case in it passed
  "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(not all(v["ok"] for v in r.values()))' "$1"
}

check_or_mark() {
  # bench.gpu_kernel_check's cases named like $1 into $S/checks/$2; if one fails, touch the marker $S/$3
  # (which the callers turn into a fallback for the rest of the session) and say so ($4: the fallback)
  "$PY" -m bench.gpu_kernel_check --only "$1" --out "$S/checks/$2"
  checks_pass "$S/checks/$2/gpu-kernel-check.json" || { echo "$1 check failed: $4"; touch "$S/$3"; }
}

hisparse_measures() {
  # issue 5's figures with the model in $MODEL:
  # the placement kernels against their reference on this GPU before the first capped run (the victim
  # candidates are new in the thirteenth session; 13,107 and 104,857 slots, batch 1 and 8)
  check_or_mark place_ place place.serial "the rest of the session keeps the one-program select"
  [ -f "$S/place.serial" ] && export LONGCTX_PLACE_PARALLEL=0 LONGCTX_PLACE_CANDIDATES=0
  # the kept victim candidates (new in the twenty-fourth session) against the reference over decode-like
  # sequences; if they fail, the session selects every step (LONGCTX_CAND_KEEP=0)
  check_or_mark keep_cand keep keep.off "LONGCTX_CAND_KEEP=0"
  [ -f "$S/keep.off" ] && export LONGCTX_CAND_KEEP=0
  "$PY" -m bench.long_context --model "$MODEL" --phases 128k --prompt ruler --out "$S/long_context"
  # where the capped step's extra time goes with a trained model (issue 5: 1.39x at 0.75 hits in the
  # eleventh session, 0.27 ms of it the one-program placement): the 128K decode on RULER prompts profiled
  # capped and uncapped (RULER_PROFILES=0: skip)
  if [ "${RULER_PROFILES:-1}" = 1 ]; then
    for cap in "--hisparse-device-tokens 13106" ""; do
      # shellcheck disable=SC2086  # $cap is two words or none
      "$PY" -m bench.step_profile --model "$MODEL" --phase decode --tokens 131072 --prompt ruler $cap \
        --out "$S/profiles"
    done
    # the placement alone at this model's shape (top-256 into 13,107 slots; 1M's 104,857), the single
    # program's select against the parallel passes, with host time and as kernels replayed from a graph;
    # `cand_par graph us`: the step's candidates selected by the parallel passes (the one program took
    # 47.6 us a step at 13,107 slots in the fifteenth session; if cand_par beats cand there, lower
    # kernels/lru_place.py's CAND_PAR_MIN_BLOCKS below 7 blocks)
    # (PLACE_BENCH=0: skip)
    [ "${PLACE_BENCH:-1}" = 1 ] && "$PY" -m bench.place_bench --m 256 --n 13107 104857 --hit 0.75 1.0 --steps 30 \
      --out "$S/profiles"
  fi
  # the A/B of the fork (the victim candidates and the newest placement beside the first layer's indexer
  # and top-k inside the decode graph, on by default since the twenty-fourth session: 1.16x against 1.25x
  # unforked, the same tokens): the capped 128K RULER decode again with LONGCTX_HISPARSE_FORK=0, its greedy
  # tokens against uncapped, its step, and its kernels' timeline (FORK=0: skip)
  if [ "${FORK:-1}" = 1 ]; then
    LONGCTX_HISPARSE_FORK=0 "$PY" -m bench.long_context --model "$MODEL" --phases 128k --prompt ruler \
      --out "$S/long_context_nofork"
    LONGCTX_HISPARSE_FORK=0 "$PY" -m bench.step_profile --model "$MODEL" --phase decode --tokens 131072 \
      --prompt ruler --hisparse-device-tokens 13106 --out "$S/profiles_nofork"
  fi
  # the A/B of the kept victim candidates (twenty-fourth session; untimed before): the capped 128K RULER
  # decode again selecting every step (LONGCTX_CAND_KEEP=0), tokens, step and kernels (KEEP_AB=0: skip;
  # nothing to compare where the check turned them off)
  if [ "${KEEP_AB:-1}" = 1 ] && [ ! -f "$S/keep.off" ]; then
    LONGCTX_CAND_KEEP=0 "$PY" -m bench.long_context --model "$MODEL" --phases 128k --prompt ruler \
      --out "$S/long_context_nokeep"
    LONGCTX_CAND_KEEP=0 "$PY" -m bench.step_profile --model "$MODEL" --phase decode --tokens 131072 \
      --prompt ruler --hisparse-device-tokens 13106 --out "$S/profiles_nokeep"
  fi
}

selection_flags() {
  # how the scored weights select, as retrieval_eval / needle_recall / long_parity flags: WINDOW=W
  # (--index-local-window), TOPK=K (--index-topk), TOPK_LONG=K with TOPK_LONG_FROM=P (--index-topk-long
  # K --index-topk-long-from P: queries from position P on select K). TOPK alone turns the checkpoint's
  # narrowing off (the shipped model's: 128 from 262,144), so every query selects K
  local off=""
  [ -n "${TOPK:-}" ] && [ -z "${TOPK_LONG:-}" ] && off="--index-topk-long 0"
  echo ${WINDOW:+--index-local-window "$WINDOW"} ${TOPK:+--index-topk "$TOPK"} $off \
    ${TOPK_LONG:+--index-topk-long "$TOPK_LONG" --index-topk-long-from "${TOPK_LONG_FROM:-262144}"}
}

default_train_args() {
  # run 26: run 23's recipe (shipped: run 21's with the needle loss per byte over every causal key,
  # --needle-form bytes) from run 23's weights with fresh rows (--seed 26) and real rows on to 256K (the
  # curriculum's second half; every run before stopped at 128K and reached 1M only through PoSE skips).
  # Run 23 at 1M (20 samples) misses every needle that sits within ~70K bytes of the question (samples 0,
  # 5, 15, 16: 0 of 4) and 3 of the other 16 (`retrieval_eval depth`, docs/training.md "Run 25"), where at
  # 128K it gets all 20: a needle read after ~1M real tokens, not a long copy distance, is what fails, and
  # PoSE stretches positions, not the number of keys before the needle. Run 25's far skips (--pose-far 0.5)
  # did not help (1M: 3 of samples 0-7 against run 23's 6), so they are off (POSE_FAR).
  # Every full layer keeps each query's newest 64 positions in its selection (--index-local-window 64, also
  # in the checkpoint), each full layer's indexer KL aims at its IndexShare group's mean attention
  # (--kl-share), the fused selection where the probe times it faster; a length whose step does not fit
  # in memory is dropped by the planner (its `dropped_lengths`). TRAIN_LR / NEEDLE_FORM / NEEDLE_WEIGHT /
  # COPY_HEX / POSE_FAR / CURRICULUM: its rate (2e-4), needle form (bytes), needle weight (1.0), UUID copy
  # rows (0), far PoSE skips (0), curriculum; TRAIN_SEED / TASK_WEIGHTS: its rows' seed (26) and the
  # retrieval tasks' mix (`--task-weights TASK=W,...`; default each alike); INIT_FROM: the weights it
  # starts from (default the shipped model's; e.g. models-candidates/run29); VT_HOPS: vt rows' chain
  # lengths (`--vt-hops`, e.g. 1,2,3,4; default RULER's 4); COPY_UPPER: the share of copy rows whose strings
  # are capitals (`--copy-upper-fraction`, as vt's names; default none); COPY_PAIRS: the share of copy rows
  # written as pairs (`--copy-pairs-fraction`: each string twice among random chunks; default none);
  # TRAIN_EXTRA: any further flags, last (later flags win: e.g. "--lead-weight 2 --warmup-steps 100")
  echo "--init-from ${INIT_FROM:-models-shipped/retrieval-wip} --lr ${TRAIN_LR:-2e-4} --warmup-steps 30 \
--needle-weight ${NEEDLE_WEIGHT:-1.0} --needle-form ${NEEDLE_FORM:-bytes} --pose-max 1048576 \
--pose-far ${POSE_FAR:-0} --chat-fraction 0.25 --document-fraction 0.25 --copy-hex-fraction ${COPY_HEX:-0} \
--curriculum ${CURRICULUM:-0:4096,1000:16384,2500:65536,4000:131072,5000:262144} \
--replay-fraction 0.3 --dense-warmup-steps 0 --select auto --seed ${TRAIN_SEED:-26} --index-local-window 64 \
--kl-share${TASK_WEIGHTS:+ --task-weights $TASK_WEIGHTS}${VT_HOPS:+ --vt-hops $VT_HOPS}\
${COPY_UPPER:+ --copy-upper-fraction $COPY_UPPER}${COPY_PAIRS:+ --copy-pairs-fraction $COPY_PAIRS}\
${TRAIN_EXTRA:+ $TRAIN_EXTRA}"
}

default_train_args_b() {
  # LANE_B=train's default: run 26 without its 256K rows (run 26b: run 23's recipe again from run 23 with
  # run 26's seed, rows to 128K): the A/B of the real long rows, and of the seed. CURRICULUM_B / INIT_FROM_B:
  # lane B's own curriculum and starting weights (INIT_FROM_B set empty: the shipped model's, whatever
  # lane A's INIT_FROM), the rest of lane A's knobs alike
  INIT_FROM=${INIT_FROM_B-${INIT_FROM:-}} CURRICULUM=${CURRICULUM_B:-0:4096,1000:16384,3000:65536,6500:131072} \
    default_train_args
}

copy_probe() {
  # COPY_PROBE=1: bench.copy_probe on weights $1 (GPU $3) into $S/copy_probe/$2 (~1 minute): copying by
  # alphabet and by the byte's place in the string, and vt's parts, as soon as the weights exist
  [ "${COPY_PROBE:-0}" = 1 ] || return 0
  CUDA_VISIBLE_DEVICES=$3 "$PY" -m bench.copy_probe --model "$1" --device cuda --out "$S/copy_probe/$2" \
    >"$S/logs/copy_probe_$2.log" 2>&1 || echo "copy_probe on $1 failed (logs/copy_probe_$2.log)"
}

lane_a() {
  # $1: the GPU (default 0). Train TRAIN_ARGS (default_train_args), then score the model (TRAIN=0: score
  # EVAL_MODEL, default the shipped one, without training; WINDOW=W: every score, the needle recall and
  # the parity with `--index-local-window W`, the same weights keeping each query's newest W positions)
  local gpu=${1:-0}
  local args=${TRAIN_ARGS:-$(default_train_args)}
  local sel=()  # how the scored weights select: WINDOW / TOPK / TOPK_LONG (selection_flags)
  read -r -a sel <<<"$(selection_flags)"
  if [ "${TRAIN:-1}" = 0 ]; then
    MODEL=${EVAL_MODEL:-models-shipped/retrieval-wip}
    args=""
    echo "TRAIN=0: scoring $MODEL ${sel[*]}"
  fi
  if [[ "$args" == *"--select auto"* || "$args" == *"--select fused"* ]]; then
    # the fused selection against the chunked one on this GPU first (~1 minute): the probe falls back
    # on a fused step that fails, not on one that selects wrongly
    # (the cases take the trainer's tf32x3 products but `_ieee`: if only the tf32x3 ones fail, training
    # keeps the fused selection with exact products)
    CUDA_VISIBLE_DEVICES=$gpu "$PY" -m bench.gpu_kernel_check --only train_select --out "$S/checks/select"
    # exit 0: every case passed; 3: only the exact-product ones did; else: none to trust
    local verdict=0
    "$PY" -c 'import json, sys
r = json.load(open(sys.argv[1]))
ieee = [v["ok"] for n, v in r.items() if n.endswith("_ieee")]
sys.exit(0 if r and all(v["ok"] for v in r.values()) else 3 if ieee and all(ieee) else 1)' \
      "$S/checks/select/gpu-kernel-check.json" || verdict=$?
    if [ "$verdict" = 3 ]; then
      echo "fused selection check: tf32x3 products failed, exact ones passed: training takes --select-dot ieee"
      args="$args --select-dot ieee"
    elif [ "$verdict" != 0 ]; then
      echo "fused selection check failed: training selects with the chunked torch form"
      args=${args/--select auto/--select torch}
      args=${args/--select fused/--select torch}
    fi
  fi
  if [ -n "$args" ] && [ "${PRE_MINUTES:-0}" != 0 ]; then
    # PRE_MINUTES=N PRE_ARGS="flags": a first training of N minutes, lane A's flags with PRE_ARGS after
    # them (later flags win: e.g. a task mix of vt rows alone at 2K), under $S/pre; the training below
    # then starts from its weights (its log in logs/pre_train_stdout.log)
    TRAIN_WORK=$S/pre/train TRAIN_GPU=$gpu TRAIN_MINUTES=$PRE_MINUTES TRAIN_ARGS="$args ${PRE_ARGS:-}" \
      bash bench/train_bg.sh start
    TRAIN_WORK=$S/pre/train bash bench/train_bg.sh wait
    if [ -f "$S/pre/train/ckpt/model.safetensors" ]; then
      args="$args --init-from $S/pre/train/ckpt"
      copy_probe "$S/pre/train/ckpt" pre "$gpu"
    else
      echo "the first training saved nothing: the training starts from its own weights"
    fi
  fi
  if [ -n "$args" ]; then
    TRAIN_GPU=$gpu TRAIN_MINUTES=${TRAIN_MINUTES:-16} TRAIN_ARGS="$args" bash bench/train_bg.sh start
    bash bench/train_bg.sh wait
    [ -f "$MODEL/model.safetensors" ] && copy_probe "$MODEL" main "$gpu"
  fi
  touch "$S/model.ready"
  export CUDA_VISIBLE_DEVICES=$gpu
  [ "${EVAL:-1}" = 1 ] || { touch "$S/eval.stop"; return 0; }  # EVAL=0: train only
  if [ ! -f "$MODEL/model.safetensors" ]; then
    # training died before any save: nothing to score, but issue 5's figures still come, on the shipped
    # model (their RULER prompts need a trained one)
    echo "no trained checkpoint in $MODEL: HiSparse measured on the shipped model, nothing scored"
    touch "$S/eval.stop"
    MODEL=models-shipped/retrieval-wip hisparse_measures
    touch "$S/timed.done"
    return 0
  fi
  # a selection window (WINDOW, or run 21's --index-local-window): decode through CUDA graphs, capped or
  # not, against eager decode with it on this GPU first (~1 minute; never run on a GPU before)
  if [ -n "${WINDOW:-}" ] || [[ "$args" == *"--index-local-window"* ]]; then
    "$PY" -m bench.gpu_check --only window --out "$S/checks/window"
  fi
  # TOPK_LONG: the narrowing's graphs against eager decode likewise (new in the twenty-sixth session)
  [ -n "${TOPK_LONG:-}" ] && "$PY" -m bench.gpu_check --only topk_long --out "$S/checks/topk_long"
  # the gate: a quick 4K score first; the long lengths (minutes each) only for a model that retrieves
  "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 4k --samples 20 "${sel[@]}" --out "$S/eval/uncapped"
  if ! "$PY" -m bench.retrieval_eval gate "$S/eval/uncapped" --length 4k --min "${EVAL_GATE:-20}"; then
    touch "$S/eval.stop"
    return 0
  fi
  touch "$S/eval.go"
  # KV_AB=1: the 4K scores again with a bf16 KV cache (eval/bf16kv, ~90 s): the default on CUDA is fp8,
  # which cost run 34's multi-value / multi-query ~16 points at 4K on the CPU (docs/training.md, run 35)
  if [ "${KV_AB:-0}" = 1 ]; then
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 4k --samples 20 --kv-dtype bf16 "${sel[@]}" \
      --out "$S/eval/bf16kv"
  fi
  # KEY_BINDING=1: whether the scored model matches a multi-key question's key to its needle
  # (bench.key_binding at 4K, 20 samples; seconds on a GPU), then the shipped model's beside it
  if [ "${KEY_BINDING:-0}" = 1 ]; then
    "$PY" -m bench.key_binding --model "$MODEL" --lengths 4k --samples 20 --device cuda "${sel[@]}" \
      --out "$S/key_binding/scored"
    [ "$MODEL" != models-shipped/retrieval-wip ] && "$PY" -m bench.key_binding \
      --model models-shipped/retrieval-wip --lengths 4k --samples 20 --device cuda --out "$S/key_binding/shipped"
  fi
  # EARLY_1M=N: N niah_single_1 samples at 1M first (the figure the session is for; the last 1M run
  # below goes on from them); EARLY_1M_INDICES=I,J,...: those sample indices instead of 0..N-1
  if [ "${EARLY_1M:-0}" != 0 ] || [ -n "${EARLY_1M_INDICES:-}" ]; then
    local pick=(--samples "${EARLY_1M:-1}")
    [ -n "${EARLY_1M_INDICES:-}" ] && pick+=(--indices "$EARLY_1M_INDICES")
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 1m "${pick[@]}" --concurrency 1 \
      --tasks niah_single_1 "${sel[@]}" --out "$S/eval/uncapped_1m"
  fi
  # DIAG_1M=P: when those 1M samples score below P (0-100) the model ships nothing, so before the other
  # scores: how a late needle's own rows attend at 128K and 1M (bench.needle_context: their share on far
  # haystack keys, the first two samples with the needle's value at depth >= 0.9), the shipped model's and
  # this one's
  if [ -n "${DIAG_1M:-}" ] && ! "$PY" -m bench.retrieval_eval gate "$S/eval/uncapped_1m" --length 1m \
    --min "$DIAG_1M"; then
    for m in shipped:models-shipped/retrieval-wip "trained:$MODEL"; do
      "$PY" -m bench.needle_context --model "${m#*:}" --lengths 128k,1m --samples 2 --min-depth 0.9 \
        --device cuda --out "$S/needle_context/${m%%:*}"
    done
    # and whether fewer far keys bring them back: the shipped model's four near needles at 1M (samples 0,
    # 5, 15, 16: 0 of 4 with its top 256) selecting the top DIAG_TOPK (default 128: the window's 64 and 64
    # far keys; empty: skip)
    if [ -n "${DIAG_TOPK-128}" ]; then
      "$PY" -m bench.retrieval_eval run --model models-shipped/retrieval-wip --lengths 1m --samples 1 \
        --indices 0,5,15,16 --concurrency 1 --tasks niah_single_1 --index-topk "${DIAG_TOPK-128}" \
        --index-topk-long 0 --out "$S/eval/topk${DIAG_TOPK-128}_1m_shipped"
    fi
  fi
  # 32K, then HiSparse at 128K on a RULER prompt (issue 5's hit rate: a few minutes), then the 128K
  # scores (140 long prefills: the longest part). SCORE_32K=0: no 32K or documents scores (an earlier
  # call that trained these weights has them), straight on to the long ones
  if [ "${SCORE_32K:-1}" = 1 ]; then
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 32k --samples 20 "${sel[@]}" --out "$S/eval/uncapped"
    # the QA endpoint's prompt (document, then question, no instruction line or answer prefix) at 4K
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 4k --samples 20 --documents \
      --tasks niah_single_1,niah_single_2,niah_multikey_1 "${sel[@]}" --out "$S/eval/documents"
  fi
  # HISPARSE=0 (the default with LANE_B=train): issue 5's figures left out, for the scores' time
  [ "${HISPARSE:-1}" = 1 ] && hisparse_measures
  touch "$S/timed.done"  # one GPU: the capped 1M lane starts now, after the only timed figures
  "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 128k --samples 20 "${sel[@]}" --out "$S/eval/uncapped"
  # issue 5's hit rate by layer at 128K (on the CPU layer 0 kept 0.42 of its selection resident at 32K,
  # layers 3-5 0.955): eager decode, so the recorder sees every step's selection (graphs replay unseen)
  [ "${HISPARSE:-1}" = 1 ] && LONGCTX_CUDA_GRAPHS=0 LONGCTX_OVERLAP=0 timeout 300 "$PY" -m bench.hit_rate \
    --model "$MODEL" --tokens 131072 --steps 32 --policies --tail 128 --device cuda --out "$S/hit_rate"
  # where between 128K (run 17: niah_single_1 100) and 1M (0, haystack prose) retrieval breaks (19b, nearly
  # run 17: 1 of 2 right at 256K and at 512K):
  # niah_single_1 at 256K and 512K (MID_LENGTHS; empty: skip; MID_SAMPLES a length), ~1 minute
  if [ -n "${MID_LENGTHS-256k,512k}" ]; then
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths "${MID_LENGTHS-256k,512k}" --samples "${MID_SAMPLES:-4}" \
      --concurrency 1 --tasks niah_single_1 "${sel[@]}" --out "$S/eval/mid"
  fi
  # at 1M the shipped model writes haystack prose although its full layers select the needle; the bench's
  # `local` column: how much of the prompt's last 64 positions (the question) the last prompt row
  # selects (on the CPU, run 17's layers 1 / 3 take 0.62 / 0.94 of them at 4K, 0.31 / 0.41 at 32K)
  "$PY" -m bench.needle_recall --model "$MODEL" --lengths 1m --samples 1 --device cuda "${sel[@]}" --out "$S/needle"
  # the same weights selecting the top TOPK_1M (e.g. 2048, the share of 1M that 256 is of 128K; default
  # 0: skip) at 1M
  if [ "${TOPK_1M:-0}" != 0 ]; then
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 1m --samples 1 --concurrency 1 \
      --tasks niah_single_1,niah_single_2 "${sel[@]}" --index-topk "$TOPK_1M" --index-topk-long 0 \
      --out "$S/eval/topk_1m"
  fi
  # the engine's last prompt row and the answer's space row (`--answer-row`: the first value byte, also by
  # the engine's decode step) at 1M against the training forward of the same weights (PARITY=0: skip;
  # PARITY_MODEL: other weights; PARITY_FORMS: the engine with bf16 KV too by default, since run 21's 1M miss
  # was a near tie at the first value byte that the engine's fp8 KV may tip). Bounded: ~2 minutes at one
  # row in the nineteenth session, where the window put the space first and the first value byte went
  # wrong: the model's or the decode path's?
  if [ "${PARITY:-1}" = 1 ]; then
    timeout "${PARITY_SECONDS:-480}" "$PY" -m bench.long_parity --model "${PARITY_MODEL:-$MODEL}" \
      --lengths 1m --forms "${PARITY_FORMS:-engine,engine_bf16kv,train}" --answer-row "${sel[@]}" --device cuda \
      --out "$S/parity"
  fi
  # ALT_WINDOW=W: 4 niah_single_1 samples at 1M with another window (e.g. 128) before the long 1M run
  if [ -n "${ALT_WINDOW:-}" ]; then
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 1m --samples 4 --concurrency 1 \
      --tasks niah_single_1 --index-local-window "$ALT_WINDOW" --out "$S/eval/window${ALT_WINDOW}_1m"
  fi
  "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 1m --samples 10 --concurrency 1 \
    --tasks niah_single_1,niah_multikey_1 "${sel[@]}" --out "$S/eval/uncapped_1m"
}

lane_score_1m() {
  # LANE_A=score1m: no training and no 4K-128K scores, for issue 10's 1M figure with 20 samples: SCORE_1M
  # (default 20) niah_single_1 samples at 1M of EVAL_MODEL (default the shipped model), uncapped and under a
  # 10% HiSparse cap, each going on from the samples already scored on that model (SEED_1M_UNCAPPED /
  # SEED_1M_CAPPED: results.jsonl files, default the shipped model's rows of the thirty-seventh and
  # thirty-eighth sessions, run 36a with its config's narrowing, 20 uncapped and 19 capped, when the shipped
  # weights are those (SEED_1M_SHA), and none for another EVAL_MODEL; the runner skips the samples a file has). First issue 5's figures on it (hisparse_measures without place_bench: the
  # capped 128K RULER decode forked and with LONGCTX_HISPARSE_FORK=0, its step profiles; HISPARSE=0: not).
  # With another selection (selection_flags: WINDOW / TOPK / TOPK_LONG) every run takes it, nothing is
  # seeded (those rows are the model's own selection's), and TOPK_LONG's graphs are checked first;
  # SCORE_MID (e.g. 256k,512k): 4 samples a task at those lengths before the 1M ones. SCORE_TASKS: the
  # tasks scored (default niah_single_1; the seeded rows are niah_single_1's, so others start afresh).
  # $1: the GPU; $2: uncapped (the measures, then the uncapped samples), capped, or both (one GPU: the
  # measures, the uncapped samples, then the capped ones)
  export CUDA_VISIBLE_DEVICES=$1
  MODEL=${EVAL_MODEL:-models-shipped/retrieval-wip}
  local n=${SCORE_1M:-20} runs=() sel=() kvf=()
  read -r -a sel <<<"$(selection_flags)"
  mkdir -p "$S/eval/uncapped_1m" "$S/eval/capped_1m"
  if [ ${#sel[@]} -eq 0 ]; then
    # (the default seeds are the shipped model's rows, and only while its weights are SEED_1M_SHA's, the ones
    # those rows scored: another EVAL_MODEL or other shipped weights start afresh unless given their own)
    local seed_u="" seed_c=""
    if [ "$MODEL" = models-shipped/retrieval-wip ]; then
      if [ "$(sha256sum "$MODEL/model.safetensors" | cut -d' ' -f1)" = "$SEED_1M_SHA" ]; then
        seed_u=bench/results/training/eval-run36a-1m-h200.jsonl
        seed_c=bench/results/training/eval-run36a-1m-capped-h200.jsonl
        # those rows scored an fp8 cache of every layer: where the config now keeps layers out of fp8
        # (kv_fp8_skip_layers), the runs that go on from them store the KV as they did
        if grep -q '"kv_fp8_skip_layers"' "$MODEL/config.json"; then
          kvf=(--kv-fp8-skip-layers none)
          echo "score1m: the seeded 1M runs keep every layer in fp8, as their committed rows did"
        fi
      else
        echo "score1m: $MODEL is not the weights the committed 1M rows scored: no seeds"
      fi
    fi
    seed_u=${SEED_1M_UNCAPPED:-$seed_u} seed_c=${SEED_1M_CAPPED:-$seed_c}
    if [ -n "$seed_u" ] && [ ! -f "$S/eval/uncapped_1m/results.jsonl" ]; then
      cp "$seed_u" "$S/eval/uncapped_1m/results.jsonl"
    fi
    if [ -n "$seed_c" ] && [ ! -f "$S/eval/capped_1m/results.jsonl" ]; then
      cp "$seed_c" "$S/eval/capped_1m/results.jsonl"
    fi
  fi
  # the decode top-k's window (its write pass stores it since the twenty-third session) on this GPU first
  # (if it fails, the session composes the window after the top-k as before: LONGCTX_TOPK_WINDOW=0)
  if [ "$2" != capped ]; then
    check_or_mark topk_window topk topk.compose "LONGCTX_TOPK_WINDOW=0"
    touch "$S/topk.checked"
  else  # (two GPUs: the other lane's check decides for both; ~10 s)
    local t=0
    while [ ! -f "$S/topk.checked" ] && [ "$t" -lt 180 ]; do sleep 1; t=$((t + 1)); done
  fi
  [ -f "$S/topk.compose" ] && export LONGCTX_TOPK_WINDOW=0
  if [ "$2" != capped ] && [ -n "${TOPK_LONG:-}" ]; then
    "$PY" -m bench.gpu_check --only topk_long --out "$S/checks/topk_long"
  fi
  if [ "$2" != capped ]; then
    [ "${HISPARSE:-1}" = 1 ] && PLACE_BENCH=0 hisparse_measures
    if [ -n "${SCORE_MID:-}" ]; then
      "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths "$SCORE_MID" --samples 4 --concurrency 1 \
        --tasks "${SCORE_TASKS:-niah_single_1}" "${sel[@]}" --out "$S/eval/mid"
    fi
    runs+=(uncapped_1m)
  fi
  [ "$2" != uncapped ] && runs+=(capped_1m)
  local r
  for r in "${runs[@]}"; do
    local cap=()
    [ "$r" = capped_1m ] && cap=(--cap-fraction 0.1)
    "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 1m --samples "$n" --concurrency 1 \
      --tasks "${SCORE_TASKS:-niah_single_1}" "${cap[@]}" "${sel[@]}" "${kvf[@]}" --out "$S/eval/$r"
  done
}

lane_b_checks() {
  export CUDA_VISIBLE_DEVICES=$1
  [ "${CHECKS:-1}" = 1 ] || return 0  # CHECKS=0: training and its evaluation only
  "$PY" -m bench.gpu_kernel_check --out "$S/checks"  # each kernel vs its reference, a process each
  "$PY" -m bench.gpu_check --out "$S/checks"
  # PROFILES: ';'-separated bench.step_profile argument lists (default: decode at 2K, 128K, 128K
  # HiSparse-capped, batch 8, and a 16K prefill)
  local profiles=${PROFILES:-"--phase decode --tokens 2048;--phase decode --tokens 131072;\
--phase decode --tokens 131072 --hisparse-device-tokens 13107;--phase decode --tokens 2048 --batch 8;\
--phase prefill --tokens 16384"}
  local args
  IFS=';' read -r -a plist <<<"$profiles"
  for args in "${plist[@]}"; do
    # shellcheck disable=SC2086
    "$PY" -m bench.step_profile $args --out "$S/profiles"
  done
  if [ "${VS:-1}" = 1 ]; then  # VS=0: leave out the end-to-end comparison and the indexer kernels
    # end to end against transformers (overlap and the host-step changes), and the indexer's default
    "$PY" -m bench.vs_transformers --out "$S/vs"
    "$PY" -m bench.kernels --skip kv_write,topk,swap_in,sparse_mla_decode,moe,fp8_gemm,layer --out "$S/kernels"
  fi
  # issue 10: where the shipped model's long retrievals fail, the needle in each indexer's top-k or not
  # (the eval's first 10 samples of niah_single_1 / _2; eager, ~3 minutes), then the training step's
  # speed at 64K / 128K (~2 minutes). On its own GPU only: with one GPU it would hold up training
  # (NEEDLE=1 forces it, NEEDLE=0 leaves it out)
  if [ "${NEEDLE:-$([ "$1" = 1 ] && echo 1 || echo 0)}" = 1 ]; then
    "$PY" -m bench.needle_recall --model models-shipped/retrieval-wip --lengths 32k,128k --samples 10 \
      --device cuda --out "$S/needle"
    # issue 10's training speed at the lengths that move retrieval (a 128K step took 8.1 s, most of a
    # run): the gathered step with the chunked selection against the engine's fused indexer + top-k
    # (--select fused; never run on a GPU before), and one full layer's selection alone (select s)
    "$PY" -m bench.train_speed --lengths 65536,131072 --tokens 131072 --stages sparse --impls gather,fused,fused_ieee \
      --steps 2 --out "$S/train_speed"
    # at 1M the model writes prose capped or not: does any full layer still select the needle there?
    # (2 samples a task, ~70 s each)
    "$PY" -m bench.needle_recall --model models-shipped/retrieval-wip --lengths 1m --samples 2 \
      --device cuda --out "$S/needle"
  fi
}

lane_b_train() {
  # LANE_B=train on two GPUs: a second recipe trained and scored beside lane A's, everything under $S/b
  # (TRAIN_ARGS_B; default: default_train_args_b, lane A's default with rows on to 256K)
  S=$S/b
  TRAIN_WORK=$S/train
  MODEL=$TRAIN_WORK/ckpt
  export S TRAIN_WORK MODEL
  mkdir -p "$S"
  PARITY=0 TOPK_1M=0 TRAIN_ARGS=${TRAIN_ARGS_B:-$(default_train_args_b)} \
    lane_a 1  # (the engine's parity at 1M is lane A's)
}

lane_b_eval() {
  # LANE_B=eval on two GPUs: lane B scores an existing model (EVAL_MODEL, default the shipped one) with
  # WINDOW_B (default 64) beside lane A's training, everything under $S/b
  S=$S/b
  TRAIN_WORK=$S/train
  export S TRAIN_WORK
  mkdir -p "$S"
  PARITY=0 TOPK_1M=0 TRAIN=0 WINDOW=${WINDOW_B-64} ALT_WINDOW=${ALT_WINDOW_B:-} lane_a 1
}

lane_b_capped() {
  # $2: the marker to wait for: eval.go (the model passed the 4K gate) on its own GPU; timed.done on a
  # shared GPU, so long_context's ms/token figures are not taken beside it
  export CUDA_VISIBLE_DEVICES=$1
  local marker=${2:-eval.go}
  wait_marker() {
    while [ ! -f "$S/$1" ]; do
      [ -f "$S/eval.stop" ] && return 1
      sleep 10
    done
  }
  # on a shared GPU the shipped model's samples below wait for the marker too: beside the training they
  # cost run 22 40% of its steps (its planner's probe timed the 128K step twice as long)
  if [ "$marker" = timed.done ]; then wait_marker "$marker" || return 0; fi
  # CAPPED_FIRST=N: N niah_single_1 samples at 1M of the shipped model (CAPPED_FIRST_MODEL) under a 10% cap,
  # paired with its uncapped 1M samples of an earlier session (on its own GPU while lane A trains)
  if [ "${CAPPED_FIRST:-0}" != 0 ]; then
    "$PY" -m bench.retrieval_eval run --model "${CAPPED_FIRST_MODEL:-models-shipped/retrieval-wip}" --lengths 1m \
      --samples "$CAPPED_FIRST" --concurrency 1 --tasks niah_single_1 --cap-fraction 0.1 \
      --out "$S/eval/capped_1m_shipped"
  fi
  # BF16KV_FIRST=N: then N of them uncapped with a bf16 KV cache (CUDA's default is fp8; run 21's 1M miss was
  # a near tie at the first value byte, its engine and training forward 4e-2 apart)
  if [ "${BF16KV_FIRST:-0}" != 0 ]; then
    "$PY" -m bench.retrieval_eval run --model "${CAPPED_FIRST_MODEL:-models-shipped/retrieval-wip}" --lengths 1m \
      --samples "$BF16KV_FIRST" --concurrency 1 --tasks niah_single_1 --kv-dtype bf16 \
      --out "$S/eval/bf16kv_1m_shipped"
  fi
  wait_marker "$marker" || return 0
  [ -f "$S/place.serial" ] && export LONGCTX_PLACE_PARALLEL=0  # (lane A's placement check failed)
  [ -f "$S/keep.off" ] && export LONGCTX_CAND_KEEP=0  # (lane A's kept-candidates check failed)
  # 5 a task (CAPPED_SAMPLES; CAPPED_TASKS: the tasks): lane A's uncapped 1M lane gets through ~5 samples in
  # a session, and both wrote prose alike on all 5 in the fifteenth
  local sel=()
  read -r -a sel <<<"$(selection_flags)"
  "$PY" -m bench.retrieval_eval run --model "$MODEL" --lengths 1m --samples "${CAPPED_SAMPLES:-5}" --concurrency 1 \
    --tasks "${CAPPED_TASKS:-niah_single_1,niah_multikey_1}" --cap-fraction 0.1 "${sel[@]}" --out "$S/eval/capped_1m"
}

run_lanes() {
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$S/logs/pip.log" 2>&1 \
    || echo "pip install -e of the copy failed (see $S/logs/pip.log); running from the copy anyway"
  if [ "${LANE_A:-train}" = score1m ] && [ "$1" -ge 2 ]; then  # the capped samples on their own GPU
    lane_score_1m 0 uncapped >"$S/logs/lane_a.log" 2>&1 &
    lane_score_1m 1 capped >"$S/logs/lane_b.log" 2>&1 &
  elif [ "${LANE_A:-train}" = score1m ]; then
    lane_score_1m 0 both >"$S/logs/lane_a.log" 2>&1 &
  elif [ "$1" -ge 2 ] && [ "${LANE_B:-checks}" = train ]; then
    export HISPARSE=${HISPARSE:-0}
    lane_a 0 >"$S/logs/lane_a.log" 2>&1 &
    (lane_b_train) >"$S/logs/lane_b.log" 2>&1 &
  elif [ "$1" -ge 2 ] && [ "${LANE_B:-checks}" = eval ]; then
    export HISPARSE=${HISPARSE:-0}
    lane_a 0 >"$S/logs/lane_a.log" 2>&1 &
    (lane_b_eval) >"$S/logs/lane_b.log" 2>&1 &
  elif [ "$1" -ge 2 ]; then
    lane_a 0 >"$S/logs/lane_a.log" 2>&1 &
    { lane_b_checks 1; lane_b_capped 1; } >"$S/logs/lane_b.log" 2>&1 &
  else  # one GPU: the checks and profiles first, undisturbed; then training and its evaluation
    lane_b_checks 0 >"$S/logs/lane_b.log" 2>&1
    # CAPPED=0: no capped 1M lane beside lane A's evaluation (it shares the GPU and slows the scores)
    [ "${CAPPED:-1}" = 1 ] && { lane_b_capped 0 timed.done >>"$S/logs/lane_b.log" 2>&1 & }
    lane_a 0 >"$S/logs/lane_a.log" 2>&1 &
  fi
  wait
}

case "$cmd" in
start)
  # A machine can still be warm from the last call (the device tool's warm: true), its lanes still
  # scoring in the background: the thirty-sixth session's third call trained into the same
  # $S/train/ckpt that the second call's lane was scoring, and found that lane's samples "already done".
  # So an earlier session here is stopped and its files moved aside (Triton's cache stays: its entries
  # name their files by absolute path).
  if [ -f "$S/pids" ]; then
    old=$S.earlier-$(date +%Y%m%d-%H%M%S)-$$
    bash "$0" stop >/dev/null 2>&1
    sleep 1
    mkdir -p "$old"
    find "$S" -mindepth 1 -maxdepth 1 ! -name triton-cache -exec mv -t "$old" {} +
    echo "an earlier session was on this machine: its lanes stopped, its files moved to $old"
  fi
  mkdir -p "$S/logs"
  rm -f "$S/model.ready" "$S/eval.go" "$S/eval.stop" "$S/timed.done" "$S/topk.checked" "$S/topk.compose" \
    "$S/keep.off"
  # The lanes run from a private copy of the tree, installed there: the device tool replaces a carried
  # folder on every call, and a lane whose working directory was replaced under it finds no `bench`
  # (that cost a whole evaluation once). Later calls' status/collect may run from any copy.
  # A fresh machine compiles every Triton kernel again in the first process that runs it (~2 minutes of
  # the first evaluation and of key_binding). `collect` packs the cache into $OUT/triton-cache.tgz; carried
  # back as TRITON_CACHE_TGZ (default .cache/triton-cache.tgz, git-ignored) it is unpacked here. Triton
  # keys each entry on the kernel's source, its own version and the GPU: a stale or foreign entry is a miss.
  tc=${TRITON_CACHE_TGZ:-.cache/triton-cache.tgz}
  if [ -f "$tc" ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
    tar -xzf "$tc" -C "$S" triton-cache || echo "could not unpack $tc: Triton compiles afresh"
  fi
  rm -rf "$S/src" && mkdir -p "$S/src"
  trees=(bench configs kernels longctx models-shipped pyproject.toml README.md)
  [ -d models-candidates ] && trees+=(models-candidates)  # weights a run may start from (INIT_FROM)
  tar -cf - "${trees[@]}" | tar -xf - -C "$S/src"
  cd "$S/src" || exit 1
  n=$(ngpu)
  echo "$n GPU(s); session dir $S"
  # one process group (setsid) holds every lane: `stop` kills that group and nothing else
  setsid nohup bash -c "$(declare -f run_lanes checks_pass check_or_mark selection_flags default_train_args default_train_args_b copy_probe lane_a hisparse_measures lane_score_1m lane_b_checks lane_b_train \
    lane_b_eval lane_b_capped); run_lanes $n" \
    >"$S/logs/session.log" 2>&1 </dev/null &
  echo $! >"$S/pids"
  sleep 2
  echo started
  ;;
status)
  [ -d "$S/pre/train" ] && { echo "== the first training (PRE_MINUTES)"; TRAIN_WORK=$S/pre/train bash bench/train_bg.sh status 2; }
  bash bench/train_bg.sh status 2
  [ -d "$S/b/train" ] && { echo "== lane B's training"; TRAIN_WORK=$S/b/train bash bench/train_bg.sh status 2; }
  for f in "$S"/logs/*.log; do
    echo "== $f"
    grep -v '^\s*$' "$f" | tail -n "${2:-3}" | cut -c1-300
  done
  find "$S/eval" -name results.jsonl -exec sh -c 'echo "$1: $(wc -l <"$1") samples"' _ {} \; 2>/dev/null
  exit 0
  ;;
collect)
  OUT=${OUT:-.out/session}
  mkdir -p "$OUT"
  if [ -d "$S/pre/train" ]; then  # PRE_MINUTES' first training: its logs (its weights are the next one's)
    mkdir -p "$S/logs"
    cp "$S/pre/train/stdout.log" "$S/logs/pre_train_stdout.log" 2>/dev/null
    cp "$S/pre/train/ckpt/train_log.jsonl" "$S/logs/pre_train_log.jsonl" 2>/dev/null
    # and its weights while the training after it has saved none (to $OUT/pre): a machine lost between
    # calls then costs only the minutes since, not the first training too (INIT_FROM=<them> next time)
    if [ -f "$S/pre/train/ckpt/model.safetensors" ] && [ ! -f "$S/train/ckpt/model.safetensors" ]; then
      TRAIN_WORK=$S/pre/train OUT=$OUT/pre bash bench/train_bg.sh collect >/dev/null
    fi
  fi
  for d in "$S" "$S/b"; do  # lane A's run, and lane B's with LANE_B=train (its model in $OUT/b)
    [ -d "$d/train" ] || continue
    mkdir -p "$d/logs"
    cp "$d/train/stdout.log" "$d/logs/train_stdout.log" 2>/dev/null
    [ -f "$d/train/ckpt/train_log.jsonl" ] && cp "$d/train/ckpt/train_log.jsonl" "$d/logs/"
    if [ -f "$d/train/ckpt/model.safetensors" ]; then
      o=$OUT${d#"$S"}
      TRAIN_WORK=$d/train OUT=$o bash bench/train_bg.sh collect ${COLLECT_FULL:+full} >/dev/null
    fi
  done
  (cd "$S" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.log' \
    -o -name '*.png' \) -not -path './train/*' -not -path './b/train/*' -not -path './triton-cache/*' -print0 \
    | tar --null -czf "$OUT/results.tgz" -T -)
  # the compiled kernels, for the next session's carry (TRITON_CACHE_TGZ), unless they would crowd the
  # device tool's 64 MiB tree (TRITON_CACHE_MAX_MB, 20; the tree is ~28 MB). Only what a cache hit loads
  # (bench/triton_cache.py: the IRs were 110 MB of the thirtieth session's cache, over 12 MB packed).
  if [ -d "$TRITON_CACHE_DIR" ]; then
    if ! python3 -m bench.triton_cache pack "$TRITON_CACHE_DIR" "$OUT/triton-cache.tgz"; then
      echo "could not pack $TRITON_CACHE_DIR" && rm -f "$OUT/triton-cache.tgz"
    elif [ "$(du -m "$OUT/triton-cache.tgz" | cut -f1)" -gt "${TRITON_CACHE_MAX_MB:-20}" ]; then
      echo "triton-cache.tgz is over ${TRITON_CACHE_MAX_MB:-20} MB: not kept"
      rm -f "$OUT/triton-cache.tgz"
    fi
  fi
  ls -lR "$OUT"
  ;;
until)
  # bash bench/session.sh until SECONDS: wait while this machine's session runs, SECONDS at most (less
  # than the device call's limit_s, with a minute for the collect), then status and collect. It returns
  # as soon as the lanes are done, and at once, exit 3, on a machine without the session: the device tool
  # gave the last one back between calls (warm: false), and /tmp went with it.
  secs=${2:-}
  [[ "$secs" =~ ^[0-9]+$ ]] || { echo "usage: bench/session.sh until SECONDS (a whole number)"; exit 2; }
  [ -f "$S/pids" ] || { echo "no session in $S on this machine: it was given back between calls"; exit 3; }
  end=$((SECONDS + secs))
  alive() { while read -r pid; do kill -0 "$pid" 2>/dev/null && return 0; done <"$S/pids"; return 1; }
  while [ "$SECONDS" -lt "$end" ] && alive; do sleep 5; done
  alive && echo "still running after ${secs}s" || echo "the session's lanes are done"
  bash "$0" status "${3:-6}"
  bash "$0" collect
  ;;
stop)
  # only this session's process groups: never other users' or tests' processes with similar names
  while read -r pid; do kill -- -"$pid" 2>/dev/null; done <"$S/pids" 2>/dev/null
  bash bench/train_bg.sh stop >/dev/null
  [ -d "$S/pre/train" ] && TRAIN_WORK=$S/pre/train bash bench/train_bg.sh stop >/dev/null
  [ -d "$S/b/train" ] && TRAIN_WORK=$S/b/train bash bench/train_bg.sh stop >/dev/null
  echo stopped
  ;;
*)
  echo "usage: bench/session.sh start|status|until SECONDS|collect|stop"; exit 2
  ;;
esac
