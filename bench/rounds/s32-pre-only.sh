#!/usr/bin/env bash
# Thirty-second session, last device call (~450 s): the machine was lost between calls 1 and 2 (run 31's
# main training with it), so only run 31's first stage is repeated (PRE_ARGS of s31-next.txt, seed 31, from
# the shipped weights), its weights brought back, then copy_probe and a 4K vt / niah_single_3 check on them.
set -uo pipefail
S=/tmp/pre-only && mkdir -p "$S" && export TRITON_CACHE_DIR=$S/triton-cache
[ -f .cache/triton-cache.tgz ] && tar -xzf .cache/triton-cache.tgz -C "$S" triton-cache 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TRAIN_WORK=$S/train TRAIN_MINUTES=${PRE_MINUTES:-3.5} TRAIN_ARGS="--init-from models-shipped/retrieval-wip \
--lr 2e-4 --warmup-steps 30 --needle-weight 1.0 --needle-form bytes --pose-max 1048576 --pose-far 0 \
--chat-fraction 0.25 --document-fraction 0.25 --copy-hex-fraction 0 --replay-fraction 0.3 --dense-warmup-steps 0 \
--select fused --seed 31 --index-local-window 64 --kl-share \
--task-weights niah_multikey_1=3,niah_multikey_2=2,niah_multikey_3=2,vt=2 \
--curriculum 0:1024 --copy-fraction 0.6 --copy-upper-fraction 0.5 --capitals-from-lowercase --replay-fraction 0 --vt-hops 1,2" \
  bash bench/train_bg.sh start
TRAIN_WORK=$S/train bash bench/train_bg.sh wait
TRAIN_WORK=$S/train bash bench/train_bg.sh status 3
TRAIN_WORK=$S/train OUT=$OUT/pre bash bench/train_bg.sh collect
M=$S/train/pack/ckpt
timeout 60 python3 -m bench.copy_probe --model $M --device cuda --out $OUT/copy-probe-run31pre-h200.json | tail -n 25
timeout 120 python3 -m bench.retrieval_eval run --model $M --lengths 4k --samples 20 --tasks vt,niah_single_3 --out $OUT/eval | tail -n 15
ls -la $OUT $OUT/* | head -30
