"""Host synchronisations of an overlapped decode step, found on the GPU (issue 9: "no host
synchronisation inside a step except the one that reads sampled tokens").

A synchronising call (a blocking host->device copy, `.tolist()` of a device tensor, indexing a device
tensor with a host list) waits for everything queued on the stream: with overlapped decode that is
the continuation just launched, so the GPU then idles while the host prepares the step after it.
This runs decode steps of a tiny random checkpoint through CUDA graphs with device-fed
continuations (uncapped and HiSparse-capped) under `torch.cuda.set_sync_debug_mode("warn")`, and
reports every synchronising call per step with the longctx frame that made it. The step's token
read waits on an event, which the debug mode does not count, so the target is 0 per step.

    python -m bench.sync_check [--steps 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import scratch_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in this repository (longctx/ or kernels/), else the innermost one."""
    for f in reversed(stack):
        if ("/longctx/" in f.filename or "/kernels/" in f.filename) and "sync_check" not in f.filename:
            return f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.line or ''}"[:160]
    f = stack[-1]
    return f"{f.filename}:{f.lineno}"


def count_syncs(eng: Any, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Prefill `prompts`, then count synchronising calls over `steps` overlapped decode steps."""
    from longctx.engine.request import Request, SamplingParams

    for i, p in enumerate(prompts):
        eng.add_request(Request(f"s{i}", p, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)))
    while not all(len(eng._requests[f"s{i}"].output_ids) >= 2 for i in range(len(prompts))):
        eng.step()  # prefill, the first decode step (captures the bucket) and its continuation
    torch.cuda.synchronize()
    seen: collections.Counter[str] = collections.Counter()

    def show(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if "synchroniz" in str(message):
            seen[where(traceback.extract_stack()[:-1])] += 1

    fed0 = eng.device_fed_steps
    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    while eng.has_work():
        eng.step()
    total = sum(seen.values())
    return {
        "steps": steps,
        "device_fed_steps": eng.device_fed_steps - fed0,
        "syncs": total,
        "syncs_per_step": total / steps,
        "by_site": dict(seen.most_common()),
        "ok": total == 0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.sync_check needs CUDA")
        return 0
    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig

    base = ModelConfig.from_json(ROOT / "configs" / "tiny.json")
    cfg = dataclasses.replace(base, index_topk=512)
    d = init_random_checkpoint(cfg, scratch_dir() / "tiny", seed=0, dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (900, 1300)]
    res: dict[str, Any] = {}
    for name, cap in (("uncapped", None), ("capped", 700)):
        with Engine(d, device="cuda", dtype="bfloat16", kv_pages=256, hisparse_device_tokens=cap) as eng:
            res[name] = count_syncs(eng, prompts, args.steps)
        print(f"{name}: {res[name]['syncs_per_step']:.2f} synchronising calls per step "
              f"({res[name]['device_fed_steps']} of {args.steps} steps device-fed)")  # fmt: skip
        for site, n in res[name]["by_site"].items():
            print(f"  {n:5d}  {site}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sync-check.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
