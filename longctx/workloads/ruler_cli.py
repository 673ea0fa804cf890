"""`longctx ruler`: the 13-task RULER suite against the embedded engine or an OpenAI-compatible server.

longctx ruler --model DIR --lengths 4k,32k,128k,1m --samples 20 --out runs/ruler
longctx ruler --base-url http://host:port --tokenizer DIR --chat --out runs/other-engine
longctx ruler --tasks niah_single_1,vt --lengths 8k --dump-dir samples/   # samples only
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

from longctx.errors import UsageError
from longctx.seeds import seed_arg
from longctx.workloads.cli_args import (
    DEFAULT_MAX_CONTEXT,
    add_embedded_engine_args,
    embedded_engine_kwargs,
    int_arg,
    model_context,
    model_settings,
    served_client,
    settings_in_effect,
)
from longctx.workloads.jsonl import check_settings
from longctx.workloads.ruler_tasks import (
    TASKS,
    Renderer,
    Sample,
    document_turn,
    parse_tasks,
    raw_render,
    split_niah,
)

DEFAULT_LENGTHS = "4k,8k,16k,32k,64k,128k"
MIN_LENGTH = 256


def parse_lengths(text: str) -> list[int]:
    """'4k,32k,128k,1m' -> [4096, 32768, 131072, 1048576] (K = 1024, M = 1024**2), sorted. A bad one is
    refused `about` the setting `lengths` (the bench scripts that share this print it unnamed)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        m = re.fullmatch(r"(\d+)([km]?)", p)
        if not m:
            raise UsageError.about(
                "lengths", repr(part.strip()), "not a length; use e.g. 4k,32k,128k,1m or a token count"
            )
        n = int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2)]
        if n < MIN_LENGTH:
            raise UsageError.about("lengths", part.strip(), f"too short; the smallest is {MIN_LENGTH}")
        out.append(n)
    return sorted(set(out))


def parse_indices(text: str | None) -> tuple[int, ...] | None:
    """'0,5,15' -> (0, 5, 15): sample indices, each >= 0, no repeats; None when not given."""
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        p = part.strip()
        if not p.isdigit():
            raise UsageError.about("indices", repr(p), "not a sample index; use e.g. 0,5,15")
        if int(p) in out:
            raise UsageError.about("indices", int(p), "given twice")
        out.append(int(p))
    return tuple(out)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ruler",
        help="RULER long-context benchmark (13 tasks)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--model", metavar="DIR", help="model directory for the embedded engine")
    src.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible server instead")
    src.add_argument("--api-key", metavar="KEY", help="bearer token for --base-url")
    src.add_argument(
        "--model-name", metavar="NAME", help="model name sent to --base-url (default: its first)"
    )
    src.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer.json (or its dir) to count lengths with --base-url (default: bytes)",
    )
    p.add_argument("--tasks", default="all", help=f"comma list or 'all' ({', '.join(TASKS)})")
    p.add_argument(
        "--lengths", default=DEFAULT_LENGTHS, help=f"comma list of lengths (default {DEFAULT_LENGTHS})"
    )
    p.add_argument("--samples", default="50", metavar="N", help="samples per task and length (default 50)")
    p.add_argument(
        "--indices",
        metavar="I,J,...",
        help="run these sample indices (comma list, e.g. 0,5,15) instead of 0..N-1 of --samples",
    )
    p.add_argument("--seed", default="42", metavar="N", help="generation seed (default 42)")
    p.add_argument(
        "--concurrency", default="4", metavar="N", help="requests in flight / engine batch (default 4)"
    )
    p.add_argument(
        "--max-new-tokens-scale",
        default="1.0",
        metavar="X",
        help="multiply RULER's per-task output budgets (default 1)",
    )
    add_embedded_engine_args(p)
    form = p.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true", help="use the chat template instead of raw completion")
    form.add_argument(
        "--documents",
        action="store_true",
        help="niah tasks as long-document QA: the haystack as the document, the question asked on it "
        "(a server: POST /v1/documents, /ask, DELETE; --model: the same chat prompt), no answer prefix",
    )
    p.add_argument("--out", metavar="DIR", help="results.jsonl (resumable), results.json and ruler.png")
    p.add_argument("--dump-dir", metavar="DIR", help="also write the generated samples to DIR/samples.jsonl")
    p.set_defaults(func=run)


