#!/usr/bin/env bash
# Fifty-ninth session, second call. (1) The side stream now queues a full layer's indexer before the MLA row's
# write and has the highest stream priority (graph nodes keep it), and MLA's absorbed W_UK / W_UV run as one
# per-head GEMV kernel each (kernels.gemv.head_gemv): gpu_check (fp32 against transformers, bf16, graph ==
# eager, HiSparse graphs), then the 128K batch-1 decode profile as it is, with LONGCTX_SIDE_PRIORITY=0 and
# with LONGCTX_HEAD_GEMV_MAX_T=0 (torch's batched GEMM).
# (2) Nsight Compute on the step's single kernels (bench.ncu_decode: sparse MLA heads + combine at top-2048
# over 128K, the radix top-k's six passes at 128K, W_UK by torch's batched GEMM and by head_gemv, the router
# and align): duration,
# occupancy, warp stalls, memory, into $OUT/s59b-ncu.tgz. ~8 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/s/gc
python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof
LONGCTX_SIDE_PRIORITY=0 python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 \
  --out $OUT/s/prof-prio0
LONGCTX_HEAD_GEMV_MAX_T=0 python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 \
  --out $OUT/s/prof-bmm
pack s59b s
mkdir -p $OUT/n
NCU="ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
# (kernel regex, launches to skip: the reference check's, how many to read)
$NCU -k regex:'sparse_mla_heads_kernel|_combine_kernel' -s 2 -c 2 python3 -m bench.ncu_decode --part smla \
  > $OUT/n/smla.txt 2>&1 || echo "ncu smla rc $?"
$NCU -k regex:'_topk_' -s 6 -c 6 python3 -m bench.ncu_decode --part topk > $OUT/n/topk.txt 2>&1 || echo "ncu topk rc $?"
$NCU -k regex:'gemv|gemm|nvjet|cutlass|sm90' -s 2 -c 4 python3 -m bench.ncu_decode --part wuk \
  > $OUT/n/wuk.txt 2>&1 || echo "ncu wuk rc $?"
$NCU -k regex:'_router|_align' -s 2 -c 3 python3 -m bench.ncu_decode --part router \
  > $OUT/n/router.txt 2>&1 || echo "ncu router rc $?"
grep -h -E "^  [a-z_]|Duration|Achieved Occupancy|Registers Per|Stall|Memory Throughput|DRAM Throughput" \
  $OUT/n/*.txt | head -120
pack s59b-ncu n
