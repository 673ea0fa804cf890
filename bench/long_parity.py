"""Does the engine compute what the model computes at a long context? (issue 10: the prose at 1M)

At 1M the shipped retrieval model's full layers select the needle, yet its answer continues the
haystack from the first byte; on the CPU the same model at 16K keeps writing answer-shaped digits even
when its indexers select nothing of the question (`--index-topk 4`). So the engine's 1M path is suspect
until shown equal to an independent computation of the same model. This takes one RULER niah prompt per
length (`bench.retrieval_eval`'s generator, seed and output budget, raw prompt) and compares the last
prompt row's next-byte distribution three ways:

- `engine`: `longctx.Engine` as served (bf16 and fp8 KV on CUDA, fp32 on a CPU), chunked paged prefill;
- `engine_bf16kv` (CUDA only): the same with `kv_dtype="bf16"` (no fp8 quantisation of the caches);
- `train`: the training forward (`TrainCausalLM.forward_train`, sparse, the same weights): dense
  tensors, no pages, no chunks, the selection by the fused indexer + top-k over an fp32 key pool on
  CUDA (the chunked torch selection on a CPU), bf16 autocast on CUDA as in training.

For each: the top 5 bytes, the logprob of the answer's first byte (a space), and the relative
difference of its logits from `train`'s (max |a - b| / max |b|).

    python -m bench.long_parity --model DIR --lengths 128k,1m [--task niah_single_1] [--index 0]
        [--index-topk K] [--index-local-window W] [--device cuda] --out R

With a needle to find it also reports, for the training forward's last prompt row, each full layer's
main attention share on the needle's value and on the question (the prompt's last 64 positions), over
the selection and over every key: that row writes the answer's first byte, and it reads the question,
not the needle (run 17 on a CPU at 4K-16K: layers 1 / 3 put 0.39-0.74 of their attention on the question,
~0 on the needle).

Writes R/long-parity.json and R/long-parity.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the prompt's last positions counted as the question: needle_recall's `local` column's
from bench.needle_recall import LOCAL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOP = 5


def describe(logits: torch.Tensor, want: int, decode: Any, ref: torch.Tensor | None) -> dict[str, Any]:
    """A last-row logits vector [V] -> its top bytes, the wanted byte's logprob and (given `ref`) the
    relative difference from it."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(TOP)
    out: dict[str, Any] = {
        "top": [[decode([int(t)]), round(float(v), 4)] for v, t in zip(top.values, top.indices)],
        "want_logprob": round(float(lp[want]), 4),
    }
    if ref is not None:
        out["rel_diff"] = float((logits.float() - ref).abs().max() / ref.abs().max())
    return out


def attention_mass(
    scores: torch.Tensor, selected: torch.Tensor, needle: list[int], local: int = LOCAL
) -> dict[str, float]:
    """One query row's main attention (unscaled-to-scaled logits [H, S] over every causal key, `selected`
    the top-k positions, -1 pads) -> the share of it, averaged over heads, on the needle's positions and
    on the last `local` positions: over the selection (what the sparse model attends) and over every key
    (the dense model, the indexer KL's teacher)."""
    S = scores.shape[-1]
    sel = torch.zeros(S, dtype=torch.bool, device=scores.device)
    sel[selected[selected >= 0].long()] = True
    at = torch.zeros(S, dtype=torch.bool, device=scores.device)
    at[torch.tensor(needle, dtype=torch.long, device=scores.device)] = True
    near = torch.arange(S, device=scores.device) >= S - local
    out: dict[str, float] = {}
    for name, allowed in (("sel", sel), ("dense", torch.ones_like(sel))):
        p = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), -1).mean(0)
        out[f"needle_{name}"] = round(float(p[at].sum()), 4)
        out[f"local_{name}"] = round(float(p[near].sum()), 4)
    return out


def question_row(
    qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, topk: int, window: int, keep: bool
) -> torch.Tensor:
    """The last query row's selection [B, topk] (ascending, -1 pads) with the prompt's last `window`
    positions before it all in (`keep`: the window, then the top of the rest by index score) or all out
    (the top-k of the rest; the row's own position stays a candidate either way)."""
    B, S = ki.shape[:2]
    lg = (torch.relu(torch.einsum("bhd,bsd->bhs", qi[:, -1].float(), ki.float())) * wi[:, -1, :, None]).sum(1)
    lo = max(0, S - 1 - window)
    lg[:, lo : S - 1] = float("-inf")
    if keep:  # the window's latest positions if it is wider than the top-k
        win = torch.arange(S - 1 - min(S - 1 - lo, topk), S - 1, device=ki.device).expand(B, -1)
        rest = lg.topk(min(topk - win.shape[1], S - (S - 1 - lo)), dim=-1).indices
        pos = torch.cat([win, rest], -1)
    else:
        pos = lg.topk(min(topk, S - (S - 1 - lo)), dim=-1).indices
    out = torch.full((B, topk), -1, dtype=torch.long, device=ki.device)
    out[:, : pos.shape[1]] = pos.sort(-1).values
    return out


