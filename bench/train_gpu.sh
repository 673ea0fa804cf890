#!/usr/bin/env bash
# Train the retrieval model on one GPU for one device-machine call (< 9 minutes), resumable.
#
#   bash bench/train_gpu.sh                # first run: fresh init
#   bash bench/train_gpu.sh .out/carry     # later runs: resume from what the last run returned
#
# Installs nothing; runs from the repo root with the machine's python3 (torch, safetensors,
# tokenizers, tqdm, jinja2 are there). Writes to $OUT (default .out/train):
#   ckpt.tar.00, ckpt.tar.01, ...   the output directory (checkpoint + trainer state + log) as a
#                                   tar split in 15 MiB parts (model.safetensors alone is > 16 MiB,
#                                   the device tool's per-file limit)
#   summary.json, train_log.jsonl, train_stdout.log
# To resume, copy those files into an ignored folder of the repo (e.g. .out/carry), name it in the
# device call's `carry`, and pass it as the first argument. See docs/training.md.
set -uo pipefail
OUT=${OUT:-.out/train}
CARRY=${1:-}
MINUTES=${TRAIN_MINUTES:-8}
WORK=${TRAIN_WORK:-/tmp/longctx-train}
PY=${PYTHON:-python3}
# extra flags for python -m longctx.train (later flags win), e.g. TRAIN_ARGS="--device cpu --steps 3"
read -r -a EXTRA <<<"${TRAIN_ARGS:-}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/ckpt" "$WORK/resume"

RESUME=()
if [ -n "$CARRY" ]; then
  if compgen -G "$CARRY/ckpt.tar.*" >/dev/null; then
    mkdir -p "$WORK/resume"
    cat "$CARRY"/ckpt.tar.* | tar -xf - -C "$WORK/resume" || { echo "cannot unpack $CARRY/ckpt.tar.*"; exit 2; }
    RESUME=(--resume "$WORK/resume/ckpt")
  elif [ -f "$CARRY/trainer_state.pt" ]; then
    RESUME=(--resume "$CARRY")
  else
    echo "no ckpt.tar.* or trainer_state.pt in $CARRY"; exit 2
  fi
fi

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

"$PY" -m longctx.train --config configs/retrieval.json --out "$WORK/ckpt" \
  --max-minutes "$MINUTES" --print-every 100 --eval-samples 5 --eval-lengths 1024,4096 \
  "${RESUME[@]}" "${EXTRA[@]}" 2>&1 | tee "$OUT/train_stdout.log"
status=${PIPESTATUS[0]}

if [ -f "$WORK/ckpt/trainer_state.pt" ]; then
  rm -f "$OUT"/ckpt.tar.*
  tar -C "$WORK" -cf - ckpt | split -b 15m -d -a 2 - "$OUT/ckpt.tar."
  cp "$WORK/ckpt/train_log.jsonl" "$OUT/"
  [ -f "$WORK/ckpt/summary.json" ] && cp "$WORK/ckpt/summary.json" "$OUT/"
  ls -l "$OUT"
  "$PY" - "$WORK/ckpt/train_log.jsonl" <<'EOF'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
if rows:
    r = rows[-1]
    print(f"step {r['step']}  seq {r['seq_len']}x{r['batch']}  loss {r['loss']:.4f}  "
          f"answer_acc {r['answer_acc']:.3f}  exact {r['answer_exact']:.3f}  tokens/s {r['tokens_per_s']:.0f}")
EOF
fi
exit "$status"
