"""Where a model looks when it writes a niah_multivalue value a second time (issue 10).

niah_multivalue hides four needles with one key and four values and asks for all of them. Run 34 writes a
value twice in 19 of 20 answers at 4K and 32K (run 29: 1 and 5). For each sample whose greedy answer (the
engine, `bench.retrieval_eval`'s output budget) repeats a value, at the row that writes the repeated value's
first byte (the prompt, then the answer up to there), from the training forward (sparse, the checkpoint's
selection or the flags'), per layer the main attention (mean over heads, over the selection) on:

- `needle`: the repeated value's bytes in its needle;
- `answer`: its bytes where the answer already wrote it;
- `unwritten`: the best needle whose value the answer has not written yet.

A repeat looked up again puts the needle ahead of the answer's copy; one copied from the answer, the copy.

    python -m bench.value_repeat --model DIR --lengths 2k --samples 6 [--device cpu] --out R

Writes R/value-repeat.json (per sample) and R/value-repeat.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VALUE_RE = re.compile(r"\d{7}")  # the numbers RULER's niah_multivalue asks for


def first_repeat(pred: str) -> tuple[int, str] | None:
    """(character offset, value) of the first number in `pred` that repeats an earlier one, else None."""
    seen: set[str] = set()
    for m in VALUE_RE.finditer(pred):
        if m.group(0) in seen:
            return m.start(), m.group(0)
        seen.add(m.group(0))
    return None


def probe_repeat(model: Any, counter: Any, s: Any, ids: list[int], pred: str, device: Any) -> dict[str, Any]:
    """For sample `s` (its prompt, `ids` in tokens, then the answer `pred`): the first repeated value
    (`repeat`, None when there is none), whether a needle holds it, and per layer the attention shares at
    the row that writes it (None when no needle holds it: nothing to compare)."""
    from bench.key_binding import NEEDLE_RE, probe_row
    from bench.needle_recall import needle_positions

    def encode(text: str) -> list[int]:
        ids = counter.encode(text)
        assert ids is not None
        return ids

    rep = first_repeat(pred)
    if rep is None:
        return {"repeat": None}
    at, value = rep
    head = encode(pred[:at])
    written = {m.group(0) for m in VALUE_RE.finditer(pred[:at])}
    spans = [
        needle_positions(ids, encode(value)),
        [len(ids) + p for p in needle_positions(head, encode(value))],
        *(
            needle_positions(ids, encode(m.group(2)))
            for m in NEEDLE_RE.finditer(s.input)
            if m.group(2) not in written
        ),
    ]
    if not spans[0]:
        return {"repeat": value, "needle": False, "layers": None}
    got = probe_row(model, ids + head, spans, device)
    layers = [{"needle": sh[0], "answer": sh[1], "unwritten": max(sh[2:], default=0.0)} for sh in got["sel"]]
    return {"repeat": value, "needle": True, "layers": layers}


def table(res: dict[str, Any]) -> str:
    lines = [
        f"`{res['model']}`: per layer, attention at the row that writes a repeated value's first byte (mean"
        " over the samples with a repeat).",
        "",
        "| length | layer | needle | answer's copy | best unwritten needle | samples |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in res["results"].items():
        rows = [x for x in r["rows"] if x.get("layers")]
        for li in range(len(rows[0]["layers"]) if rows else 0):
            mean = [
                sum(x["layers"][li][k] for x in rows) / len(rows) for k in ("needle", "answer", "unwritten")
            ]
            lines.append(f"| {key} | {li} | {mean[0]:.3f} | {mean[1]:.3f} | {mean[2]:.3f} | {len(rows)} |")
        rep = sum(x["repeat"] is not None for x in r["rows"])
        lines.append(f"| {key} | answers repeating a value | {rep} of {len(r['rows'])} | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.needle_recall import add_sample_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_args(ap, lengths="2k", tasks="niah_multivalue", samples=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from bench.common import write_json_md
    from bench.needle_recall import open_sample_bench, read_sample_args
    from longctx import Engine
    from longctx.engine.args import selection_kwargs
    from longctx.errors import LongctxError
    from longctx.train.loop import resolve_device
    from longctx.workloads.ruler_runner import format_length

    try:
        lengths, tasks = read_sample_args(args)
        if tasks != ["niah_multivalue"]:
            raise LongctxError(f"--tasks {args.tasks}: niah_multivalue only (one key, several values)")
        device = resolve_device(args.device)
    except LongctxError as e:
        print(f"value_repeat: {e}", file=sys.stderr)
        return 2
    counter, gen, model, res = open_sample_bench(args, "value_repeat", argv, device)
    with Engine(
        args.model, device=str(device), max_context=max(lengths), cuda_graphs=False, **selection_kwargs(args)
    ) as eng:
        for L in lengths:
            rows, t0 = [], time.time()
            for i in range(args.samples):
                s = gen.sample("niah_multivalue", L, i)
                ids = counter.encode(s.input + s.answer_prefix)
                (out,) = eng.generate([ids], max_new_tokens=s.max_new_tokens)
                pred = out.text or ""
                row = {"index": i, "pred": pred, "outputs": list(s.outputs)}
                rows.append(row | probe_repeat(model, counter, s, ids, pred, device))
            key = format_length(L)
            res["results"][key] = {"rows": rows}
            print(f"value_repeat: {key} done in {time.time() - t0:.0f}s", file=sys.stderr)
    md = table(res)
    write_json_md(args.out, "value-repeat", res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
