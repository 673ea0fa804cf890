"""Loss curves of training runs side by side: answer loss, answer accuracy and exact match vs tokens seen.

Reads each run's `train_log.jsonl` (or a stdout log: its JSON lines with a "step" are the log rows) and
writes a PNG and a markdown table (first / last logged figures per run).

    python -m bench.train_report NAME=PATH [NAME=PATH ...] --out bench/results/training/curves
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in r and "loss_answer" in r:
            rows.append(r)
    return rows


def with_tokens(rows: list[dict], offset: int = 0) -> list[tuple[int, dict]]:
    """(tokens seen up to the row's step, row): each row's tokens per step are seq_len x batch."""
    out, tokens, last = [], offset, None
    for r in rows:
        prev = last["step"] if last else (rows[0]["step"] - 10 if rows else 0)
        tokens += (r["step"] - prev) * r["seq_len"] * r["batch"]
        out.append((tokens, r))
        last = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=PATH")
    ap.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        runs[name] = with_tokens(read_log(Path(path)))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4))
    FigureCanvasAgg(fig)
    keys = ("loss_answer", "answer_acc", "answer_exact")
    for i, k in enumerate(keys):
        ax = fig.add_subplot(1, 3, i + 1)
        for name, pts in runs.items():
            ax.plot([t / 1e6 for t, _ in pts], [r[k] for _, r in pts], label=name, linewidth=1)
        ax.set_xlabel("tokens (M)")
        ax.set_title(k)
        ax.grid(True, alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(args.out.with_suffix(".png")), dpi=100)
    lines = [
        "| run | steps | tokens (M) | seq | answer loss first -> last | answer acc | exact match | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, pts in runs.items():
        if not pts:
            continue
        (_, a), (t, z) = pts[0], pts[-1]
        lines.append(
            f"| {name} | {z['step']} | {t / 1e6:.0f} | {z['seq_len']} | {a['loss_answer']:.2f} -> "
            f"{z['loss_answer']:.2f} | {z['answer_acc']:.2f} | {z['answer_exact']:.2f} | {z['tokens_per_s']:.0f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
