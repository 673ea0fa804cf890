#!/usr/bin/env bash
# Fifty-fourth session's second device call (bench/rounds/s54-next.txt): the penalties kernel
# (kernels/penalties.py) against its reference on the GPU, then bench.sampling (the penalties' torch form
# against the kernel, and the sampler's other routes again), into $OUT/pen.tgz. ~2 minutes warm.
source bench/rounds/prelude.sh
python3 -m bench.gpu_kernel_check --only penalise --out $OUT/pen/gk
python3 -m bench.sampling --out $OUT/pen/sampling
pack pen pen
