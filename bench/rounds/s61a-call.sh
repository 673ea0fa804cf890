#!/usr/bin/env bash
# Sixty-first session, one call (~790 s of device time left after s60a ran on an H100): gpu_check at HEAD (the
# MoE SM fill off again, the two L2 prefetches gone), then the 128K batch-1 decode profile as it is and with
# three launch knobs that exist but have not been A/B'd in the PDL-era step: every bf16 projection at M=1 on
# kernels.gemv instead of cuBLAS (the fifth session's per-step sum was 0.685 vs 0.742 ms on the H200, while
# o_proj alone lost), the sparse MLA heads kernel at 64 K splits (2 CTAs an SM: the ncu of s60a shows one
# warp a scheduler, 0.19 issued a cycle), and the top-k's 1024-key chunks at 128K. Each step packs its own
# archive.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/gc
pack s61a-gc gc
prof_step s61a-prof
prof_step s61a-gemv LONGCTX_GEMV_MAX_M=1
prof_step s61a-sp64 LONGCTX_SPARSE_MLA_HEADS=splits=64
prof_step s61a-tk1k LONGCTX_TOPK_BIG_CHUNK_FROM=262144
prof_step s61a-prof2
# last, if time is left: longctx's side of issue 9's table alone (transformers skipped), quick sizes
timeout 200 python3 -m bench.vs_transformers --skip-hf --quick --out $OUT/vt
pack s61a-vt vt
