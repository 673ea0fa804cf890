#!/usr/bin/env bash
# Fifty-fourth session's last device call, on what was left of the budget (~300 s with a cold start):
# the Gumbel draw's pick kernel against the reference on the GPU (gpu_kernel_check's gumbel cases turn
# PICK_KERNEL_CUDA on), then bench.sampling as far as the time goes.
source bench/rounds/prelude.sh
python3 -m bench.gpu_kernel_check --only gumbel --out $OUT/gk
python3 -m bench.sampling --out $OUT/sampling
