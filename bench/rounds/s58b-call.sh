#!/usr/bin/env bash
# Fifty-eighth session, second call: the MoE combine now also writes the next layer's input norm (one norm
# launch fewer per MoE layer), on top of s58a's PDL and rope-in-sparse-MLA. The engine against transformers
# and graph replays against eager steps (gpu_check fp32, bf16, graphs, hisparse_graphs), the 128K batch-1
# decode profile, then issue 9's side-by-side (bench.vs_transformers, transformers included, its loop figure
# the rows' first token to their last but one with each batch bucket warmed). Into $OUT/s58b.tgz.
# ~7 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only fp32,bf16,graphs,hisparse_graphs --out $OUT/s/gc
python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof
python3 -m bench.vs_transformers --out $OUT/s/vt
pack s58b s
