"""HiSparse's decode hit rate with a trained indexer (issue 5 asks for >= 0.9 at 128K).

Random weights spread their top-k over the whole context, so their hit rate (0.1-0.35) says nothing
about a real model. This prefills a RULER niah_single_1 prompt (bytes) into a checkpoint with
HiSparse capped at `--cap-fraction` of the context and greedily decodes `--steps` tokens, reporting
the fraction of the decode steps' selected tokens that were already resident. Runs on the CPU (the
shipped retrieval checkpoint is small) or the GPU.

    python -m bench.hit_rate [--model models-shipped/retrieval-wip] [--tokens 8192] [--steps 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models-shipped" / "retrieval-wip"))
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length (bytes = tokens)")
    ap.add_argument("--steps", type=int, default=48, help="greedy decode steps")
    ap.add_argument("--cap-fraction", type=float, default=0.1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None, help="write hit-rate-<tokens>.json here")
    args = ap.parse_args(argv)

    from bench.common import niah_byte_prompt
    from longctx import Engine
    from longctx.engine.request import Request, SamplingParams

    ids = niah_byte_prompt(args.tokens)
    from longctx.config import ModelConfig

    topk = ModelConfig.from_json(args.model).index_topk
    cap = max(topk + 2, int(args.cap_fraction * len(ids)))  # a decode query's selection must fit
    params = SamplingParams(max_new_tokens=args.steps, temperature=0.0, ignore_eos=True)
    with Engine(args.model, device=args.device, hisparse_device_tokens=cap, chunk_size=args.chunk) as eng:
        eng.add_request(Request("hit-rate", ids, params))
        t0 = time.perf_counter()
        prefill_s, at_first = None, None
        while eng.has_work():
            for o in eng.step():
                if o.new_token_ids and at_first is None:
                    prefill_s, at_first = time.perf_counter() - t0, eng.stats()["hisparse"]
        end = eng.stats()["hisparse"]
    assert at_first is not None
    hits, misses = end["hits"] - at_first["hits"], end["misses"] - at_first["misses"]
    res = {
        "model": args.model,
        "context_tokens": len(ids),
        "index_topk": topk,
        "device_tokens_cap": cap,
        "decode_steps": args.steps,
        "hits": hits,
        "misses": misses,
        "decode_hit_rate": hits / max(1, hits + misses),
        "prefill_s": prefill_s,
        "device": args.device,
        "command": "python -m bench.hit_rate " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(
        f"{len(ids):,} tokens, top-{topk}, cap {cap:,} ({args.cap_fraction:.0%}): decode hit rate "
        f"{res['decode_hit_rate']:.3f} over {args.steps} steps ({hits:,} hits, {misses:,} misses)"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"hit-rate-{len(ids)}.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
