"""Does the model bind a needle's key to its value? niah samples with several needles (issue 10: multikey).

In niah_multikey_1 the haystack holds four needles, `One of the special magic numbers for <key> is:
<value>.`, and the question asks for one key's value. Run 23 scores 25 there at 4K-128K, while its full
layers select the asked needle's value at every answer row (`bench.needle_recall`). This tells where the
other needles win. For each sample, at the answer's space row (the prompt, then the space every answer
starts with: the row that writes the value's first byte), from the training forward of the raw prompt
(`TrainCausalLM.forward_train`, sparse, the checkpoint's selection or the flags'):

- per layer, the main attention (mean over heads) on the asked needle's value bytes and on the best
  other needle's, over the selection and over every causal key, and whether the asked one is ahead of
  every other (`ahead`: chance is one in the number of needles);
- per full layer, the same for the indexer: whether its best index score on the asked value's bytes is
  ahead of every other needle's (`index_ahead`);

and from the engine (greedy, the output budget of `bench.retrieval_eval`), which needle's value the
answer holds: the asked one, another one, or none.

    python -m bench.key_binding --model DIR --lengths 4k --samples 20 [--tasks niah_multikey_1] [--device cpu] --out R

Writes R/key-binding.json (per sample and the means) and R/key-binding.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.engine.args import selection_kwargs  # noqa: E402

# longctx.workloads.ruler_tasks.NEEDLE: "One of the special magic {vtype} for {key} is: {value}." (the
# haystack's next sentence may follow the period without a space)
NEEDLE_RE = re.compile(r"One of the special magic \S+ for (\S+) is: (\S+?)\.")


def needles(text: str) -> list[tuple[str, str]]:
    """(key, value) of every needle sentence in a niah prompt, in prompt order."""
    return [(m.group(1), m.group(2)) for m in NEEDLE_RE.finditer(text)]


def answer_kind(pred: str, asked: list[str], others: list[str]) -> str:
    """ "asked" when the answer holds every asked value (RULER's string_match_all), else "other" when it
    holds another needle's value, else "none"."""
    if all(v in pred for v in asked):
        return "asked"
    return "other" if any(v in pred for v in others) else "none"


def ahead(shares: list[float], asked: set[int]) -> bool:
    """Whether every asked needle's share is above every other needle's."""
    rest = [s for i, s in enumerate(shares) if i not in asked]
    return bool(rest) and min(shares[i] for i in asked) > max(rest)


def probe_row(model: Any, ids: list[int], spans: list[list[int]], device: torch.device) -> dict[str, list]:
    """One sparse training forward of `ids`; at its last row, per layer the main attention's share on each span
    (`sel` over the selection, `dense` over every causal key) and per full layer each span's best index
    score."""
    from bench.long_parity import train_autocast

    row = len(ids) - 1
    idx = torch.tensor([[row]], device=device)
    sel_shares: list[list[float]] = []
    dense_shares: list[list[float]] = []
    index_best: list[list[float]] = []

    def probe(main_scores, sel, scale):  # type: ignore[no-untyped-def]
        sc = (main_scores(torch.zeros(1, 1, dtype=torch.long, device=device), idx)[0, :, 0] * scale).float()
        sc = sc[:, : row + 1]  # [H, causal keys]
        dense = torch.softmax(sc, -1).mean(0)
        if sel is None:
            sparse = dense
        else:
            keep = sel[0, row]
            keep = keep[keep >= 0]
            mask = torch.full_like(sc, float("-inf"))
            mask[:, keep] = 0.0
            sparse = torch.softmax(sc + mask, -1).mean(0)
        sel_shares.append([float(sparse[s].sum()) for s in spans])
        dense_shares.append([float(dense[s].sum()) for s in spans])

    qkw = model._indexer_qkw

    def captured(*a, **kw):  # type: ignore[no-untyped-def]
        qi, ki, wi = qkw(*a, **kw)
        with torch.no_grad():
            s = torch.relu(torch.einsum("hd,sd->hs", qi[0, row].float(), ki[0, : row + 1].float()))
            logits = (s * wi[0, row].float()[:, None]).sum(0)
        index_best.append([float(logits[s].max()) for s in spans])
        return qi, ki, wi

    model.attention_probe, model._indexer_qkw = probe, captured
    try:
        with torch.no_grad(), train_autocast(device):
            model.forward_train(torch.tensor([ids], device=device), sparse=True)
    finally:
        model.attention_probe = None
        del model._indexer_qkw  # (the class's method again)
    return {"sel": sel_shares, "dense": dense_shares, "index": index_best}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over samples: per layer the shares and how often the asked needle is ahead; the answers."""
    n = len(rows)
    layers = []
    for li in range(len(rows[0]["layers"])):
        per = [r["layers"][li] for r in rows]
        layers.append({k: round(sum(p[k] for p in per) / n, 4) for k in per[0]})
    index = []
    for li in range(len(rows[0]["index_ahead"])):
        index.append(round(sum(r["index_ahead"][li] for r in rows) / n, 4))
    answers = {k: sum(r["answer"] == k for r in rows) for k in ("asked", "other", "none")}
    return {"samples": n, "layers": layers, "index_ahead": index, "answers": answers}


def table(res: dict[str, Any]) -> str:
    lines = [
        "Per layer at the answer's space row (the training forward): the main attention's share on the asked",
        "needle's value and on the best other needle's (over the selection; over every causal key), and how",
        "often the asked one is ahead of every other (chance: one in the number of needles); per full layer",
        "how often its best index score is. Answers: the engine's greedy output holds the asked value, another",
        "needle's, or none.",
        "",
        "| task, length | layer | asked, selection | best other, selection | asked, every key | best other, every key | ahead | index ahead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in res["results"].items():
        full = iter(s["summary"]["index_ahead"])
        for li, v in enumerate(s["summary"]["layers"]):
            ix = next(full) if li in s["full_layers"] else None
            lines.append(
                f"| {key} | {li} | {v['asked_sel']:.3f} | {v['other_sel']:.3f} | {v['asked_dense']:.3f} | "
                f"{v['other_dense']:.3f} | {v['ahead']:.2f} | {'-' if ix is None else f'{ix:.2f}'} |"
            )
    lines.append("")
    for key, s in res["results"].items():
        a = s["summary"]["answers"]
        lines.append(
            f"- {key}: {s['summary']['samples']} samples, answers asked {a['asked']} / another needle's "
            f"{a['other']} / none {a['none']}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.needle_recall import add_sample_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_args(ap, lengths="4k", tasks="niah_multikey_1", samples=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from bench.common import write_json_md
    from bench.needle_recall import needle_positions, open_sample_bench, read_sample_args
    from longctx import Engine
    from longctx.config import ModelConfig
    from longctx.errors import LongctxError
    from longctx.train.loop import resolve_device
    from longctx.workloads.ruler_runner import format_length

    try:
        lengths, tasks = read_sample_args(args)
        if not all(t.startswith("niah_") for t in tasks):
            raise LongctxError(f"--tasks {args.tasks}: niah tasks only (their needles have keys)")
        device = resolve_device(args.device)
    except LongctxError as e:
        print(f"key_binding: {e}", file=sys.stderr)
        return 2
    counter, gen, model, res = open_sample_bench(args, "key_binding", argv, device)
    full_layers = [i for i, t in enumerate(ModelConfig.from_json(args.model).indexer_types) if t == "full"]
    with Engine(
        args.model, device=str(device), max_context=max(lengths), cuda_graphs=False, **selection_kwargs(args)
    ) as eng:
        for task in tasks:
            for L in lengths:
                rows, t0 = [], time.time()
                for i in range(args.samples):
                    s = gen.sample(task, L, i)
                    found = needles(s.input)
                    values = [v for _, v in found]
                    asked = {j for j, v in enumerate(values) if v in s.outputs}
                    if len(found) < 2 or not asked:
                        continue  # one needle (or none parsed): nothing to bind
                    ids = counter.encode(s.input + s.answer_prefix)
                    space = counter.encode(" ")
                    assert ids is not None and space is not None
                    spans = []
                    for v in values:
                        vid = counter.encode(v)
                        assert vid is not None
                        spans.append(needle_positions(ids, vid))
                    got = probe_row(model, ids + space, spans, device)  # (the value's first byte's row)
                    (out,) = eng.generate([ids], max_new_tokens=s.max_new_tokens)
                    pred = out.text or ""
                    per_layer = []
                    for sh_sel, sh_dense in zip(got["sel"], got["dense"], strict=True):
                        others = [x for j, x in enumerate(sh_sel) if j not in asked]
                        others_d = [x for j, x in enumerate(sh_dense) if j not in asked]
                        per_layer.append({
                            "asked_sel": min(sh_sel[j] for j in asked), "other_sel": max(others),
                            "asked_dense": min(sh_dense[j] for j in asked), "other_dense": max(others_d),
                            "ahead": float(ahead(sh_sel, asked)),
                        })  # fmt: skip
                    rows.append({
                        "index": i, "needles": len(found), "asked": sorted(asked), "pred": pred,
                        "answer": answer_kind(pred, list(s.outputs), [v for v in values if v not in s.outputs]),
                        "layers": per_layer, "index_ahead": [float(ahead(b, asked)) for b in got["index"]],
                    })  # fmt: skip
                if not rows:
                    print(f"key_binding: no {task} sample at {L} has several needles", file=sys.stderr)
                    return 2
                key = f"{task} {format_length(L)}"
                res["results"][key] = {"rows": rows, "summary": summarize(rows), "full_layers": full_layers}
                print(f"key_binding: {key} done in {time.time() - t0:.0f}s", file=sys.stderr)
    md = table(res)
    write_json_md(args.out, "key-binding", res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
