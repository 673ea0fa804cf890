"""How a needle's own rows attend as the haystack before it grows (issue 10: the near needles at 1M).

Run 23 at 1M misses every niah_single_1 needle that sits within ~70K bytes of the question and gets most
of the far ones (`bench.retrieval_eval depth`; docs/training.md, run 25); at 128K it gets them all. One
explanation: a needle's rows (the bytes of its value) attend over the top-k of everything before them,
their local window included, so after ~1M of haystack they share their attention with the highest-scored
of many more haystack keys than any trained row held (at most 128K). This measures that share where a CPU
can: for niah_single_1 samples whose needle sits late in the prompt (depth >= `--min-depth`), at several
lengths, the training forward (`TrainCausalLM.forward_train`, sparse, the checkpoint's selection or the
one `--index-topk` / `--index-local-window` / `--index-topk-long` ask for, as the engine takes them) of the
raw prompt, and at every layer the main attention of the needle value's rows, averaged over heads, rows
and samples:

- `far_sel`: the share on selected keys outside the row's last `--local` positions (the haystack it
  picked), over the selection the sparse model attends;
- `far_dense`: the same over every causal key (the dense model: what the selection is trained toward);
- `sel_far_keys`: how many of the row's selected keys lie outside those positions.

If `far_sel` grows with the length, a needle read after much more haystack than training showed is
diluted; if it stays flat, the near-needle misses at 1M have another cause.

    python -m bench.needle_context --model DIR --lengths 4k,16k,32k --samples 2 [--min-depth D] [--device cpu] --out R
    python -m bench.needle_context ... --index-topk-long 0   # the shipped model without its narrowing

On CUDA the forward runs under bf16 autocast with the fused selection, as training does (a CPU: fp32 and
the chunked selection).

Writes R/needle-context.json and R/needle-context.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.engine.args import add_selection_args, selection_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCAN = 200  # sample indices looked at per length for late needles


def late_samples(gen: Any, length: int, count: int, min_depth: float) -> list[tuple[int, Any, float]]:
    """The first `count` niah_single_1 samples at `length` whose needle value starts at depth >=
    `min_depth` of the prompt text: (index, sample, depth)."""
    out = []
    for i in range(SCAN):
        s = gen.sample("niah_single_1", length, i)
        text = s.input + s.answer_prefix
        d = text.find(s.outputs[0]) / len(text)
        if d >= min_depth:
            out.append((i, s, d))
            if len(out) == count:
                break
    return out


def row_shares(
    scores: torch.Tensor, rows: list[int], sel: torch.Tensor | None, local: int
) -> list[dict[str, float]]:
    """scores [H, R, S] (scaled logits of `rows` over every key), sel [S, K] (-1 pads) or None (dense) ->
    per row: far_sel, far_dense and sel_far_keys (module doc)."""
    H, R, S = scores.shape
    keys = torch.arange(S, device=scores.device)
    out = []
    for j, r in enumerate(rows):
        causal = keys <= r
        far = causal & (keys <= r - local)
        if sel is None:
            chosen = causal
        else:
            chosen = torch.zeros(S, dtype=torch.bool, device=scores.device)
            picked = sel[r]
            chosen[picked[picked >= 0].long()] = True
            chosen &= causal
        row: dict[str, float] = {"sel_far_keys": float((chosen & far).sum())}
        for name, allowed in (("sel", chosen), ("dense", causal)):
            p = torch.softmax(scores[:, j].float().masked_fill(~allowed, float("-inf")), -1).mean(0)
            row[f"far_{name}"] = float(p[far].sum())
        out.append(row)
    return out


def probe_sample(model: Any, ids: list[int], rows: list[int], local: int, device: torch.device) -> list[dict]:
    """Per layer (in order), the mean of `row_shares` over `rows`, from one sparse training forward."""
    from bench.long_parity import train_autocast

    layers: list[dict[str, float]] = []
    idx = torch.tensor([rows], device=device)

    def probe(main_scores, sel, scale):  # type: ignore[no-untyped-def]
        sc = main_scores(torch.zeros(1, 1, dtype=torch.long, device=device), idx)[0] * scale  # [H, R, S]
        per = row_shares(sc, rows, None if sel is None else sel[0], local)
        layers.append({k: sum(r[k] for r in per) / len(per) for k in per[0]})

    model.attention_probe = probe
    with torch.no_grad(), train_autocast(device):  # (bf16 on CUDA, as the model trained)
        model.forward_train(torch.tensor([ids], device=device), sparse=True)
    model.attention_probe = None
    return layers


def table(res: dict[str, Any]) -> str:
    lines = [
        "| length | samples (depth) | layer | far_sel | far_dense | selected far keys |",
        "|---|---|---|---|---|---|",
    ]
    for L, r in res["lengths"].items():
        depths = ", ".join(f"{s['index']} ({s['depth']:.2f})" for s in r["samples"])
        for li, v in enumerate(r["layers"]):
            lines.append(
                f"| {L} | {depths if li == 0 else ''} | {li} | {v['far_sel']:.3f} | {v['far_dense']:.3f} "
                f"| {v['sel_far_keys']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models-shipped" / "retrieval-wip"))
    ap.add_argument("--lengths", default="4k,16k,32k")
    ap.add_argument("--samples", type=int, default=2, help="late-needle samples a length")
    ap.add_argument(
        "--min-depth", type=float, default=0.8, help="where a late needle's value starts, at least"
    )
    ap.add_argument("--local", type=int, default=64, help="a row's last positions that are not 'far'")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, required=True)
    add_selection_args(ap)  # (the training forward selecting otherwise: the top-k, window, narrowing)
    args = ap.parse_args(argv)

    from bench.common import write_json_md
    from bench.long_parity import train_model
    from bench.needle_recall import MAX_NEW_TOKENS_SCALE, SEED, check_trained_model, needle_positions
    from longctx.errors import LongctxError
    from longctx.train.loop import resolve_device
    from longctx.workloads.ruler_cli import parse_lengths
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    try:
        check_trained_model(args.model, args)
        lengths = parse_lengths(args.lengths)
        if args.samples < 1 or not 0.0 <= args.min_depth < 1.0 or args.local < 1:
            raise LongctxError("--samples must be >= 1, --min-depth in [0, 1) and --local >= 1")
        device = resolve_device(args.device)
    except LongctxError as e:
        print(f"needle_context: {e}", file=sys.stderr)
        return 2
    counter = load_counter(args.model)
    gen = RulerGenerator(counter, seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE)
    model = train_model(args.model, device, selection_kwargs(args))
    res: dict[str, Any] = {
        "model": args.model,
        "local": args.local,
        "min_depth": args.min_depth,
        "selection": {k: v for k, v in selection_kwargs(args).items() if v is not None},
        "lengths": {},
    }
    res["command"] = "python -m bench.needle_context " + " ".join(argv if argv is not None else sys.argv[1:])
    for L in lengths:
        picked = late_samples(gen, L, args.samples, args.min_depth)
        if not picked:
            print(
                f"needle_context: no sample at {L} with its needle at depth >= {args.min_depth}",
                file=sys.stderr,
            )
            return 2
        per_sample, t0 = [], time.time()
        for i, s, d in picked:
            ids = counter.encode(s.input + s.answer_prefix)
            value = counter.encode(s.outputs[0])
            assert ids is not None and value is not None
            rows = [p for p in needle_positions(ids, value) if p >= args.local]
            per_sample.append({"index": i, "depth": round(d, 4), "rows": len(rows), "layers": probe_sample(
                model, ids, rows, args.local, device)})  # fmt: skip
        n_layers = len(per_sample[0]["layers"])
        layers = [
            {
                k: sum(p["layers"][li][k] for p in per_sample) / len(per_sample)
                for k in per_sample[0]["layers"][li]
            }
            for li in range(n_layers)
        ]
        res["lengths"][str(L)] = {
            "samples": per_sample,
            "layers": layers,
            "seconds": round(time.time() - t0, 1),
        }
        print(f"needle_context: {L} done in {time.time() - t0:.0f}s", file=sys.stderr)
    md = table(res)
    write_json_md(args.out, "needle-context", res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