def train_last_logits(
    model_dir: str,
    ids: list[int],
    device: torch.device,
    needle: list[int] | None = None,
    topk: int | None = None,
    question: tuple[int, bool] | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, dict[str, dict[str, float]]]:
    """The training forward's logits at the last of `ids` (fp32 [V]) and, per full layer (one with an
    indexer), `attention_mass` of its last row given the needle's positions (none without them);
    `topk`: the selection's size (None: each indexer's own); `question` = (W, keep): every full layer's
    last-row selection made by `question_row` (the question's last W positions forced in or kept out);
    `window`: the model's index_local_window instead of its config's."""
    from longctx.config import ModelConfig
    from longctx.train.checkpoint import load_model_weights
    from longctx.train.model import TrainCausalLM

    cfg = ModelConfig.from_json(model_dir)
    m = TrainCausalLM(cfg if window is None else dataclasses.replace(cfg, index_local_window=window))
    load_model_weights(m, model_dir, torch.device("cpu"))
    m.sparse_attention = "gather"
    m.select_form = "fused" if device.type == "cuda" else "torch"
    m.to(device).eval()
    layers = zip(m.layer_range, m.model.layers.values())
    full = [str(i) for i, lay in layers if getattr(lay.self_attn, "indexer", None) is not None]
    masses: dict[str, dict[str, float]] = {}
    kl = m._indexer_kl

    def read_rows(qi, ki, wi, main_scores, sel, rows, scale, *rest):  # type: ignore[no-untyped-def]
        # the last row's main attention logits [H, S] and its selection, at each full layer in turn
        bi = torch.arange(rows.shape[0], device=rows.device)[:, None]
        sc = main_scores(bi, rows)[0, :, 0] * scale
        S = sc.shape[-1]
        chosen = sel[0, S - 1] if sel is not None else torch.arange(S, device=sc.device)
        masses[full[len(masses)]] = attention_mass(sc, chosen, needle or [])
        return kl(qi, ki, wi, main_scores, sel, rows, scale, *rest)

    x = torch.tensor([ids], device=device)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    rows = torch.tensor([[len(ids) - 1]], device=device) if needle else None
    if needle:
        m._indexer_kl = read_rows  # type: ignore[method-assign]
    if question is not None:
        select = m._selection

        def last_row_question(qi, ki, wi, k):  # type: ignore[no-untyped-def]
            sel = select(qi, ki, wi, k).clone()
            sel[:, -1] = question_row(qi, ki, wi, k, *question).to(sel.dtype)
            return sel

        m._selection = last_row_question  # type: ignore[method-assign]
    with torch.no_grad(), amp:
        h, _ = m.forward_train(x, sparse=True, kl_rows=rows, topk=topk)
        out = m.logits(h[:, -1:])[0, -1].float().cpu()
    del m, h
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, masses


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| length | form | top 5 next bytes (logprob) | logprob of the answer's space | rel. diff from train | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for form, v in r["forms"].items():
            top = ", ".join(f"{b!r} {p:.2f}" for b, p in v["top"])
            rel = f"{v['rel_diff']:.2e}" if "rel_diff" in v else "-"
            lines.append(
                f"| {r['length_name']} | {form} | {top} | {v['want_logprob']:.3f} | {rel} | {v['seconds']:.0f} |"
            )
    if any(r.get("attention") for r in rows):
        lines += [
            "",
            "The training forward's last prompt row, each full layer's main attention (mean over heads): its",
            f"share on the needle's value and on the prompt's last {LOCAL} positions (the question), over the",
            "selection the sparse model attends and over every causal key (the dense model).",
            "",
            "| length | layer | needle, selection | question, selection | needle, every key | question, every key |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            for layer, a in r.get("attention", {}).items():
                lines.append(
                    f"| {r['length_name']} | {layer} | {a['needle_sel']:.3f} | {a['local_sel']:.3f} | "
                    f"{a['needle_dense']:.3f} | {a['local_dense']:.3f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models-shipped" / "retrieval-wip"))
    ap.add_argument("--lengths", default="128k,1m")
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument(
        "--index-topk",
        type=int,
        default=None,
        help="every form selects this top-k (default: the model's own)",
    )
    ap.add_argument(
        "--index-local-window",
        type=int,
        default=None,
        metavar="W",
        help="every form keeps each query's newest W positions in its selection (default: the model's)",
    )
    ap.add_argument(
        "--with-question",
        type=int,
        default=0,
        metavar="W",
        help="also the training forward with every full layer's last-row selection holding the prompt's "
        "last W positions (form train+q)",
    )
    ap.add_argument(
        "--without-question",
        type=int,
        default=0,
        metavar="W",
        help="also the training forward with the prompt's last W positions kept out of that selection "
        "(form train-q)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--forms", default="engine,engine_bf16kv,train", help="of engine, engine_bf16kv (CUDA only), train"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from bench.common import write_json_md
    from bench.needle_recall import MAX_NEW_TOKENS_SCALE, SEED, SPACE, check_trained_model, needle_positions
    from longctx import Engine
    from longctx.errors import LongctxError
    from longctx.train.loop import resolve_device
    from longctx.workloads.ruler_cli import parse_lengths
    from longctx.workloads.ruler_runner import format_length
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    try:
        lengths = parse_lengths(args.lengths)
        wanted = [f for f in args.forms.split(",") if f]
        if (
            "train" not in wanted
            or not set(wanted) <= {"engine", "engine_bf16kv", "train"}
            or len(wanted) < 2
        ):
            raise LongctxError(f"--forms {args.forms}: train and at least one of engine, engine_bf16kv")
        if not args.task.startswith("niah_"):
            raise LongctxError(f"--task {args.task}: a niah task (its answer starts with a space)")
        if args.index < 0:
            raise LongctxError("--index must be >= 0")
        if args.index_topk is not None and args.index_topk < 1:
            raise LongctxError("--index-topk must be >= 1")
        if args.with_question < 0 or args.without_question < 0:
            raise LongctxError("--with-question / --without-question must be >= 0")
        check_trained_model(args.model)
        device = resolve_device(args.device)
    except LongctxError as e:
        print(f"long_parity: {e}", file=sys.stderr)
        return 2
    os.environ["LONGCTX_CUDA_GRAPHS"] = "0"  # one prefill: nothing to replay
    args.out.mkdir(parents=True, exist_ok=True)
    gen = RulerGenerator(load_counter(args.model), seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE)
    forms: dict[str, dict[str, Any]] = {}
    if "engine" in wanted:
        forms["engine"] = {}
    if "engine_bf16kv" in wanted and device.type == "cuda":  # (on a CPU the engine form is fp32 already)
        forms["engine_bf16kv"] = {"kv_dtype": "bf16"}
    if not forms:
        print("long_parity: engine_bf16kv runs on CUDA only; add engine", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for L in lengths:
        s = gen.sample(args.task, L, args.index)
        got: dict[str, torch.Tensor] = {}
        secs: dict[str, float] = {}
        ids: list[int] = []
        value_ids: list[int] = []
        decode: Any = str
        for form, kw in forms.items():
            t = time.perf_counter()
            with Engine(
                args.model,
                device=str(device),
                max_context=L,
                cuda_graphs=False,
                index_topk=args.index_topk,
                index_local_window=args.index_local_window,
                **kw,
            ) as eng:
                ids = eng.encode(s.input + s.answer_prefix)
                value_ids = eng.encode(s.outputs[0])
                got[form] = eng.score(ids)[-1].float().cpu()
                decode = eng.tokenizer.decode
            secs[form] = time.perf_counter() - t
            # each form as it comes (a bounded run that stops in a later form still says this one's)
            print(f"long_parity: {format_length(L)} {form}: {describe(got[form], SPACE, decode, None)} "
                  f"({secs[form]:.0f} s)", flush=True)  # fmt: skip
        t = time.perf_counter()
        ref, masses = train_last_logits(
            args.model, ids, device, needle_positions(ids, value_ids), topk=args.index_topk,
            window=args.index_local_window,
        )  # fmt: skip
        secs["train"] = time.perf_counter() - t
        out_forms = {
            f: {**describe(v, SPACE, decode, ref), "seconds": round(secs[f], 1)} for f, v in got.items()
        }
        out_forms["train"] = {**describe(ref, SPACE, decode, None), "seconds": round(secs["train"], 1)}
        for name, w, keep in (
            ("train+q", args.with_question, True),
            ("train-q", args.without_question, False),
        ):
            if w:
                t = time.perf_counter()
                got_q, _ = train_last_logits(
                    args.model, ids, device, topk=args.index_topk, question=(w, keep),
                    window=args.index_local_window,
                )  # fmt: skip
                out_forms[name] = {
                    **describe(got_q, SPACE, decode, ref), "question_window": w,
                    "seconds": round(time.perf_counter() - t, 1),
                }  # fmt: skip
        row = {
            "length": L, "length_name": format_length(L), "prompt_tokens": len(ids), "forms": out_forms,
            "attention": masses,
        }  # fmt: skip
        rows.append(row)
        print(f"long_parity: {row['length_name']}: " + "; ".join(
            f"{f} top {v['top'][0][0]!r} space {v['want_logprob']:.2f}" for f, v in out_forms.items()
        ), flush=True)  # fmt: skip
    res = {
        "model": args.model,
        "task": args.task,
        "index": args.index,
        "index_topk": args.index_topk,
        "index_local_window": args.index_local_window,
        "device": str(device),
        "command": "python -m bench.long_parity " + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": rows,
    }
    write_json_md(args.out, "long-parity", res, table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
