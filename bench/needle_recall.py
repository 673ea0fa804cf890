"""Where a long retrieval fails: the needle in each indexer's top-k, sample by sample (issue 10).

A niah sample answered wrong at 128K either never reached attention (no full layer's indexer put the
needle's value among the positions the answer's queries attend to) or reached it and was not used
(the needle selected, the answer still wrong). This runs RULER niah samples (the same generator,
seed and output budget as `bench.retrieval_eval`, raw prompts) through the engine eagerly, records
every full layer's top-k for the rows that produce the answer (the last prompt token and the decode
steps after it; shared layers use their full layer's), and reports per layer the fraction of the
value's token positions that were selected, split by whether the sample was answered right, and at
the step that wrote the value's first token the rank of the wanted token among the top 5 (the wrong
answers' ranks are counted in the summary).

    python -m bench.needle_recall --model DIR --lengths 32k,128k --samples 10 [--device cuda] --out R

`--force-layers 0,1,3` (CPU): what if those full layers' indexers had found the needle? Every query
row from the last prompt token on gets the value's missing positions into those layers' selections
(each in place of the lowest-scored selected position outside the local window), so a sample still
wrong is a copy the attention got wrong, not a selection (run 23 at 4K niah_single_3: 6 of 20 right,
14 forced into layers 0, 1 and 3, 13 into layer 3 alone, 6 into layers 0 and 1).

Writes R/needle-recall.jsonl (one row per sample, resumable) and R/needle-recall.json (the summary).
CUDA graphs are off here (a replayed graph runs no Python, so nothing could be recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.engine.args import add_selection_args, selection_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = "niah_single_1,niah_single_2"
SEED = 42  # bench.retrieval_eval's (longctx ruler's default)
MAX_NEW_TOKENS_SCALE = 0.5  # bench.retrieval_eval's for raw prompts


def find_all(ids: Sequence[int], sub: Sequence[int]) -> list[int]:
    """Start offsets of every occurrence of `sub` in `ids`."""
    n = len(sub)
    if n == 0:
        return []
    first = sub[0]
    return [i for i in range(len(ids) - n + 1) if ids[i] == first and list(ids[i : i + n]) == list(sub)]


def needle_positions(ids: Sequence[int], value_ids: Sequence[int]) -> list[int]:
    """The token positions of every occurrence of the answer's tokens in the prompt."""
    n = len(value_ids)
    return sorted({s + j for s in find_all(ids, value_ids) for j in range(n)})


@contextmanager
def record_selections(start: int) -> Iterator[dict[int, list[tuple[int, list[int]]]]]:
    """While entered: each full layer's top-k rows for query positions >= `start` (batch of one
    request), as {layer: [(position, [selected positions]), ...]} in the order they ran."""
    from longctx.model.indexer import Indexer

    rows: dict[int, list[tuple[int, list[int]]]] = {}
    forward = Indexer.forward

    def recorded(self, x, q_resid, ctx, x_proj=None):  # type: ignore[no-untyped-def]
        out = forward(self, x, q_resid, ctx, x_proj)
        pos = ctx.positions.tolist()
        for r, p in enumerate(pos):
            if p >= start:
                rows.setdefault(self.layer, []).append((p, [t for t in out[r].tolist() if t >= 0]))
        return out

    Indexer.forward = recorded  # type: ignore[method-assign]
    try:
        yield rows
    finally:
        Indexer.forward = forward  # type: ignore[method-assign]


@contextmanager
def forced_needle(layers: set[int], needle: Sequence[int], start: int) -> Iterator[dict[str, int]]:
    """While entered: the full layers in `layers` select every position of `needle` at each query
    position >= `start` (batch of one request, the torch path, whose top-k op sees the index scores):
    each missing position takes the place of the lowest-scored selected one outside the local window
    (ties: the later position goes). Yields the counts of rows forced and positions put in."""
    import longctx.model.indexer as ix
    from longctx.errors import LongctxError

    want = sorted(set(needle))
    want_set = set(want)
    counts = {"rows": 0, "replaced": 0}
    seen: dict[str, Any] = {}
    op, forward = ix.op, ix.Indexer.forward

    def spied_op(module, name, use_triton):  # type: ignore[no-untyped-def]
        fn = op(module, name, use_triton)
        if name != "topk_indices":
            return fn

        def topk(logits, k, lens, *window):  # type: ignore[no-untyped-def]
            if "layer" in seen:  # (only a forced layer's scores are kept: at 128K a chunk's are GBs)
                seen["logits"] = logits
            return fn(logits, k, lens, *window)

        return topk

    def forced(self, x, q_resid, ctx, x_proj=None):  # type: ignore[no-untyped-def]
        if self.layer not in layers:
            return forward(self, x, q_resid, ctx, x_proj)
        seen["layer"] = True
        try:
            out = forward(self, x, q_resid, ctx, x_proj)
            logits = seen.get("logits")
        finally:
            seen.clear()
        if logits is None or logits.shape[0] != out.shape[0]:
            raise LongctxError("--force-layers needs the torch path's index scores (--device cpu)")
        out = out.clone()
        for r, p in enumerate(ctx.positions.tolist()):
            if p < start:
                continue
            row = [t for t in out[r].tolist() if t >= 0]
            have = set(row)
            missing = [t for t in want if t <= p and t not in have]
            if not missing:
                continue
            window = set(range(p - self.window + 1, p + 1))
            room = [t for t in row if t not in window and t not in want_set]
            room.sort(key=lambda t: (logits[r, t].item(), -t))
            if len(room) < len(missing):
                raise LongctxError(f"layer {self.layer}'s top-k has no room for the needle's {len(missing)}")
            keep = sorted(have - set(room[: len(missing)]) | set(missing))
            out[r] = torch.tensor(keep + [-1] * (out.shape[1] - len(keep)), dtype=out.dtype)
            counts["rows"] += 1
            counts["replaced"] += len(missing)
        return out

    ix.op, ix.Indexer.forward = spied_op, forced  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        ix.op, ix.Indexer.forward = op, forward  # type: ignore[method-assign]


