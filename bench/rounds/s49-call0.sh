#!/usr/bin/env bash
# Forty-ninth session, device call 0 (issue 10): fewer far keys at 1M. The forty-eighth session found wider
# selections copy less of the 1M UUID (bench/rounds/s48-next.txt); this tries the other direction:
# --index-topk-long 96 (32 far keys + the 64-token window) past position 262,144, uncapped.
# niah_single_3 on indices 0-9 (the shipped config's 0 of 10), then niah_single_1 on 0-4 (must keep its numbers).
set -u
export TRITON_CACHE_DIR=/tmp/t/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/t && tar -xzf .cache/triton-cache.tgz -C /tmp/t
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M=models-shipped/retrieval-wip
timeout $((330 - SECONDS)) python3 -m bench.retrieval_eval run --model $M --lengths 1m --samples 10 \
  --concurrency 1 --tasks niah_single_3 --index-topk-long 96 --out $OUT/u1m3-k96
timeout $((570 - SECONDS)) python3 -m bench.retrieval_eval run --model $M --lengths 1m --indices 0,1,2,3,4 \
  --concurrency 1 --tasks niah_single_1 --index-topk-long 96 --out $OUT/u1m1-k96
python3 -m bench.triton_cache pack "$TRITON_CACHE_DIR" "$OUT/triton-cache.tgz" || true
