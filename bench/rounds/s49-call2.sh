#!/usr/bin/env bash
# Forty-ninth session, device call 2 (issue 10): the same samples as call 1's capped multi-needle rows
# (vt 4, indices 5-7), uncapped, for the capped-minus-uncapped pairs.
set -u
export TRITON_CACHE_DIR=/tmp/t/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/t $OUT/u1m && tar -xzf .cache/triton-cache.tgz -C /tmp/t && cp .cache/s49/u1m/results.jsonl $OUT/u1m/
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout $((${BUDGET:-540} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --indices 4,5,6,7 --concurrency 1 \
  --tasks niah_multikey_1,niah_multivalue,niah_multiquery,vt --out $OUT/u1m
