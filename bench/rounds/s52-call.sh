#!/usr/bin/env bash
# Fifty-second session, device calls. SAMPLER=1 first checks the sampler's Gumbel-max kernel on the GPU (kernel
# against its reference, the batched sampler's timings, seeded draws through CUDA graphs equal eager's) into
# $OUT/sampler; then, for issue 10, MODE=u runs the uncapped side at 1M (resumed from .cache/s52/u1m) and MODE=c3
# niah_single_3 capped at 10% (resumed from .cache/s52/c1m3). BUDGET: seconds for the call.
source bench/rounds/prelude.sh
if [ "${SAMPLER:-0}" = 1 ]; then
  python3 -m bench.gpu_kernel_check --only gumbel --out $OUT/sampler/gk
  python3 -m bench.sampling --out $OUT/sampler/sampling
  python3 -m bench.gpu_check --only graphs,sampled_decode --out $OUT/sampler/gc
  pack sampler sampler
fi
case "${MODE:-u}" in
  u) dir=u1m; extra=(--tasks ${TASKS:-niah_single_2,niah_multikey_1,niah_multivalue,niah_multiquery,vt}) ;;
  c3) dir=c1m3; extra=(--tasks niah_single_3 --cap-fraction 0.1) ;;
esac
mkdir -p $OUT/$dir && cp .cache/s52/$dir/results.jsonl $OUT/$dir/
timeout $((${BUDGET:-570} - SECONDS)) python3 -m bench.retrieval_eval run --model models-shipped/retrieval-wip \
  --lengths 1m --samples 20 --concurrency 1 "${extra[@]}" --out $OUT/$dir
pack $dir $dir
