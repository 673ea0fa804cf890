#!/usr/bin/env bash
# Fifty-fourth session's second device call: the sampler with this session's defaults (the Gumbel kernel
# scaling raw logits itself, the penalties kernel; both checked on the H100 by s54-call.sh; the draw's
# reduction over its programs' bests now one kernel, `_gumbel_pick_kernel`: checked first): bench.sampling
# (a penalised step, apply + record, one step after another) and gpu_check's graphs (graph decode == eager,
# seeded draws included) and sampled_decode (decode ms per step with each route on and off), into
# $OUT/sampler2.tgz. ~3 minutes warm.
source bench/rounds/prelude.sh
python3 -m bench.gpu_kernel_check --only gumbel --out $OUT/s/gk  # (the draw's second stage is a kernel now)
python3 -m bench.sampling --out $OUT/s/sampling
python3 -m bench.gpu_check --only graphs,sampled_decode --out $OUT/s/gc
pack sampler2 s
