#!/usr/bin/env bash
# Sixty-first session, last try with ~336 s of device time (s61a never got a machine): the 128K batch-1
# profile at HEAD, then the sparse MLA heads kernel at 64 K splits, then every bf16 projection on
# kernels.gemv at M=1. Each step packs its own archive.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
prof_step s61b-prof
prof_step s61b-sp64 LONGCTX_SPARSE_MLA_HEADS=splits=64
prof_step s61b-gemv LONGCTX_GEMV_MAX_M=1
