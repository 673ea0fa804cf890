#!/usr/bin/env bash
# Fifty-sixth session's fifth device call: where the 128K batch-1 decode step goes on the current code (issue
# 9's roofline ratio 2.38 on the H100, s56d): `bench.step_profile --phase decode --tokens 131072 --steps 96`.
# Into $OUT/s56e.tgz.
source bench/rounds/prelude.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/s/prof
pack s56e s
