#!/usr/bin/env bash
# Fifty-ninth session, last try (s59b-e never got a machine; ~440 s of device time left): the correctness of
# this session's kernels on the GPU first (gpu_check: fp32 against transformers, bf16, graph == eager,
# HiSparse graphs), then the 128K batch-1 decode profile as it is and with this session's four switches off.
# Each step packs its own archive. ~4 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/gc
pack s59f-gc gc
prof() {  # prof NAME [ENV=VALUE]: the 128K batch-1 decode profile into $OUT/NAME.tgz
  local name=$1; shift
  env "$@" python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/$name \
    | grep -E "^decode batch|decode run plain"
  pack s59f-$name $name
}
prof prof
prof off LONGCTX_SIDE_PRIORITY=0 LONGCTX_HEAD_GEMV_MAX_T=0 LONGCTX_ROUTER_FUSED_MAX_TOKENS=0 \
  LONGCTX_SPARSE_MLA_MERGE=0
prof combine LONGCTX_SPARSE_MLA_MERGE=0