def add_sample_args(ap: argparse.ArgumentParser, lengths: str, tasks: str, samples: int) -> None:
    """The flags of the benches that run RULER niah samples of a trained model one by one (this one,
    bench.key_binding): --model, --lengths, --tasks, --samples, --device and the selection's."""
    ap.add_argument("--model", default=str(ROOT / "models-shipped" / "retrieval-wip"))
    ap.add_argument("--lengths", default=lengths)
    ap.add_argument("--tasks", default=tasks)
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--device", default="auto")
    add_selection_args(ap)


def read_sample_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """`add_sample_args`' lengths and tasks, checked (LongctxError: one line for the caller to print)."""
    from longctx.errors import LongctxError
    from longctx.workloads.ruler_cli import parse_lengths
    from longctx.workloads.ruler_tasks import parse_tasks

    lengths = parse_lengths(args.lengths)
    tasks = parse_tasks(args.tasks)
    if args.samples < 1:
        raise LongctxError("--samples must be >= 1")
    check_trained_model(args.model, args)
    return lengths, tasks


def open_sample_bench(
    args: argparse.Namespace, name: str, argv: list[str] | None, device: torch.device
) -> tuple:
    """What the benches that probe RULER samples of a trained model one by one (bench.key_binding,
    bench.value_repeat) start from: the model's token counter, the samples' generator (bench.retrieval_eval's
    seed and output budget), the model for the training forward with the flags' selection, and the results
    dict with the model, the selection and the command line."""
    from bench.long_parity import train_model
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    counter = load_counter(args.model)
    gen = RulerGenerator(counter, seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE)
    model = train_model(args.model, device, selection_kwargs(args))
    res: dict[str, Any] = {
        "model": args.model,
        "selection": {k: v for k, v in selection_kwargs(args).items() if v is not None},
        "command": f"python -m bench.{name} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "results": {},
    }
    return counter, gen, model, res


def check_trained_model(model: str, args: Any) -> None:
    """LongctxError unless `model` has a tokenizer (the RULER prompts need the trained byte-level model)
    and the parsed flags `args` select as its config can (`bench.common.check_selection`)."""
    from bench.common import check_selection
    from longctx.errors import LongctxError

    if not (Path(model) / "tokenizer.json").exists():
        raise LongctxError(f"--model {model}: no tokenizer.json (a trained byte-level model is needed)")
    check_selection(model, args)


LOCAL = 64  # the prompt's last positions whose selection `recall_by_layer` reports


def recall_by_layer(
    rows: dict[int, list[tuple[int, list[int]]]],
    needle: Sequence[int],
    prompt_len: int,
    answer_len: int,
    letters: Sequence[int] = (),
) -> dict[str, dict[str, float]]:
    """Per full layer: `last_prompt` (the needle's share of the last prompt row's selection of it),
    `answer` (that share averaged over the rows that produce the first `answer_len` output tokens: the
    value and the space before it),
    `any` (1 when any of those rows selected any needle position), `local` (the share of the last
    `LOCAL` prompt positions, the question and the answer prefix, that the last prompt row selected: at
    1M the answers are haystack prose, as if the question went unread), and with `letters` (the needle
    positions holding a letter, e.g. a UUID's a-f) `answer_letters` / `answer_digits`: `answer` over those
    positions and over the rest (run 21's answer rows select a UUID's digits and drop its letters)."""
    want = set(needle)
    parts = {"answer_letters": set(letters), "answer_digits": want - set(letters)} if letters else {}
    near = set(range(max(0, prompt_len - LOCAL), prompt_len))
    out: dict[str, dict[str, float]] = {}
    for layer, got in sorted(rows.items()):
        answer = [sel for p, sel in got if prompt_len - 1 <= p < prompt_len - 1 + answer_len]
        last = [sel for p, sel in got if p == prompt_len - 1]
        share = [len(want & set(s)) / len(want) for s in answer]
        out[str(layer)] = {
            "last_prompt": len(want & set(last[-1])) / len(want) if last else 0.0,
            "answer": sum(share) / len(share) if share else 0.0,
            "any": float(any(v > 0 for v in share)),
            "local": len(near & set(last[-1])) / len(near) if last else 0.0,
        }
        for k, part in parts.items():
            if part and answer:
                out[str(layer)][k] = sum(len(part & set(s)) / len(part) for s in answer) / len(answer)
    return out


