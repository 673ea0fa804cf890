#!/usr/bin/env bash
# Fifty-seventh session's last device time (under 300 s after seven refused starts): only the checks that a
# replay equals an eager step with each layer's MLA row write on the side stream (gpu_check graphs,
# hisparse_graphs). Into $OUT/s57f.tgz. ~1.5 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,hisparse_graphs --out $OUT/s/gc
pack s57f s
