#!/usr/bin/env bash
# bench.layer with the fp8 MoE weight stream (kernels/moe_stream) on, at the batch-1 winner of the
# moe8 sweep that ran just before in the same round ($R/moe8-sweep-cuda.json).
set -euo pipefail
spec=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['best_stream'].get('1', ''))" "$R/moe8-sweep-cuda.json")
echo "moe_stream tiles: '${spec}'"
LONGCTX_MOE_STREAM_MAX_PAIRS=64 LONGCTX_MOE_STREAM_TILES="$spec" python3 -m bench.layer --out "$R/layer-stream"
