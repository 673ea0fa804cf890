#!/usr/bin/env bash
# Fifty-eighth session, last device time (~400 s): bench.vs_transformers --skip-hf --quick after its batch
# warm-up became the measured run's twin (s58b's batch 32 held its bucket's capture: 1.5K tok/s). longctx
# alone: 2K / 8K, 128K, batch 8 / 32. Into $OUT/s58c.tgz. ~2 minutes warm.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 python3 -m bench.vs_transformers --skip-hf --quick --out $OUT/s/vt
pack s58c s
