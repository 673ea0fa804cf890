#!/usr/bin/env bash
# Fifty-sixth session's sixth device call: the 128K decode step's projection GEMMs one by one on the H100
# (step-profile-decode-h100.md: 0.77 ms a step in cuBLAS, more than the 0.65 ms roofline): each small-1m
# Linear shape at batch 1 and 8, bf16 through cuBLAS and kernels.gemv, fp8 through fp8_gemm and gemv, against
# the HBM read rate of the same run (`bench.gemm_shapes`). Into $OUT/s56f.tgz.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gemm_shapes --config configs/small-1m.json --batch 1,8 --out $OUT/s/gemm
pack s56f s
