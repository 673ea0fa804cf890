"""Does the DSA indexer select the needle? Per-layer needle recall of a trained checkpoint (issue 10).

For held-out RULER niah_single prompts (bytes, as training formats them) ending with the answer's
leading space, the last position is the query that must produce the value's first digit. This runs
the training forward (`TrainCausalLM`, the engine's math and top-k) once sparse and once dense and
reports, per layer, how often the value's first digit is among that query's selected positions
("recall"; shared layers reuse their full layer's selection) and what fraction of the value's bytes are, and how often the predicted next byte
is that digit with sparse and with dense attention. Dense right and sparse wrong means the
selection, not the model, lost the needle. CPU or GPU; a few seconds a prompt on the CPU at 1K.

    python -m bench.indexer_recall [--model models-shipped/retrieval-wip] [--lengths 768,1024]
        [--samples 12] [--no-dense] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("niah_single_1", "niah_single_2")


def needle_recall(
    model: Any, ids: list[int], pos: int, n: int, dense: bool = True
) -> tuple[list[bool], list[float], int, int | None]:
    """(per layer: is `pos` in the last query's selection, the fraction of [pos, pos + n) in it;
    sparse next byte; dense next byte, None with dense=False: the dense pass is O(S^2))."""
    from longctx.train.model import selection_mask

    masks: list[torch.Tensor | None] = []  # each layer's selection [B, S, top-k] (None: dense)
    attention = model._attention

    def capture(*a: Any, **kw: Any) -> Any:
        out = attention(*a, **kw)
        masks.append(out[1])
        return out

    x = torch.tensor([ids], device=next(model.parameters()).device)
    model._attention = capture
    try:
        with torch.no_grad():
            h, _ = model.forward_train(x, sparse=True)
            sparse_next = int(model.logits(h)[0, -1].argmax())
    finally:
        del model._attention  # the instance attribute shadowed the method
    dense_next = None
    if dense:
        with torch.no_grad():
            h, _ = model.forward_train(x, sparse=False)
            dense_next = int(model.logits(h)[0, -1].argmax())
    # a layer with no selection (top-k >= the prompt) attends to every causal key
    last = [None if m is None else selection_mask(m[0, -1], len(ids)) for m in masks]
    first = [True if m is None else bool(m[pos]) for m in last]
    span = [1.0 if m is None else float(m[pos : pos + n].float().mean()) for m in last]
    return first, span, sparse_next, dense_next


def run(model_dir: Path, lengths: list[int], samples: int, device: str, dense: bool = True) -> dict[str, Any]:
    from longctx.config import ModelConfig
    from longctx.train.checkpoint import load_model_weights
    from longctx.train.evaluate import EVAL_SEED
    from longctx.train.model import TrainCausalLM
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import ByteCounter

    dev = torch.device(device)
    cfg = ModelConfig.from_json(model_dir)
    model = TrainCausalLM(cfg)
    load_model_weights(model, model_dir, dev)
    model.to(dev).eval()
    gen = RulerGenerator(ByteCounter(), seed=EVAL_SEED + 1, max_new_tokens_scale=0.5)
    out: dict[str, Any] = {"model": str(model_dir), "index_topk": cfg.index_topk, "lengths": {}}
    for L in lengths:
        n, sparse_ok, dense_ok = 0, 0, 0
        layer_hits = [0] * cfg.num_hidden_layers
        layer_span = [0.0] * cfg.num_hidden_layers
        for task in TASKS:
            for i in range(samples):
                s = gen.sample(task, L, i)
                prompt = (s.input + s.answer_prefix + " ").encode("utf-8")
                value = s.outputs[0].encode("utf-8")
                pos = prompt.find(value)
                assert pos >= 0, "the needle's value is in its prompt"
                rec, span, sp, dn = needle_recall(model, list(prompt), pos, len(value), dense)
                n += 1
                sparse_ok += sp == prompt[pos]
                dense_ok += dn == prompt[pos]
                print(f"indexer_recall: {L} {task} #{i}: layers {rec}, next byte {sp == prompt[pos]}",
                      file=sys.stderr, flush=True)  # fmt: skip
                layer_hits = [a + b for a, b in zip(layer_hits, rec)]
                layer_span = [a + b for a, b in zip(layer_span, span)]
        out["lengths"][L] = {
            "prompts": n,
            "first_digit_sparse": sparse_ok / n,
            "first_digit_dense": dense_ok / n if dense else None,
            "recall_per_layer": [h / n for h in layer_hits],
            "value_span_recall_per_layer": [h / n for h in layer_span],
        }
    return out


def table(res: dict[str, Any]) -> str:
    rows = [
        f"Needle recall of `{res['model']}` (top-{res['index_topk']}): the value's first digit among the "
        "answer query's selected positions, per layer; first digit predicted with sparse / dense attention.",
        "",
        "| length | prompts | first digit sparse | first digit dense | recall per layer | value bytes selected per layer |",
        "|---|---|---|---|---|---|",
    ]
    for L, r in res["lengths"].items():
        per = " / ".join(f"{x:.2f}" for x in r["recall_per_layer"])
        span = " / ".join(f"{x:.2f}" for x in r["value_span_recall_per_layer"])
        rows.append(
            f"| {L} | {r['prompts']} | {r['first_digit_sparse']:.2f} | "
            f"{'-' if r['first_digit_dense'] is None else format(r['first_digit_dense'], '.2f')} | {per} | {span} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models-shipped" / "retrieval-wip")
    ap.add_argument("--lengths", default="768,1024")
    ap.add_argument("--samples", type=int, default=12, help="prompts per task and length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--no-dense", action="store_true", help="skip the dense pass (O(S^2): hours at 32K on a CPU)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    res = run(
        args.model, [int(x) for x in args.lengths.split(",")], args.samples, args.device, not args.no_dense
    )
    res["command"] = "python -m bench.indexer_recall " + " ".join(sys.argv[1:] if argv is None else argv)
    md = table(res)
    print(md)
    if args.out is not None:
        from bench.common import write_json_md

        write_json_md(args.out, "indexer-recall", res, md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
