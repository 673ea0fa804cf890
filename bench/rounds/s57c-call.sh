#!/usr/bin/env bash
# Fifty-seventh session's third device call. The decode graphs' side stream now also takes each layer's MLA
# row write (not under HiSparse) beside the query's path, so first the checks that a replay equals an eager
# step (gpu_check graphs, hisparse_graphs). Then issue 9's side-by-side (bench.vs_transformers, transformers
# included) with its loop figure fixed after s57b (the rows' first token to their last but one, each batch
# bucket warmed: s57b's loop held the requests' retirement and the batch buckets' compiles), longctx's synced
# steps beside it; then longctx alone with LONGCTX_SIDE_STREAM=0 (--quick: 2K / 8K, 128K, batch 8 / 32) for
# the A/B. Into $OUT/s57c.tgz. ~6 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,hisparse_graphs --out $OUT/s/gc
python3 -m bench.vs_transformers --out $OUT/s/vt
LONGCTX_SIDE_STREAM=0 timeout 120 python3 -m bench.vs_transformers --skip-hf --quick --out $OUT/s/vt-side0
pack s57c s
