#!/usr/bin/env bash
# Fifty-ninth session, first call: the two changes no GPU has run yet (kernels.argmax for greedy rows,
# kernels.rope.rope_cos_sin for the step's rotary cos / sin) under gpu_check (fp32 against transformers,
# bf16, graph == eager with greedy and seeded draws, HiSparse graphs), the 128K batch-1 decode profile, the
# same with 128K top-k rows in chunks of 1024 (LONGCTX_TOPK_BIG_CHUNK_FROM=262144), then issue 3's GLM-5.3
# layer at 1M (bench.layer) with the side stream and PDL in its graph. Into $OUT/s59a.tgz. ~7 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/s/gc
python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof
LONGCTX_TOPK_BIG_CHUNK_FROM=262144 python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 \
  --out $OUT/s/prof-chunk1024
pack s59a s
python3 -m bench.layer --out $OUT/l/side1
pack s59a-layer l
