#!/usr/bin/env bash
# Fifty-sixth session's third device call: as s56b-call.sh, after late-shaped continuations launch step
# n+2's forward right after step n+1's draw (EngineCore._launch_ahead). Into $OUT/s56c.tgz.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,sampled_decode --out $OUT/s/gc
pack s56c s
