#!/usr/bin/env bash
# Fifty-seventh session's third device call (s57b again, after the loop figure was fixed: it took the requests' retirement and, at batch 8 / 32, the compiles and captures of their buckets into the loop; the first token to the last but one now, each bucket warmed): issue 9's side-by-side (bench.vs_transformers, transformers
# included) on the code with the decode graphs' side stream, its decode figures now the engines' own loops
# (longctx's synced steps beside them); then longctx alone with LONGCTX_SIDE_STREAM=0 for the A/B at 2K-128K
# and batch 8 / 32. Into $OUT/s57c.tgz. ~5 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.vs_transformers --out $OUT/s/vt
LONGCTX_SIDE_STREAM=0 python3 -m bench.vs_transformers --skip-hf --out $OUT/s/vt-side0
pack s57c s
