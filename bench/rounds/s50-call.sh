#!/usr/bin/env bash
# Fiftieth session, device calls (issue 10): the shipped model at 1M capped 10%, the multi-needle tasks, vt and
# niah_single_2 toward 20 samples, resumed from the rows in .cache/s50/c1m (every committed capped row, copied
# there before carrying; refreshed from the last call's archive between calls). BUDGET: seconds for the call.
source bench/rounds/prelude.sh
mkdir -p $OUT/c1m && cp .cache/s50/c1m/results.jsonl $OUT/c1m/
timeout $((${BUDGET:-570} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --samples 20 --concurrency 1 \
  --tasks niah_multikey_1,niah_multivalue,niah_multiquery,vt,niah_single_2 --cap-fraction 0.1 --out $OUT/c1m
pack c1m c1m
