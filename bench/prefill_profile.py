"""Where prefill time goes: torch.profiler over one longctx prefill of a small-1m request on the GPU.

Prints the top CUDA kernels by total time (and writes prefill-profile.json under --out): which of
the indexer, top-k, sparse/expanded MLA, MoE and GEMMs dominate the prefill that issue 9 compares
with transformers. The prefill form (absorbed sparse MLA vs expanded) and the sparse-MLA variant
are switchable so one run can compare them.

    python -m bench.prefill_profile [--tokens 16384] [--prefill-form auto|absorbed|expanded]
                                    [--sparse-mla-heads-min N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--prefill-form", default="auto")
    ap.add_argument("--sparse-mla-heads-min", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/prefill_profile.py needs CUDA")
        return 0
    from longctx.kernels import sparse_mla as sm

    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig
    from longctx.engine.request import Request, SamplingParams

    if args.sparse_mla_heads_min is not None:
        sm.HEADS_MIN_QUERIES = args.sparse_mla_heads_min
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp()) / "small-1m"
        init_random_checkpoint(ModelConfig.from_json(ROOT / "configs" / "small-1m.json"), model_dir, seed=0)
    gen = torch.Generator().manual_seed(0)
    res: dict = {"tokens": args.tokens, "prefill_form": args.prefill_form, "heads_min": sm.HEADS_MIN_QUERIES}
    with Engine(model_dir, device="cuda", dtype="bfloat16", prefill_form=args.prefill_form) as eng:

        def prefill(n: int, tag: str) -> float:
            ids = torch.randint(0, 256, (n,), generator=gen).tolist()
            eng.add_request(Request(tag, ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
            torch.cuda.synchronize()
            t = time.perf_counter()
            while not any(o.finished for o in eng.step()):
                pass
            torch.cuda.synchronize()
            return time.perf_counter() - t

        prefill(2048, "warm")
        prefill(args.tokens, "warm2")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dt = prefill(args.tokens, "prof")
        plain = prefill(args.tokens, "plain")
    res["prefill_s_profiled"] = dt
    res["prefill_s"] = plain
    res["tok_s"] = args.tokens / plain
    rows = []
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.key, e.count))
            total += t
    rows.sort(reverse=True)
    res["gpu_busy_s"] = total / 1e6
    res["top"] = [
        {"kernel": k[:120], "ms": t / 1e3, "share": t / total, "calls": c} for t, k, c in rows[: args.top]
    ]
    print(
        f"prefill {args.tokens} tokens: {plain:.3f}s ({args.tokens / plain:.0f} tok/s), GPU busy {total / 1e6:.3f}s"
    )
    for r in res["top"]:
        print(f"{r['ms']:9.2f} ms {100 * r['share']:5.1f}% {r['calls']:6d}  {r['kernel']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"prefill-profile-{args.prefill_form}-{args.sparse_mla_heads_min or 'default'}.json"
        (args.out / name).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
