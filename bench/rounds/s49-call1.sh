#!/usr/bin/env bash
# Forty-ninth session, device call 1 (issue 10): the shipped model at 1M capped 10%, the multi-needle tasks
# and vt (indices 5 on), seeded with the rows already in .cache/s49/c1m (copied there before carrying).
set -u
export TRITON_CACHE_DIR=/tmp/t/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/t $OUT/c1m && tar -xzf .cache/triton-cache.tgz -C /tmp/t && cp .cache/s49/c1m/results.jsonl $OUT/c1m/
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
# the engine's CUDA-only set-up paths first (cuda:N, default pool, room check; ~1 min)
timeout 120 python3 -m bench.gpu_check --only cuda_paths --out $OUT/gpu-check
timeout $((${BUDGET:-570} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --samples 20 --concurrency 1 \
  --tasks niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt --cap-fraction 0.1 --out $OUT/c1m