def _chat_renderer(model_dir: str) -> Renderer:
    try:
        from longctx.checkpoint.chat_template import apply_chat_template, load_chat_template
    except ImportError:
        raise UsageError("--chat needs longctx.checkpoint.chat_template, which is not available") from None
    template = load_chat_template(model_dir)

    def render(text: str, prefix: str) -> str:
        return apply_chat_template([{"role": "user", "content": text}], template=template) + prefix.lstrip()

    return render


def _documents_renderer(tasks: list[str], model_dir: str | None) -> Renderer:
    """--documents: (document, question) joined as a long-document QA request's user turn; in the
    model's chat template for the embedded engine (the prompt /ask builds), bare for a server (which
    applies its own). No answer prefix: a QA client sends none."""
    other = [t for t in tasks if TASKS[t].family != "niah"]
    if other:
        raise UsageError(f"--documents takes niah tasks only, not {other[0]}")
    chat = _chat_renderer(model_dir) if model_dir else None

    def render(text: str, prefix: str) -> str:
        user = document_turn(text)
        return user if chat is None else chat(user, "")

    return render


def prompt_form(chat: bool, documents: bool) -> str:
    """The prompt form a run records ("raw", "chat" or "documents"; `bench/retrieval_eval` keeps runs
    of different forms apart)."""
    return "documents" if documents else "chat" if chat else "raw"


def _settings(
    args: argparse.Namespace, model: str, tokenizer: str, engine_kw: dict[str, Any], seed: int, scale: float
) -> dict[str, Any]:
    """What a run's rows depend on besides which samples it runs (--tasks, --lengths, --samples and
    --indices only pick them, so a rerun may change them), recorded in OUT so that a rerun under others is
    refused: the model, tokenizer and engine flags (`model_settings`), the seed the samples are generated
    with, the prompt form and the output budgets' scale."""
    return {
        **model_settings(args, model, tokenizer, engine_kw),
        "seed": seed,
        "form": prompt_form(args.chat, args.documents),
        "max_new_tokens_scale": scale,
    }


