"""Prefill throughput by chunk size, and where a long prefill's time goes by chunk position.

One engine (small-1m random bf16, fp8 KV), one prompt length: for each chunk size the scheduler
takes (`--chunks`), a warm-up prefill (Triton compiles for the new chunk shapes) and then a timed
one, in tokens/s. Then, at the fastest chunk size, one prefill under torch.profiler whose kernels
are split by model part (bench.step_profile's groups): the indexer + top-k share the issue asks
about, and the wall time of the first and of the last chunk (the indexer's per-chunk work grows
with the keys before the chunk; the share at 1M is a figure only for a 1M prompt).

    python -m bench.prefill_chunks [--tokens 65536] [--chunks 4096,8192,16384,32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import scratch_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--config", default="configs/small-1m.json", help="config of the random checkpoint")
    ap.add_argument("--tokens", type=int, default=65536, help="prompt length")
    ap.add_argument("--chunks", default="4096,8192,16384,32768", help="chunk sizes to time")
    ap.add_argument("--no-profile", action="store_true", help="only the sweep")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/prefill_chunks.py needs CUDA (or --device cpu for a smoke run)")
        return 0
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if not chunks or min(chunks) < 1 or args.tokens < 1:
        print("--chunks needs positive sizes and --tokens a positive length")
        return 2

    from bench.step_profile import kernel_groups
    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig
    from longctx.engine.request import Request, SamplingParams

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    model_dir = args.model
    if model_dir is None:
        model_dir = scratch_dir() / "model"
        init_random_checkpoint(ModelConfig.from_json(ROOT / args.config), model_dir, seed=0)
    gen = torch.Generator().manual_seed(0)
    res: dict = {"tokens": args.tokens, "config": args.config, "sweep": {}}
    tags = iter(range(1 << 30))
    with Engine(model_dir, device=args.device, max_context=args.tokens + 16) as eng:

        def prefill(n: int, chunk_times: list[float] | None = None) -> float:
            ids = torch.randint(0, 256, (n,), generator=gen).tolist()
            eng.add_request(Request(f"p{next(tags)}", ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
            sync()
            t = last = time.perf_counter()
            while not any(o.finished for o in eng.step()):
                if chunk_times is not None:
                    sync()
                    now = time.perf_counter()
                    chunk_times.append(now - last)
                    last = now
            sync()
            return time.perf_counter() - t

        def use_chunk(c: int) -> None:
            eng.scheduler.chunk_size = c
            eng.scheduler.max_batch_tokens = c

        for c in chunks:
            use_chunk(c)
            prefill(min(args.tokens, 2 * c))  # compiles at this chunk's shapes
            dt = prefill(args.tokens)
            res["sweep"][c] = {"seconds": round(dt, 4), "tok_s": round(args.tokens / dt, 1)}
            print(f"chunk {c:6d}: {args.tokens} tokens in {dt:.3f} s ({args.tokens / dt:,.0f} tok/s)")
        best = max(res["sweep"], key=lambda c: res["sweep"][c]["tok_s"])
        res["best_chunk"] = best
        if not args.no_profile:
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile

            use_chunk(best)
            per_chunk: list[float] = []
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                dt = prefill(args.tokens, per_chunk)
            rows = []
            for e in prof.key_averages():
                if cuda and e.device_type != DeviceType.CUDA:
                    continue
                t = (getattr(e, "self_device_time_total", 0) or 0) if cuda else e.self_cpu_time_total
                if t > 0:
                    rows.append((t, e.key, e.count))
            res["profiled_seconds"] = round(dt, 4)
            res["groups"] = kernel_groups(rows)
            # chunk wall times (synchronised after each step): the first and the last chunk
            res["chunk_ms_first_last"] = (
                [round(1e3 * per_chunk[0], 2), round(1e3 * per_chunk[-1], 2)] if per_chunk else []
            )
            for g, d in res["groups"].items():
                print(f"{d['ms']:9.2f} ms {100 * d['share']:5.1f}%  [{g}]")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"prefill-chunks-{args.tokens}.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
