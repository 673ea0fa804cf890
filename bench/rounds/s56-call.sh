#!/usr/bin/env bash
# Fifty-sixth session's device call: guided rows (and rows with bad words of several tokens) no longer
# take their batch off the overlapped path; a continuation's forward is launched device-fed and its
# masked draw queued behind it once the step before is read. gpu_check graphs (graph decode == eager,
# seeded and guided draws included), then sampled_decode twice in the one call to measure the run-to-run
# spread of its per-route figures (s55-next.txt). Into $OUT/s56.tgz. ~4 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.gpu_check --only graphs,sampled_decode --out $OUT/s/gc1
python3 -m bench.gpu_check --only sampled_decode --out $OUT/s/gc2
pack s56 s
