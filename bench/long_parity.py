"""Does the engine compute what the model computes at a long context? (issue 10: the prose at 1M)

At 1M the shipped retrieval model's full layers select the needle, yet its answer continues the
haystack from the first byte; on the CPU the same model at 16K keeps writing answer-shaped digits even
when its indexers select nothing of the question (`--index-topk 4`). So the engine's 1M path is suspect
until shown equal to an independent computation of the same model. This takes one RULER niah prompt per
length (`bench.retrieval_eval`'s generator, seed and output budget, raw prompt) and compares the last
prompt row's next-byte distribution three ways:

- `engine`: `longctx.Engine` as served (bf16 and fp8 KV on CUDA, fp32 on a CPU), chunked paged prefill;
- `engine_bf16kv` (CUDA only): the same with `kv_dtype="bf16"` (no fp8 quantisation of the caches);
- `engine_fp8kv`: the same with `kv_dtype="fp8_e4m3"` (CUDA's default; on a CPU it isolates what the fp8
  caches change, the rest computed in fp32);
- `train`: the training forward (`TrainCausalLM.forward_train`, sparse, the same weights): dense
  tensors, no pages, no chunks, the selection by the fused indexer + top-k over an fp32 key pool on
  CUDA (the chunked torch selection on a CPU), bf16 autocast on CUDA as in training.

For each: the top 5 bytes, the logprob of the answer's first byte (a space), and the relative
difference of its logits from `train`'s (max |a - b| / max |b|).

`--answer-row` also compares the next row, the answer's space (every form scores the prompt and that
space): the distribution of the answer's first value byte. There the engine's prefill row (`engine`) and
the training forward are joined by the engine's own decode step (`engine_decode`: greedy from the prompt,
whose first token is the space, then the step after it, top 5 logprobs only, compared with the training
forward's logprobs of the same bytes), and the attention table describes that row: a 1M answer that starts
with the space and then goes wrong is either the model's (all three agree) or the decode path's.

    python -m bench.long_parity --model DIR --lengths 128k,1m [--task niah_single_1] [--index 0]
        [--index-topk K] [--index-local-window W] [--index-topk-long K --index-topk-long-from P]
        [--answer-row] [--device cuda] --out R

With a needle to find it also reports, for the training forward's last prompt row (the answer's space row
under `--answer-row`), every layer's main attention share on the needle's value and on the question (the
prompt's last 64 positions), over the selection and over every key. Run 17 on a CPU at 4K-16K: at the last
prompt row, which writes the space, full layers 1 / 3 put 0.39-0.74 of their attention on the question and
~0 on the needle. The IndexShare layers (2, 4, 5: the selection of the full layer before them, their own
attention) are in the table too, since the row that writes the first value byte may read the needle there.

Writes R/long-parity.json and R/long-parity.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the prompt's last positions counted as the question: needle_recall's `local` column's
from bench.needle_recall import LOCAL, SPACE  # noqa: E402
from longctx.engine.args import add_selection_args, selection_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOP = 5


# the engine's forms: Engine keywords beyond the model's (each compared with the training forward)
ENGINE_FORMS: dict[str, dict[str, Any]] = {
    "engine": {},
    "engine_bf16kv": {"kv_dtype": "bf16"},
    "engine_fp8kv": {"kv_dtype": "fp8_e4m3"},
}


def describe_top(
    top: Sequence[tuple[int, float]], want: int, decode: Any, ref: torch.Tensor | None
) -> dict[str, Any]:
    """An engine step's top logprobs [(token, logprob)] -> `describe`'s keys, the wanted byte's logprob
    None when it is not among them; `ref` (logits [V]): `logprob_diff`, the largest |difference| from its
    logprobs of the same bytes (the relative logits difference needs every logit)."""
    got = dict(top)
    out: dict[str, Any] = {
        "top": [[decode([int(t)]), round(float(v), 4)] for t, v in top[:TOP]],
        "want_logprob": None if want not in got else round(float(got[want]), 4),
    }
    if ref is not None:
        lp = torch.log_softmax(ref.float(), -1)
        out["logprob_diff"] = max(abs(float(v) - float(lp[int(t)])) for t, v in top)
    return out


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


def train_model(model_dir: str, device: torch.device, overrides: dict[str, Any] | None = None) -> Any:
    """The checkpoint's `TrainCausalLM` as these benches run its training forward: gathered sparse
    attention, the fused selection on CUDA (the chunked one on a CPU), eval mode, on `device`; `overrides`:
    the selection's fields (SELECTION_FIELDS) instead of the config's, as the engine takes them
    (`longctx.config.with_selection`; None: the config's)."""
    from longctx.config import ModelConfig, with_selection
    from longctx.train.checkpoint import load_model_weights
    from longctx.train.model import TrainCausalLM

    m = TrainCausalLM(with_selection(ModelConfig.from_json(model_dir), **(overrides or {})))
    load_model_weights(m, model_dir, torch.device("cpu"))
    m.sparse_attention = "gather"
    m.select_form = "fused" if device.type == "cuda" else "torch"
    return m.to(device).eval()


def train_autocast(device: torch.device) -> Any:
    """bf16 autocast on CUDA, as the model trained; nothing on a CPU (fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_last_logits(
    model_dir: str,
    ids: list[int],
    device: torch.device,
    needle: list[int] | None = None,
    topk: int | None = None,
    question: tuple[int, bool] | None = None,
    overrides: dict[str, Any] | None = None,
    tail: int = 1,
) -> tuple[torch.Tensor, dict[str, dict[str, float]]]:
    """The training forward's logits at the last `tail` of `ids` (fp32 [tail, V]) and, per layer (full or
    IndexShare), `attention_mass` of its last row given the needle's positions (none without them);
    `topk`: the selection's size (None: each indexer's own); `question` = (W, keep): every full layer's
    last-row selection made by `question_row` (the question's last W positions forced in or kept out);
    `overrides`: `train_model`'s."""
    m = train_model(model_dir, device, overrides)
    names = [str(i) for i in m.layer_range]
    masses: dict[str, dict[str, float]] = {}

    def read_row(main_scores, sel, scale):  # type: ignore[no-untyped-def]
        # the last row's main attention logits [H, S] and its selection, at every layer in turn
        sc = main_scores(torch.zeros(1, 1, dtype=torch.long, device=device), last)[0, :, 0] * scale
        S = sc.shape[-1]
        chosen = sel[0, S - 1] if sel is not None else torch.arange(S, device=sc.device)
        masses[names[len(masses)]] = attention_mass(sc, chosen, needle or [])

    x = torch.tensor([ids], device=device)
    last = torch.tensor([[len(ids) - 1]], device=device)
    if needle:
        m.attention_probe = read_row
    if question is not None:
        select = m._selection

        def last_row_question(qi, ki, wi, k):  # type: ignore[no-untyped-def]
            sel = select(qi, ki, wi, k).clone()
            sel[:, -1] = question_row(qi, ki, wi, k, *question).to(sel.dtype)
            return sel

        m._selection = last_row_question  # type: ignore[method-assign]
    with torch.no_grad(), train_autocast(device):
        h, _ = m.forward_train(x, sparse=True, topk=topk)
        out = m.logits(h[:, -tail:])[0].float().cpu()
    del m, h
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, masses


def answer_row(
    got: dict[str, torch.Tensor],
    decoded: dict[str, tuple[list[int], list[Any]]],
    ref: torch.Tensor,
    want: int,
    decode: Any,
) -> dict[str, Any]:
    """The answer's space row, each form against the training forward's `ref` ([V]): the engine's prefill
    rows (`got`), its decode steps after writing the space (`decoded`: greedy tokens and their logprobs;
    a form whose first token was not the space has only a note), and train itself."""
    forms: dict[str, Any] = {f: describe(v, want, decode, ref) for f, v in got.items()}
    for f, (out, lps) in decoded.items():
        if len(out) >= 2 and len(lps) >= 2 and out[0] == SPACE:
            forms[f"{f}_decode"] = describe_top(lps[1].top, want, decode, ref)
        else:
            forms[f"{f}_decode"] = {"note": f"wrote {decode(out[:1])!r} first, not the space"}
    forms["train"] = describe(ref, want, decode, None)
    return {"want": decode([want]), "forms": forms}


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
    if any(r.get("answer_row") for r in rows):
        lines += [
            "",
            "The next row, the answer's space (`--answer-row`): the answer's first value byte. `engine_decode` is",
            "the engine's decode step after it wrote the space (its top 5 logprobs; the difference column is the",
            "largest logprob difference from train's over those bytes).",
            "",
            "| length | form | top 5 next bytes (logprob) | wanted byte | its logprob | diff from train |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            a = r.get("answer_row") or {"forms": {}}
            for form, v in a["forms"].items():
                if "top" not in v:
                    lines.append(f"| {r['length_name']} | {form} | {v['note']} | {a['want']!r} | - | - |")
                    continue
                top = ", ".join(f"{b!r} {p:.2f}" for b, p in v["top"])
                lp = "-" if v["want_logprob"] is None else f"{v['want_logprob']:.3f}"
                diff = (
                    f"{v['rel_diff']:.2e} (rel.)" if "rel_diff" in v
                    else f"{v['logprob_diff']:.3f} (logprob)" if "logprob_diff" in v else "-"
                )  # fmt: skip
                lines.append(f"| {r['length_name']} | {form} | {top} | {a['want']!r} | {lp} | {diff} |")
    if any(r.get("attention") for r in rows):
        which = {r.get("attention_row", "last prompt row") for r in rows if r.get("attention")}
        lines += [
            "",
            f"The training forward's {' / '.join(sorted(which))}, each layer's main attention (mean over heads): its",
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
    add_selection_args(ap)  # (every form: the engine's and the training forward's)
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
    ap.add_argument(
        "--answer-row",
        action="store_true",
        help="also the row after the answer's space (its first value byte), with the engine's decode step",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--forms",
        default="engine,engine_bf16kv,train",
        help="of engine, engine_bf16kv (CUDA only), engine_fp8kv, train",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from bench.common import write_json_md
    from bench.needle_recall import (
        MAX_NEW_TOKENS_SCALE,
        SEED,
        check_trained_model,
        greedy_with_logprobs,
        needle_positions,
    )
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
        if "train" not in wanted or not set(wanted) <= {"train", *ENGINE_FORMS} or len(wanted) < 2:
            raise LongctxError(f"--forms {args.forms}: train and at least one of {', '.join(ENGINE_FORMS)}")
        if not args.task.startswith("niah_"):
            raise LongctxError(f"--task {args.task}: a niah task (its answer starts with a space)")
        if args.index < 0:
            raise LongctxError("--index must be >= 0")
        if args.with_question < 0 or args.without_question < 0:
            raise LongctxError("--with-question / --without-question must be >= 0")
        if args.answer_row and (args.with_question or args.without_question):
            raise LongctxError("--answer-row: without --with-question / --without-question (last-row forms)")
        check_trained_model(args.model, args)
        device = resolve_device(args.device)
    except LongctxError as e:
        print(f"long_parity: {e}", file=sys.stderr)
        return 2
    os.environ["LONGCTX_CUDA_GRAPHS"] = "0"  # one prefill: nothing to replay
    args.out.mkdir(parents=True, exist_ok=True)
    gen = RulerGenerator(load_counter(args.model), seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE)
    forms: dict[str, dict[str, Any]] = {}
    for form, kw in ENGINE_FORMS.items():
        if form in wanted and (form != "engine_bf16kv" or device.type == "cuda"):
            forms[form] = kw  # (engine_bf16kv: on a CPU the engine form is fp32 already)
    if not forms:
        print("long_parity: engine_bf16kv runs on CUDA only; add engine", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    tail = 2 if args.answer_row else 1  # the last prompt row (and the answer's space's)
    # the training forward selects as the engine forms: their top-k, window and narrowing
    train_overrides = selection_kwargs(args)
    for L in lengths:
        s = gen.sample(args.task, L, args.index)
        got: dict[str, torch.Tensor] = {}
        got_answer: dict[str, torch.Tensor] = {}
        decoded: dict[str, tuple[list[int], list[Any]]] = {}
        secs: dict[str, float] = {}
        ids: list[int] = []
        full: list[int] = []
        value_ids: list[int] = []
        decode: Any = str
        for form, kw in forms.items():
            t = time.perf_counter()
            with Engine(
                args.model,
                device=str(device),
                max_context=L,
                cuda_graphs=False,
                **selection_kwargs(args),
                **kw,
            ) as eng:
                ids = eng.encode(s.input + s.answer_prefix)
                full = ids + [SPACE] * (tail - 1)  # (with --answer-row, the answer's space too)
                value_ids = eng.encode(s.outputs[0])
                scored = eng.score(full)[-tail:].float().cpu()
                got[form] = scored[0]
                if args.answer_row:  # the same row by the decode path: greedy from the prompt
                    got_answer[form] = scored[1]
                    decoded[form] = greedy_with_logprobs(eng, f"decode-{form}", ids, 2)
                decode = eng.tokenizer.decode
            secs[form] = time.perf_counter() - t
            # each form as it comes (a bounded run that stops in a later form still says this one's)
            print(f"long_parity: {format_length(L)} {form}: {describe(got[form], SPACE, decode, None)} "
                  f"({secs[form]:.0f} s)", flush=True)  # fmt: skip
        t = time.perf_counter()
        ref_rows, masses = train_last_logits(
            args.model, full, device, needle_positions(full, value_ids), topk=args.index_topk,
            overrides=train_overrides, tail=tail,
        )  # fmt: skip
        ref = ref_rows[0]
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
                    overrides=train_overrides,
                )  # fmt: skip
                out_forms[name] = {
                    **describe(got_q[-1], SPACE, decode, ref), "question_window": w,
                    "seconds": round(time.perf_counter() - t, 1),
                }  # fmt: skip
        row = {
            "length": L, "length_name": format_length(L), "prompt_tokens": len(ids), "forms": out_forms,
            "attention": masses, "attention_row": "answer's space row" if args.answer_row else "last prompt row",
        }  # fmt: skip
        if args.answer_row:
            row["answer_row"] = answer_row(got_answer, decoded, ref_rows[-1], value_ids[0], decode)
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
        "index_topk_long": args.index_topk_long,
        "index_topk_long_from": args.index_topk_long_from,
        "device": str(device),
        "command": "python -m bench.long_parity " + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": rows,
    }
    write_json_md(args.out, "long-parity", res, table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