TOP_LOGPROBS = 5
SPACE = 32  # byte-level tokens: the model writes " " before a niah value


def greedy_with_logprobs(eng: Any, rid: str, ids: list[int], max_new: int) -> tuple[list[int], list[Any]]:
    """Greedy tokens of one request and each one's top-`TOP_LOGPROBS` logprobs (`TokenLogprob`s)."""
    from longctx.engine.request import Request, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, logprobs=TOP_LOGPROBS)
    eng.add_request(Request(rid, ids, params))
    out: list[int] = []
    lps: list[Any] = []
    while eng.has_work():
        for o in eng.step():
            if o.rid == rid:
                out += o.new_token_ids
                lps += o.logprobs
                if o.error:
                    raise RuntimeError(o.error)
    return out, lps


def first_digit(out_ids: Sequence[int], logprobs: Sequence[Any], value_ids: Sequence[int]) -> dict | None:
    """At the step that wrote the answer's first value token (the first output token equal to none of
    the answer prefix's trailing spaces): the token written, the one wanted, and the wanted one's
    logprob and rank among the step's top `TOP_LOGPROBS` (None: not among them)."""
    if not value_ids or not out_ids:
        return None
    k = next((j for j, t in enumerate(out_ids) if t != SPACE), None)
    if k is None or k >= len(logprobs):
        return None
    want = value_ids[0]
    top = [t for t, _ in logprobs[k].top]
    rank = top.index(want) + 1 if want in top else None
    lp = dict(logprobs[k].top).get(want)
    return {"step": k, "wrote": out_ids[k], "want": want, "want_logprob": lp, "want_rank": rank}


def summarize(rows: list[dict]) -> dict:
    """Per (length, right/wrong): samples and the mean of each layer's recall figures."""
    out: dict = {}
    for r in rows:
        for group in ("all", "right" if r["score"] >= 1 else "wrong"):
            g = out.setdefault(r["length_name"], {}).setdefault(group, {"samples": 0, "layers": {}})
            g["samples"] += 1
            for layer, v in r["recall"].items():
                acc = g["layers"].setdefault(layer, {})
                for k, x in v.items():  # (sum, samples): a value without letters has no answer_letters
                    total, n = acc.get(k, (0.0, 0))
                    acc[k] = (total + x, n + 1)
    for groups in out.values():
        for g in groups.values():
            for acc in g["layers"].values():
                for k, (total, n) in acc.items():
                    acc[k] = round(total / n, 3)
    for r in rows:  # wrong answers: where the wanted first value token ranked at the step that wrote one
        fd = r.get("first_digit")
        if r["score"] >= 1 or not fd or fd["wrote"] == fd["want"]:
            continue
        ranks = out[r["length_name"]]["wrong"].setdefault("first_digit_rank", {})
        key = str(fd["want_rank"]) if fd["want_rank"] is not None else f">{TOP_LOGPROBS}"
        ranks[key] = ranks.get(key, 0) + 1
    return out


