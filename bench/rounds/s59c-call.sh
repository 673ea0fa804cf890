#!/usr/bin/env bash
# Fifty-ninth session, second call (s59b never got a machine). Since s59a: the side stream queues a full
# layer's indexer before the MLA row's write at the highest stream priority; MLA's absorbed W_UK / W_UV are one
# per-head GEMV launch each (kernels.gemv.head_gemv); the MoE router is one launch at decode. gpu_check (fp32
# against transformers, bf16, graph == eager, HiSparse graphs), then the 128K batch-1 decode profile as it is
# and with each change off: LONGCTX_SIDE_PRIORITY=0, LONGCTX_HEAD_GEMV_MAX_T=0, LONGCTX_ROUTER_FUSED_MAX_TOKENS=0.
# Then Nsight Compute on the sparse MLA heads kernel + its combine (top-2048 over 128K) and the radix top-k's
# six passes at 128K (bench.ncu_decode). Into $OUT/s59c.tgz and $OUT/s59c-ncu.tgz. ~7 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/s/gc
prof() {  # prof NAME [ENV=VALUE]: the 128K batch-1 decode profile into $OUT/s/NAME
  local name=$1; shift
  env "$@" python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/$name \
    | grep -E "^decode batch|decode run plain"
}
prof prof
prof prio0 LONGCTX_SIDE_PRIORITY=0
prof bmm LONGCTX_HEAD_GEMV_MAX_T=0
prof router2 LONGCTX_ROUTER_FUSED_MAX_TOKENS=0
pack s59c s
mkdir -p $OUT/n
NCU="ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
# (kernel regex, launches to skip: the reference check's, how many to read)
$NCU -k regex:'sparse_mla_heads_kernel|_combine_kernel' -s 2 -c 2 python3 -m bench.ncu_decode --part smla \
  > $OUT/n/smla.txt 2>&1 || echo "ncu smla rc $?"
$NCU -k regex:'_topk_' -s 6 -c 6 python3 -m bench.ncu_decode --part topk > $OUT/n/topk.txt 2>&1 || echo "ncu topk rc $?"
grep -h -E "^  [a-z_]|Duration|Achieved Occupancy|Registers Per|Memory Throughput|DRAM Throughput" \
  $OUT/n/*.txt | head -60
pack s59c-ncu n
