#!/usr/bin/env bash
# Fifty-sixth session's fourth device call: issue 9's side-by-side on the current code (the last run was the
# sixteenth session's, on an H200): `bench.vs_transformers` (same random small-1m checkpoint for both, bf16,
# prefill 2K/8K/16K, decode 2K/8K/16K, longctx alone at 128K and at batch 8/32, the 128K decode roofline from
# the HBM rate measured in the same run). Into $OUT/s56d.tgz.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.vs_transformers --out $OUT/s/vs
pack s56d s
