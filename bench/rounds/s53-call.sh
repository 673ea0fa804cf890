#!/usr/bin/env bash
# Fifty-third session's plan for the next device call (bench/rounds/s53-next.txt): the Gumbel kernel's
# in-kernel scaling against its reference on the GPU, then the sampler's timings with each CUDA-gated route
# on and off, into $OUT/sampler.tgz. ~3 minutes on a warm machine.
source bench/rounds/prelude.sh
python3 -m bench.gpu_kernel_check --only gumbel --out $OUT/sampler/gk
python3 -m bench.sampling --out $OUT/sampler/sampling
python3 -m bench.gpu_check --only sampled_decode --out $OUT/sampler/gc
pack sampler sampler
