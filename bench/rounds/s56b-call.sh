#!/usr/bin/env bash
# Fifty-sixth session's second device call: gpu_check sampled_decode with each route timed 3 times (rounds
# interleaved, medians and spreads), to settle guided decoding's cost on the overlapped path at batch 8 / 32
# (the first call's two single runs differed by ~2 ms at batch 32), and graphs (graph == eager, guided draws
# included). Into $OUT/s56b.tgz. ~5 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,sampled_decode --out $OUT/s/gc
pack s56b s
