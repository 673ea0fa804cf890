"""Host time of one decode step outside the model (CPU only, no GPU needed): the scheduler's
`schedule`, the decode graphs' input preparation (`DecodeGraphs.run` with the forward stubbed out)
and `update`, for a grid of batch sizes and contexts; and the eager path's `StageWorker.context`
(HiSparse decode, prefill chunks). This is the time the GPU waits for between steps; it must not
grow with the context.

    python -m bench.host_step [--steps 100] [--out DIR]     # writes host-step-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = ((1, 2048), (1, 131072), (1, 1 << 20), (8, 131072), (64, 2048), (64, 131072))


def measure(batch: int, context: int, steps: int) -> dict[str, float]:
    from longctx.engine.cuda_graph import DecodeGraphs
    from longctx.engine.plan import BatchResult, RowResult
    from longctx.engine.request import Request, SamplingParams
    from longctx.engine.scheduler import Scheduler
    from longctx.kvstore.allocator import PageAllocator

    alloc = PageAllocator(batch * (context // 64 + 8) + 16, 64)
    sched = Scheduler(alloc, None, max_context=context + 1000, chunk_size=1 << 30, max_running=batch)
    for i in range(batch):
        sched.add(Request(f"r{i}", [1] * context, SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)))

    def result(plan):
        return BatchResult(plan.step_id, [RowResult(r.rid, token_id=5) for r in plan.rows])

    plan = sched.schedule()  # the prompts in one prefill step (nothing runs)
    assert plan is not None
    sched.update(plan, result(plan))
    worker = SimpleNamespace(
        page_size=64, device=torch.device("cpu"), is_first=True, is_last=True,
        kv=SimpleNamespace(dense_readable=True),
    )  # fmt: skip
    graphs = DecodeGraphs(worker, context + 1000, dummy_page=alloc.num_pages - 1, capture=False)
    bufs: dict = {}
    graphs._get = lambda b, n: bufs.setdefault((b, n), graphs._buffers(b, n))  # type: ignore[method-assign]
    graphs._forward = lambda c: torch.zeros(c.inputs.b, 8)  # type: ignore[method-assign]
    t_sched, t_inputs, t_update = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        graphs.run(plan)
        t2 = time.perf_counter()
        sched.update(plan, result(plan))
        t3 = time.perf_counter()
        t_sched.append(t1 - t0)
        t_inputs.append(t2 - t1)
        t_update.append(t3 - t2)

    def med(x: list[float]) -> float:
        return sorted(x)[len(x) // 2] * 1e3

    out = {"schedule_ms": med(t_sched), "graph_inputs_ms": med(t_inputs), "update_ms": med(t_update)}
    out["total_ms"] = sum(out.values())
    return out


def measure_context(batch: int, context: int, tokens: int, steps: int) -> float:
    """Median ms of `StageWorker.context` for `batch` rows of `tokens` new tokens at `context`."""
    from longctx.engine.plan import BatchPlan, RowPlan
    from longctx.engine.worker import StageWorker

    model = SimpleNamespace(has_embed=True, has_head=True, set_backend=lambda _: None)
    worker = StageWorker(model, None, torch.device("cpu"), False)  # type: ignore[arg-type]
    pages = tuple(range(context // 64 + steps + 2))
    times = []
    for i in range(steps):
        start = context - tokens + i
        rows = tuple(
            RowPlan(f"r{j}", (1,) * tokens, start, pages[: -(-(start + tokens) // 64)], pages_epoch=j + 1)
            for j in range(batch)
        )
        t = time.perf_counter()
        worker.context(BatchPlan(i, rows))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


CONTEXT_GRID = ((1, 1 << 20, 1), (64, 131072, 1), (1, 1 << 20, 8192))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res: dict = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    rows = [
        "| batch | context | schedule ms | graph inputs ms | update ms | total ms |",
        "|---|---|---|---|---|---|",
    ]
    for b, c in GRID:
        m = measure(b, c, args.steps)
        res[f"b{b}_ctx{c}"] = m
        rows.append(
            f"| {b} | {c:,} | {m['schedule_ms']:.3f} | {m['graph_inputs_ms']:.3f} | {m['update_ms']:.3f} | "
            f"{m['total_ms']:.3f} |"
        )
    rows += [
        "",
        "| eager `StageWorker.context` | batch | context | new tokens per row | ms |",
        "|---|---|---|---|---|",
    ]
    for b, c, n in CONTEXT_GRID:
        ms = measure_context(b, c, n, max(5, args.steps // 5))
        res[f"context_b{b}_ctx{c}_n{n}_ms"] = ms
        rows.append(f"| | {b} | {c:,} | {n} | {ms:.3f} |")
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        import json

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host-step-cpu.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.out / "host-step-cpu.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
