#!/usr/bin/env bash
# Forty-eighth session, device calls 1-2 (issue 10): the shipped model at 1M capped 10%, the multi-needle tasks
# and vt, seeded with the rows already in .cache/s48/c1m (copied there before carrying).
set -u
export TRITON_CACHE_DIR=/tmp/t/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/t $OUT/c1m && tar -xzf .cache/triton-cache.tgz -C /tmp/t && cp .cache/s48/c1m/results.jsonl $OUT/c1m/
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout $((${BUDGET:-570} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --samples 20 --concurrency 1 \
  --tasks niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt --cap-fraction 0.1 --out $OUT/c1m
