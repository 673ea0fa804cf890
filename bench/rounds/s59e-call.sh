#!/usr/bin/env bash
# Fifty-ninth session, the one call that got a machine after s59b/c/d got none (replaces them): everything
# since s59a in one run. Since s59a: the side stream queues a full layer's indexer before the MLA row's write
# at the highest stream priority; MLA's absorbed W_UK / W_UV are per-head GEMV launches (kernels.gemv); the
# MoE router is one launch at decode; a batch-1 query's sparse-attention splits merge inside W_UV's GEMV.
# gpu_check (fp32 against transformers, bf16, graph == eager, HiSparse graphs), then the 128K batch-1
# decode profile as it is, with all four off, and with each off in turn (most telling first). Each step packs
# its own archive, so a run cut short still returns what it finished. ~6-7 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/gc
pack s59e-gc gc
prof() {  # prof NAME [ENV=VALUE]: the 128K batch-1 decode profile into $OUT/NAME.tgz
  local name=$1; shift
  env "$@" python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/$name \
    | grep -E "^decode batch|decode run plain"
  pack s59e-$name $name
}
prof prof
prof off LONGCTX_SIDE_PRIORITY=0 LONGCTX_HEAD_GEMV_MAX_T=0 LONGCTX_ROUTER_FUSED_MAX_TOKENS=0 \
  LONGCTX_SPARSE_MLA_MERGE=0
prof combine LONGCTX_SPARSE_MLA_MERGE=0
prof bmm LONGCTX_HEAD_GEMV_MAX_T=0
prof router2 LONGCTX_ROUTER_FUSED_MAX_TOKENS=0
prof prio0 LONGCTX_SIDE_PRIORITY=0
