#!/usr/bin/env bash
# Sixtieth session, first call: the decode defaults no GPU has timed together (head_gemv launched plain,
# the batch-1 split merge inside W_UV's GEMV, the router's two kernels, the side stream at normal priority)
# under gpu_check and the 128K batch-1 profile, then Nsight Compute on the attention as decode runs it
# (heads kernel + merge into W_UV), the heads kernel with its combine, and the radix top-k passes, then the
# profile with W_UK / W_UV on torch's batched GEMM and with the combine instead of the merge. Each step packs
# its own archive. ~6-7 minutes warm. From 34e2e39 on: the profile also with LONGCTX_MOE_FILL_SMS=0 (the MoE
# grouped GEMMs' decode BLOCK_N as before, 32 gate-up programs at batch 1) right after the default; last,
# moe_decode's path (no align kernel; its gate-up now fills the SMs too) with LONGCTX_MOE_DECODE_MAX_PAIRS=4.
# From 5850d23 on: the merge's L2 prefetch of W_UV before its PDL wait (LONGCTX_MERGE_PREFETCH=1) after the
# MoE A/B; the head_gemv A/B (LONGCTX_HEAD_GEMV_MAX_T=0) is dropped for time. From b3eea61: the MoE down
# projection's w_down prefetch (LONGCTX_MOE_PREFETCH=1) after it, in place of ncu on the heads kernel with
# its combine (the merge form, smla_uv, stays).
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/gc
pack s60a-gc gc
prof_step s60a-prof
prof_step s60a-moefill0 LONGCTX_MOE_FILL_SMS=0
prof_step s60a-mpf LONGCTX_MERGE_PREFETCH=1
prof_step s60a-mopf LONGCTX_MOE_PREFETCH=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
mkdir -p $OUT/ncu
ncu_part() {  # ncu_part PART REGEX SKIP COUNT
  timeout 150 "$NCU" --clock-control none --import-source no --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section SourceCounters -k "regex:$2" -s "$3" -c "$4" python3 -m bench.ncu_decode --part "$1" \
    > $OUT/ncu/$1.txt 2>&1
  echo "ncu $1 rc $?"; grep -E "Duration|Achieved Occupancy|Registers Per|Memory Throughput" $OUT/ncu/$1.txt | head -12
}
ncu_part smla_uv 'sparse_mla_heads_kernel|_merge_gemv_kernel' 2 2
ncu_part topk '_topk_' 6 6
pack s60a-ncu ncu
prof_step s60a-moedec LONGCTX_MOE_DECODE_MAX_PAIRS=4
