#!/usr/bin/env bash
# Fifty-fourth session's device call (bench/rounds/s54-next.txt; supersedes s53-call.sh, all of which it
# runs): the Gumbel kernel's in-kernel scaling and the penalties kernel (kernels/penalties.py) against
# their references on the GPU, then bench.sampling (every CUDA-gated route on and off, the penalties'
# torch form against the kernel) and sampled_decode, into $OUT/sampler.tgz. ~3-4 minutes warm.
source bench/rounds/prelude.sh
python3 -m bench.gpu_kernel_check --only gumbel --out $OUT/s/gk
python3 -m bench.gpu_kernel_check --only penalise --out $OUT/s/gkp
python3 -m bench.sampling --out $OUT/s/sampling
python3 -m bench.gpu_check --only sampled_decode --out $OUT/s/gc
pack sampler s
