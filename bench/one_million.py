"""One 1,048,576-token request on one H200 through the public Engine (configs/small-1m.json).

Prefills the request chunk by chunk (printing the rate as it goes, so a run cut short still shows
its progress), decodes greedily, and writes bench/results/one-million-h200.json after each phase.

    python -m bench.one_million --model DIR [--ctx 1048576] [--decode 16] [--hisparse-device-tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, default=1 << 20)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--hisparse-device-tokens", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    from longctx import Engine
    from longctx.engine.request import Request, SamplingParams

    outs = [Path(__file__).resolve().parent / "results"] + ([args.out] if args.out else [])
    res: dict = {
        "env": environment(),
        "context_tokens": args.ctx,
        "hisparse_device_tokens": args.hisparse_device_tokens,
        "command": "python -m bench.one_million " + " ".join(argv or sys.argv[1:]),
    }

    def save() -> None:
        for d in outs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "one-million-h200.json").write_text(json.dumps(res, indent=2, default=float) + "\n")

    eng = Engine(
        args.model,
        device="cuda",
        dtype="bfloat16",
        max_context=args.ctx + 4096,
        chunk_size=args.chunk,
        hisparse_device_tokens=args.hisparse_device_tokens,
    )
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, 256, (args.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    req = Request("r1m", ids, SamplingParams(max_new_tokens=args.decode, ignore_eos=True))
    eng.add_request(req)
    t0 = time.perf_counter()
    marks, steps = [], []
    while not req.output_ids:
        eng.step()
        torch.cuda.synchronize()
        done = req.num_computed
        marks.append((done, time.perf_counter() - t0))
        if len(marks) % 8 == 0:
            print(f"prefill {done}/{args.ctx} tokens, {marks[-1][1]:.1f}s", flush=True)
            res["prefill_progress"] = marks[-1]
            save()
    res["prefill_s"] = time.perf_counter() - t0
    res["prefill_tok_s"] = args.ctx / res["prefill_s"]
    res["peak_device_bytes_prefill"] = torch.cuda.max_memory_allocated()
    save()
    print(f"prefill {res['prefill_s']:.1f}s", flush=True)
    while not req.finished:
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
    steps.sort()
    res["decode_ms_per_token"] = steps[len(steps) // 2] * 1e3
    res["tokens"] = list(req.output_ids)
    res["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    st = eng.stats()
    res["stats"] = {k: v for k, v in st.items() if not isinstance(v, list)}
    save()
    print(
        json.dumps(
            {k: res[k] for k in ("prefill_s", "prefill_tok_s", "decode_ms_per_token", "peak_device_bytes")}
        )
    )
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
