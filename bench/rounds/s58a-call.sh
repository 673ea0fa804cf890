#!/usr/bin/env bash
# Fifty-eighth session: programmatic dependent launch (kernels/common.py `pdl`) on the decode step's Triton
# kernels, and the heads sparse-MLA kernel rotating q's rope part itself (one rope launch fewer a layer).
# First the engine against transformers and graph replays against eager steps (gpu_check fp32, bf16, graphs,
# hisparse_graphs), then the 128K batch-1 decode profile with PDL on and off (LONGCTX_PDL=0), same process
# tree, same machine, then with moe_decode's experts path. Into $OUT/s58a.tgz. ~6 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__, torch.version.cuda)"
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/s/gc
for p in 1 0; do
  LONGCTX_PDL=$p python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof-pdl$p
done
# small-1m's bf16 experts at batch 1 (4 pairs): moe_decode's weight stream (split-K down) against the grouped
# GEMMs, measured slower only at GLM-5.3's fp8 shapes
LONGCTX_MOE_DECODE_MAX_PAIRS=64 python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof-moedec
pack s58a s
