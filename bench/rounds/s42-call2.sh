#!/usr/bin/env bash
# Forty-second session, device call 2: run 37 (trained in call 1, carried as .cache/run37/ckpt) scored
# where call 1 ran out of time: 4 niah_single_1 samples at 1M, then the rest of 128K (call 1's 24 rows
# seed the run directory, so `longctx ruler` skips them). Rows land straight under $OUT, so a timeout
# loses only the sample in flight. Usage (device):
#   [MODEL=dir] [SEED128=rows.jsonl] bash bench/rounds/s42-call2.sh SECONDS
# (defaults .cache/run37/ckpt and .cache/s42/seed128.jsonl; the forty-third session's run 37 retrain used
# .cache/run37b/ckpt and .cache/s43/seed128.jsonl)
set -uo pipefail
budget=${1:-540}
M=${MODEL:-.cache/run37/ckpt}
SEED=${SEED128:-.cache/s42/seed128.jsonl}
export TRITON_CACHE_DIR=/tmp/s42/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/s42 && tar -xzf .cache/triton-cache.tgz -C /tmp/s42 triton-cache 2>/dev/null || echo "no Triton cache"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
left() { echo $((budget - SECONDS)); }
mkdir -p "$OUT/u128" "$OUT/u1m"
[ -f "$SEED" ] && cp "$SEED" "$OUT/u128/results.jsonl"
timeout "$(( $(left) / 3 ))" python3 -m bench.retrieval_eval run --model "$M" --lengths 1m --samples 4 \
  --concurrency 1 --tasks niah_single_1 --out "$OUT/u1m" 2>&1 | grep -v "^\s*$" | tail -15
timeout "$(left)" python3 -m bench.retrieval_eval run --model "$M" --lengths 128k --samples 20 \
  --out "$OUT/u128" 2>&1 | tail -15
wc -l "$OUT"/u*/results.jsonl
