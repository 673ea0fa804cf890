#!/usr/bin/env bash
# Issue 3's GLM-5.3 MoE layer decode step at 1M (bench.layer) with the decode graphs' side stream in its
# captured graph (the indexer and the MLA row's write beside the query's path, the shared expert beside the
# routed ones), then without it (LONGCTX_SIDE_STREAM=0), in one call. Into $OUT/s57d.tgz. ~3 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.layer --out $OUT/s/side1
LONGCTX_SIDE_STREAM=0 python3 -m bench.layer --out $OUT/s/side0
pack s57d s