def run(args: argparse.Namespace) -> int:
    from longctx.workloads import ruler_runner as rr
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    if args.model and args.base_url:
        raise UsageError("give either --model or --base-url, not both")
    tasks = parse_tasks(args.tasks)
    lengths = parse_lengths(args.lengths)
    samples = int_arg("samples", args.samples)
    indices = parse_indices(args.indices)
    seed = seed_arg("seed", args.seed)
    concurrency = int_arg("concurrency", args.concurrency)
    try:
        scale = float(args.max_new_tokens_scale)
    except ValueError:
        raise UsageError.about(
            "max_new_tokens_scale", repr(args.max_new_tokens_scale), "must be a number"
        ) from None
    if not 0 < scale < math.inf:
        raise UsageError.about("max_new_tokens_scale", scale, "must be a finite number > 0")
    # (1e308 scaled a budget to infinity: an OverflowError's traceback; no budget is worth more tokens than the
    # longest context an engine takes)
    most = DEFAULT_MAX_CONTEXT // max(spec.max_new_tokens for spec in TASKS.values())
    if scale > most:
        raise UsageError.about(
            "max_new_tokens_scale",
            scale,
            f"must be at most {most} (RULER's largest output budget times it is {DEFAULT_MAX_CONTEXT} tokens)",
        )
    engine_kw = embedded_engine_kwargs(args)
    has_model = bool(args.model or args.base_url)
    if not has_model and not args.dump_dir:
        raise UsageError("give --model DIR or --base-url URL (or only --dump-dir DIR to write samples)")
    if has_model and not args.out:
        raise UsageError("--out DIR is required to run a model")
    if args.model and not Path(args.model).is_dir():
        raise UsageError(f"--model {args.model}: not a directory")
    limit = model_context(args.model) if args.model else None
    if limit is not None and lengths[-1] > limit:  # (a longer sample ran past the model's positions)
        raise UsageError.about("lengths", lengths[-1], f"is more than the {limit} tokens {args.model} takes")
    if args.model and args.tokenizer:
        raise UsageError(
            "--tokenizer is for --base-url; the model directory's tokenizer is used with --model"
        )

    tok_dir = args.model if args.model else args.tokenizer
    if args.model and not (Path(args.model) / "tokenizer.json").exists():
        print(
            f"longctx ruler: {args.model} has no tokenizer.json; counting lengths in bytes", file=sys.stderr
        )
        tok_dir = None
    counter = load_counter(tok_dir)
    render: Renderer = raw_render
    if args.documents:
        render = _documents_renderer(tasks, args.model)
    elif args.chat and args.model:
        render = _chat_renderer(args.model)
    elif args.chat:
        render = lambda text, prefix: text  # noqa: E731  (the server applies its own template)
    gen = RulerGenerator(counter, seed=seed, render=render, max_new_tokens_scale=scale)
    plan = rr.RunPlan(tuple(tasks), tuple(lengths), samples, concurrency, indices)
    keys = rr.plan_keys(plan)

    def dump() -> None:  # --dump-dir's samples
        if args.dump_dir:
            n = rr.dump_samples(gen, keys, Path(args.dump_dir))
            print(
                f"longctx ruler: wrote {n} samples to {Path(args.dump_dir) / 'samples.jsonl'}",
                file=sys.stderr,
            )

    if not has_model:
        dump()
        return 0

    from longctx.workloads.clients import ClientError, EngineClient, GenRequest

    def make_request(s: Sample) -> GenRequest:
        prompt = gen.render(s.input, s.answer_prefix)
        if args.base_url:
            if args.documents:
                return GenRequest(prompt, s.max_new_tokens, document=split_niah(s.input))
            return GenRequest(prompt, s.max_new_tokens, chat_user=s.input if args.chat else None)
        ids = counter.encode(prompt)
        return GenRequest(prompt, s.max_new_tokens, prompt_ids=tuple(ids) if ids is not None else None)

    out = Path(args.out)
    client: Any = served_client(args, "longctx ruler", chat=args.chat)
    try:
        model = client.model if client is not None else args.model
        settings = _settings(args, model, counter.name, engine_kw, seed, scale)
        # rows of other settings in --out are refused before anything is written (the dump too) or the model
        # loads (run_samples checks again under its lock, and records these)
        effective = settings_in_effect(args.model) if args.model else None
        check_settings(out / rr.RESULTS, settings, effective)
        dump()
        if client is None:
            client = EngineClient(args.model, **engine_kw)
        try:
            ran = rr.run_samples(gen, client, keys, out, make_request, concurrency, settings, effective)
        except ClientError as e:
            raise ClientError(
                f"{e}; the samples done are kept in {out}, and the same command resumes"
            ) from None
    finally:
        if client is not None:
            client.close()
    meta = {
        "model": client.label,
        "seed": seed,
        "tokenizer": counter.name,
        "chat": bool(args.chat),
        "form": prompt_form(args.chat, args.documents),
        "max_new_tokens_scale": scale,
    }
    summary = rr.write_report(out, meta)
    print(rr.table(summary))
    print(
        f"longctx ruler: {ran} samples run now, {len(keys) - ran} already done; "
        f"wrote {out / 'results.json'} and {out / 'ruler.png'}",
        file=sys.stderr,
    )
    return 0