def table(summary: dict) -> str:
    lines = [
        "| length | samples | layer | needle share, last prompt row | share over the answer rows | any selected "
        f"| last {LOCAL} prompt positions selected | letters / digits over the answer rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length, groups in summary.items():
        for group in ("right", "wrong"):
            g = groups.get(group)
            if not g:
                continue
            for layer, v in g["layers"].items():
                lines.append(
                    f"| {length} | {g['samples']} {group} | {layer} | {v['last_prompt']:.2f} | "
                    f"{v['answer']:.2f} | {v['any']:.2f} | "
                    + (f"{v['local']:.2f} |" if "local" in v else "- |")
                    + (
                        f" {v['answer_letters']:.2f} / {v['answer_digits']:.2f} |"
                        if "answer_letters" in v
                        else " - |"
                    )
                )
    notes = [
        f"- {length}: wrong first value token; the wanted one ranked "
        + ", ".join(f"{k}: {n}" for k, n in sorted(g["first_digit_rank"].items()))
        for length, groups in summary.items()
        if (g := groups.get("wrong")) and g.get("first_digit_rank")
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


def _force_layers(spec: str, model: str, device: str) -> set[int]:
    """`--force-layers`: the full layers named (LongctxError for another layer or a GPU device)."""
    from longctx.config import ModelConfig
    from longctx.errors import LongctxError

    if not spec.strip():
        return set()
    try:
        layers = {int(x) for x in spec.split(",")}
    except ValueError:
        raise LongctxError(f"--force-layers must be a comma list of layer numbers, not {spec!r}") from None
    if device != "cpu":
        raise LongctxError("--force-layers needs --device cpu (the torch path's index scores)")
    cfg = ModelConfig.from_json(Path(model) / "config.json")
    bad = sorted(x for x in layers if not (0 <= x < cfg.num_hidden_layers and cfg.is_full_indexer(x)))
    if bad:
        raise LongctxError(f"--force-layers: {bad} not full indexer layers of this model")
    return layers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sample_args(ap, lengths="32k,128k", tasks=TASKS, samples=10)
    ap.add_argument(
        "--force-layers",
        default="",
        help="comma list of full layers that select the needle at every answer row (CPU; module doc)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from longctx import Engine
    from longctx.errors import LongctxError
    from longctx.workloads.ruler_runner import format_length
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.scoring import sample_match_all
    from longctx.workloads.tokens import load_counter

    try:
        lengths, tasks = read_sample_args(args)
        force = _force_layers(args.force_layers, args.model, args.device)
    except LongctxError as e:
        print(f"needle_recall: {e}", file=sys.stderr)
        return 2
    bad = [t for t in tasks if not t.startswith("niah_")]
    if bad:
        print(f"needle_recall: only niah tasks have one needle value to look for, not {bad}", file=sys.stderr)
        return 2
    os.environ["LONGCTX_CUDA_GRAPHS"] = "0"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "needle-recall.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    done = {(r["task"], r["length"], r["index"]) for r in rows}
    counter = load_counter(args.model)
    gen = RulerGenerator(counter, seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE)
    engine_kw = dict(
        device=args.device, max_context=max(lengths), cuda_graphs=False, **selection_kwargs(args),
    )  # fmt: skip
    try:
        with Engine(args.model, **engine_kw) as eng:
            for L in lengths:
                for task in tasks:
                    for i in range(args.samples):
                        if (task, L, i) in done:
                            continue
                        s = gen.sample(task, L, i)
                        ids = eng.encode(s.input + s.answer_prefix)
                        value = s.outputs[0]
                        value_ids = eng.encode(value)
                        needle = needle_positions(ids, value_ids)
                        t0 = time.perf_counter()
                        with (  # (forced first: the selections recorded are the forced ones)
                            forced_needle(force, needle, len(ids) - 1) as fc,
                            record_selections(len(ids) - 1) as sel,
                        ):
                            out_ids, logprobs = greedy_with_logprobs(
                                eng, f"needle-{task}-{L}-{i}", ids, s.max_new_tokens
                            )
                        text = eng.tokenizer.decode(out_ids) if eng.tokenizer is not None else ""
                        # the needle's letters (a UUID's a-f; a byte token's id is its byte)
                        letters = [p for p in needle if ids[p] < 256 and bytes([ids[p]]).isalpha()]
                        recall = recall_by_layer(sel, needle, len(ids), len(value_ids) + 1, letters)
                        row: dict[str, Any] = {
                            "task": task,
                            "length": L,
                            "length_name": format_length(L),
                            "index": i,
                            "prompt_tokens": len(ids),
                            "value": value,
                            "needle_positions": needle[:1] + needle[-1:],
                            "output": text,
                            "score": sample_match_all(text, s.outputs),
                            "first_digit": first_digit(out_ids, logprobs, value_ids),
                            "recall": recall,
                            "seconds": round(time.perf_counter() - t0, 2),
                        }
                        if force:
                            row["forced"] = {"layers": sorted(force), **fc}
                        rows.append(row)
                        with path.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(
                            f"needle_recall: {task} {row['length_name']} #{i}: score {row['score']:.0f}, answer-row "
                            "share by layer "
                            + ", ".join(f"{k}: {v['answer']:.2f}" for k, v in recall.items())
                            + f" ({row['seconds']} s)",
                            flush=True,
                        )
    except LongctxError as e:  # (e.g. a forced needle wider than the selection leaves room for)
        print(f"needle_recall: {e}", file=sys.stderr)
        return 2
    summary = summarize(rows)
    res = {
        "model": args.model,
        "seed": SEED,
        "command": "python -m bench.needle_recall " + " ".join(sys.argv[1:] if argv is None else argv),
        "by_length": summary,
    }
    (args.out / "needle-recall.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / "needle-recall.md").write_text(table(summary) + "\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
