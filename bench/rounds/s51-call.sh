#!/usr/bin/env bash
# Fifty-first session, device calls (issue 10), the shipped model at 1M. UNCAPPED_NS2=1 first runs niah_single_2
# index 15 without a cap (the sample the capped run missed in the fiftieth session) into $OUT/u1m; then the capped
# side of the multi-needle tasks, vt and niah_single_2 toward 20 samples, resumed from .cache/s51/c1m (every
# committed capped row at 1M, refreshed from the last call's archive between calls). BUDGET: seconds for the call.
source bench/rounds/prelude.sh
if [ "${UNCAPPED_NS2:-0}" = 1 ]; then
  python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip --lengths 1m --samples 20 \
    --indices 15 --concurrency 1 --tasks niah_single_2 --out $OUT/u1m
  pack u1m u1m
fi
mkdir -p $OUT/c1m && cp .cache/s51/c1m/results.jsonl $OUT/c1m/
timeout $((${BUDGET:-570} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --samples 20 --concurrency 1 \
  --tasks niah_multikey_1,niah_multivalue,niah_multiquery,vt,niah_single_2 --cap-fraction 0.1 --out $OUT/c1m
pack c1m c1m
