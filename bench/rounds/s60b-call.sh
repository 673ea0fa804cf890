#!/usr/bin/env bash
# Sixtieth session, last try with ~360 s of device time (s60a never got a machine): only the MoE fill's A/B
# (the 128K batch-1 profile as it is, then LONGCTX_MOE_FILL_SMS=0), then gpu_check if time is left. Each step
# packs its own archive.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
prof_step s60b-prof
prof_step s60b-moefill0 LONGCTX_MOE_FILL_SMS=0
python3 -m bench.gpu_check --only fp32,bf16,graphs --out $OUT/gc
pack s60b-gc gc
