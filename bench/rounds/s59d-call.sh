#!/usr/bin/env bash
# Fifty-ninth session, third call: sparse_mla(out_proj=W_UV) merges a batch-1 query's K splits inside W_UV's
# per-head GEMV (no combine launch). gpu_check (fp32 against transformers, bf16, graph == eager, HiSparse
# graphs), then the 128K batch-1 decode profile with it and with LONGCTX_SPARSE_MLA_MERGE=0. Into
# $OUT/s59d.tgz. ~4 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/s/gc
prof() {  # prof NAME [ENV=VALUE]: the 128K batch-1 decode profile into $OUT/s/NAME
  local name=$1; shift
  env "$@" python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/$name \
    | grep -E "^decode batch|decode run plain"
}
prof prof
prof combine LONGCTX_SPARSE_MLA_MERGE=0
pack s59d s
