#!/usr/bin/env bash
# Fifty-seventh session, short of device time after six refused starts: the checks that a replay equals an
# eager step with each layer's MLA row write on the side stream (gpu_check graphs, hisparse_graphs), then the
# 128K batch-1 decode step with it (step_profile). Into $OUT/s57e.tgz. ~2.5 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,hisparse_graphs --out $OUT/s/gc
python3 -m bench.step_profile --phase decode --tokens 131072 --steps 64 --out $OUT/s/prof
pack s57e s
