#!/usr/bin/env bash
# Forty-eighth session, device call 0 (issue 10): is the 1M UUID (niah_single_3) lost to the narrowed selection
# past index_topk_long_from? Run A: no narrowing at all (256 everywhere). Run B: narrowing on prompt rows only
# (LONGCTX_TOPK_LONG_DECODE=0). Both uncapped, samples 0..9, the indices of the forty-seventh session's 0 of 10.
set -u
export TRITON_CACHE_DIR=/tmp/t/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/t && tar -xzf .cache/triton-cache.tgz -C /tmp/t
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M=models-shipped/retrieval-wip
timeout $((290 - SECONDS)) python3 -m bench.retrieval_eval run --model $M --lengths 1m --samples 10 \
  --concurrency 1 --tasks niah_single_3 --index-topk-long 0 --index-topk-long-from 0 --out $OUT/u1m3-k256
LONGCTX_TOPK_LONG_DECODE=0 timeout $((570 - SECONDS)) python3 -m bench.retrieval_eval run --model $M \
  --lengths 1m --samples 10 --concurrency 1 --tasks niah_single_3 --out $OUT/u1m3-widedecode
python3 -m bench.triton_cache pack "$TRITON_CACHE_DIR" "$OUT/triton-cache.tgz" || true
