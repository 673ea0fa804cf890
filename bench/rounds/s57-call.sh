#!/usr/bin/env bash
# Fifty-seventh session's device call: decode graphs now fork a side stream (longctx/model/overlap.py: a full
# layer's indexer beside the query's path, the shared experts beside the routed ones). First the checks that
# a replay equals an eager step (gpu_check graphs, hisparse_graphs), then the 128K batch-1 decode step with
# the side stream off and on, interleaved (step_profile), then issue 9's longctx figures (vs_transformers
# --skip-hf: 128K roofline ratio). Into $OUT/s57.tgz. ~6 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,hisparse_graphs --out $OUT/s/gc
for s in 1 0; do
  LONGCTX_SIDE_STREAM=$s python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof-side$s
done
python3 -m bench.vs_transformers --skip-hf --out $OUT/s/vt
pack s57 s
