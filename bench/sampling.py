"""The last stage's sampling, one draw per row, per-row reference against the batched path.

`_sample` runs each row on its own (a sort, softmaxes and the Gumbel draw per row: the launches the
engine spent per sampled row before `draw_rows`); `sample_rows_device` draws every row together
(`draw_rows`: one sort for the rows with top-k / top-p, one Gumbel kernel). Timed with CUDA events
(`bench.common.time_cuda`, host time included: launch-bound work is the point) at a GLM vocabulary
for batch 1, 8 and 32 and three kinds of rows; the tokens of both paths are compared first.

    python -m bench.sampling [--vocab 154880] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, time_cuda, write_json_md  # noqa: E402

KINDS = {
    "temperature 0.7": dict(temperature=0.7),
    "+ top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "+ top_k 50": dict(temperature=0.7, top_k=50),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=154_880)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.sampling: needs CUDA")
        return 2
    from longctx.engine.plan import RowPlan
    from longctx.engine.sampling import _sample, sample_rows_device

    res: dict = {"env": environment(), "vocab": args.vocab, "rows": []}
    lines = [
        "| rows | batch | per-row ms | batched ms | speed-up | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, kw in KINDS.items():
        for batch in (1, 8, 32):
            rows = [
                RowPlan(rid=str(i), token_ids=(0,), start=0, pages=(), seed=i, step=7, **kw)
                for i in range(batch)
            ]
            x = torch.randn(batch, args.vocab, device="cuda") * 3

            def per_row(x: torch.Tensor = x, rows: list = rows) -> torch.Tensor:
                return torch.stack(
                    [
                        _sample(x[i], r.temperature, r.top_p, r.top_k, r.seed, r.step, r.min_p)
                        for i, r in enumerate(rows)
                    ]
                )

            def batched(x: torch.Tensor = x, rows: list = rows) -> torch.Tensor:
                return sample_rows_device(x, rows, backend="auto")

            same = float((per_row() == batched()).float().mean())
            t_row, t_batch = time_cuda(per_row), time_cuda(batched)
            res["rows"].append(
                {
                    "rows": name,
                    "batch": batch,
                    "per_row_ms": t_row * 1e3,
                    "batched_ms": t_batch * 1e3,
                    "same": same,
                }
            )
            lines.append(
                f"| {name} | {batch} | {t_row * 1e3:.3f} | {t_batch * 1e3:.3f} | {t_row / t_batch:.1f}x | {same:.3f} |"
            )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        write_json_md(args.out, "sampling", res, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
