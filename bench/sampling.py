"""The last stage's sampling, one draw per row, per-row reference against the batched path.

`_sample` runs each row on its own (a sort, softmaxes and the Gumbel draw per row: the launches the
engine spent per sampled row before `draw_rows`); `sample_rows_device` draws every row together
(`draw_rows`: one sort for the rows with top-k / top-p, one Gumbel kernel). Timed with CUDA events
(`bench.common.time_cuda`, host time included: launch-bound work is the point; on the CPU the median
of wall-clock runs) at a GLM vocabulary for batch 1, 8 and 32 and three kinds of rows, and the penalties
(`Penalties.apply` over every row, 100 tokens of history each: its torch form, its kernel
(`PENALTIES_KERNEL_CUDA`, output compared bit for bit with the torch form's), and a step's apply + record
with the kernel, one step after another); the tokens of both paths are compared first. Top-p rows are
timed twice: as the engine draws them (from each row's likeliest `TOP_P_CANDIDATES` tokens when they hold
top_p of its mass, one host synchronisation to know; on CUDA the engine takes it only with
`TOP_P_CANDIDATES_CUDA`, which this bench sets) and with whole rows sorted (`TOP_P_CANDIDATES = 0`); a
mixed batch (temperature-only and top-p rows) a third time with its temperature-only rows drawn apart on
CUDA too (`SPLIT_PLAIN_CUDA`; the CPU always splits); temperature-only rows with the logits scaled before
the Gumbel kernel (`SCALE_IN_KERNEL_CUDA` off); every kind with the draw's winner picked by its second
kernel (`kernels.gumbel.PICK_KERNEL_CUDA`). Two kinds of logits: `flat` (N(0, 3^2): top-p 0.9 keeps tens
of thousands of tokens) and `peaked` (a Zipf law over a random order of the vocabulary, logit -log(rank):
top-p 0.9 keeps a few hundred, as a language model's usually does). The greedy rows (one argmax) are the
floor a sampled step is compared with.

    python -m bench.sampling [--device cuda|cpu] [--vocab 154880] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, sampler_route, time_cuda, time_wall, write_json_md  # noqa: E402

KINDS = {
    "temperature 0.7": dict(temperature=0.7),
    "+ top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "+ top_k 50": dict(temperature=0.7, top_k=50),
    "+ top_k 50, top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    # a server's batch: most requests with a temperature alone, every fourth with a top-p too (drawn as two
    # groups: only the top-p rows are sorted or take their candidates)
    "mixed: top_p 0.9 every 4th row": lambda i: dict(temperature=0.7, top_p=0.9 if i % 4 == 0 else 1.0),
}

DISTS = ("flat", "peaked")


def logits_of(dist: str, batch: int, vocab: int, dev: str) -> torch.Tensor:
    """[batch, vocab] fp32 logits: `flat` N(0, 3^2); `peaked` -log(rank) over a random order per row."""
    if dist == "flat":
        return torch.randn(batch, vocab, device=dev) * 3
    rank = torch.rand(batch, vocab, device=dev).argsort(dim=1).float() + 1
    return -torch.log(rank)


def _ms(t: float | None) -> str:
    """A table cell: seconds as ms, or empty where not timed."""
    return "" if t is None else f"{t * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--vocab", type=int, default=154_880)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.sampling: no CUDA device (--device cpu times the CPU)")
        return 2
    from longctx.engine.plan import RowPlan
    from longctx.engine.sampling import Penalties, _sample, sample_rows_device

    dev = args.device
    timed = time_cuda if dev == "cuda" else time_wall
    res: dict = {"env": environment(), "device": dev, "vocab": args.vocab, "rows": [], "penalties": []}
    lines = [
        "| logits: rows | batch | per-row ms | batched ms | batched, rows sorted ms | batched, rows sorted, split ms "
        "(temperature alone: scaled first) | batched, draw's pick kernel ms | speed-up | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dist, name, kw in [(d, n, k) for d in DISTS for n, k in KINDS.items()]:
        for batch in (1, 8, 32):
            one = dict(token_ids=(0,), start=0, pages=(), step=7)  # (a one-token row, no pages)
            rows = [
                RowPlan(rid=str(i), seed=i, **one, **(kw(i) if callable(kw) else kw)) for i in range(batch)
            ]
            x = logits_of(dist, batch, args.vocab, dev)

            def per_row(x: torch.Tensor = x, rows: list = rows) -> torch.Tensor:
                return torch.stack(
                    [
                        _sample(x[i], r.temperature, r.top_p, r.top_k, r.seed, r.step, r.min_p)
                        for i, r in enumerate(rows)
                    ]
                )

            def batched(x: torch.Tensor = x, rows: list = rows) -> torch.Tensor:
                return sample_rows_device(x, rows, backend="auto")

            sames: list[float] = []

            def routed(
                per_row: Callable = per_row, batched: Callable = batched, sames: list = sames, **route: Any
            ) -> float:
                """The batched draw timed under `sampler_route(**route)`, its tokens compared first."""
                with sampler_route(**route):
                    sames.append(float((per_row() == batched()).float().mean()))
                    return timed(batched)

            t_row = timed(per_row)
            t_batch = routed()
            has_p = [r.top_p < 1.0 for r in rows]
            # the same rows with whole rows sorted (no candidates first)
            t_sort = routed(candidates=0) if any(has_p) else None
            t_split = t_scaled = None
            if any(has_p) and not all(has_p):  # a mixed batch: temperature-only rows drawn apart on CUDA too
                t_split = routed(candidates=0, split=True)
            if not any(p or r.top_k or r.min_p for p, r in zip(has_p, rows)):  # temperature alone
                t_scaled = routed(scale_in_kernel=False)  # (the logits scaled before the Gumbel kernel)
            t_pick = routed(pick_kernel=True)  # (the draw's winner picked by one kernel on CUDA too)
            same = min(sames)
            res["rows"].append(
                {
                    "rows": name,
                    "logits": dist,
                    "batch": batch,
                    "per_row_ms": t_row * 1e3,
                    "batched_ms": t_batch * 1e3,
                    "batched_sort_ms": None if t_sort is None else t_sort * 1e3,
                    "batched_sort_split_ms": None if t_split is None else t_split * 1e3,
                    "batched_scaled_first_ms": None if t_scaled is None else t_scaled * 1e3,
                    "batched_pick_kernel_ms": t_pick * 1e3,
                    "same": same,
                }
            )
            lines.append(
                f"| {dist}: {name} | {batch} | {t_row * 1e3:.3f} | {t_batch * 1e3:.3f} | "
                f"{_ms(t_sort)} | "
                f"{_ms(t_split if t_scaled is None else t_scaled)} | {_ms(t_pick)} | {t_row / t_batch:.1f}x | "
                f"{same:.3f} |"
            )
    lines += ["", "| greedy (argmax), rows | ms |", "|---|---|"]
    for batch in (1, 8, 32):
        x = logits_of("peaked", batch, args.vocab, dev)
        t = timed(lambda x=x: torch.argmax(x, dim=-1))
        res.setdefault("greedy", []).append({"batch": batch, "ms": t * 1e3})
        lines.append(f"| {batch} | {t * 1e3:.3f} |")
    lines += [
        "",
        "| penalties, rows | history | batched ms | in one kernel ms | apply + record (a step's), kernel ms |",
        "|---|---|---|---|---|",
    ]
    pen_kw = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    for batch in (1, 8, 32):
        pen = Penalties()
        prompt = [tuple(range(i, i + 500)) for i in range(batch)]
        first = [
            RowPlan(rid=str(i), token_ids=(0,), start=0, pages=(), penalty_prompt=prompt[i], **pen_kw)
            for i in range(batch)
        ]
        x = torch.randn(batch, args.vocab, device=dev)
        pen.apply(x, first, range(batch))
        for step in range(100):
            now = [RowPlan(rid=str(i), token_ids=(0,), start=0, pages=(), step=step) for i in range(batch)]
            pen.record(torch.randint(0, args.vocab, (batch,), device=dev), now, range(batch))
        rows = [
            RowPlan(rid=str(i), token_ids=(0,), start=0, pages=(), step=100, **pen_kw) for i in range(batch)
        ]
        toks = torch.randint(0, args.vocab, (batch,), device=dev)
        with sampler_route(penalties_kernel=False):
            want = pen.apply(x, rows, range(batch), "torch")
            t = timed(lambda pen=pen, x=x, rows=rows: pen.apply(x, rows, range(len(rows))))
        with sampler_route(penalties_kernel=True):
            same = torch.equal(pen.apply(x, rows, range(batch)), want)
            t_k = timed(lambda pen=pen, x=x, rows=rows: pen.apply(x, rows, range(len(rows))))

            # a step as the engine takes it: penalise at step s, record token s, then s + 1 (each call's
            # rows built beforehand, as the scheduler builds them)
            ahead = [[dataclasses.replace(r, step=100 + k) for r in rows] for k in range(64)]
            at = iter(ahead)

            def step_of(pen=pen, x=x, toks=toks, at=at) -> None:
                now = next(at)
                pen.apply(x, now, range(len(now)))
                pen.record(toks, now, range(len(now)))

            t_step = timed(step_of)
        res["penalties"].append(
            {
                "batch": batch,
                "history": 100,
                "batched_ms": t * 1e3,
                "kernel_ms": t_k * 1e3,
                "apply_record_kernel_ms": t_step * 1e3,
                "kernel_equals_torch": same,
            }
        )
        lines.append(
            f"| {batch} | 100 | {t * 1e3:.3f} | {t_k * 1e3:.3f}{'' if same else ' (differs!)'} | {t_step * 1e3:.3f} |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        write_json_md(args.out, f"sampling-{dev}", res, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
