#!/usr/bin/env bash
# Fifty-first session, device calls (issue 10): the uncapped side at 1M (niah_single_2 first: it had never run
# uncapped at 1M; then the multi-needle tasks and vt from index 8), resumed from .cache/s51/u1m (every committed
# uncapped row at 1M of those tasks, refreshed from the last call's archive between calls). BUDGET: seconds.
source bench/rounds/prelude.sh
mkdir -p $OUT/u1m && cp .cache/s51/u1m/results.jsonl $OUT/u1m/
timeout $((${BUDGET:-570} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --samples 20 --concurrency 1 --tasks ${TASKS:-niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt} \
  --out $OUT/u1m
pack u1m u1m
