"""`longctx retrieve`: answer questions about a whole repository packed into one context.

    longctx retrieve --repo . --queries q.jsonl --out answers.jsonl --model DIR
    longctx retrieve --repo . --queries q.jsonl --out answers.jsonl --base-url http://host:port --max-context 131072

Each line of the queries file is {"query": "..."} (other keys are copied to the output). Each
output line has query, answer, cited_files, latency_s, prompt_tokens and completion_tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from longctx.errors import UsageError
from longctx.paths import nearest_existing
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


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "retrieve",
        help="answer questions over a packed repository (prefilled once)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repo", metavar="PATH", help="repository to pack")
    p.add_argument("--queries", metavar="FILE", help='JSONL, one {"query": ...} per line')
    p.add_argument("--out", metavar="FILE", help="JSONL answers")
    p.add_argument("--model", metavar="DIR", help="model directory for the embedded engine")
    p.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible (or longctx) server instead")
    p.add_argument("--api-key", metavar="KEY", help="bearer token for --base-url")
    p.add_argument("--model-name", metavar="NAME", help="model name sent to --base-url")
    p.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer.json (or dir) for --base-url (default: bytes)"
    )
    p.add_argument(
        "--max-context",
        metavar="N",
        help="context size in tokens (default: the model's, or 1,048,576 for a server)",
    )
    p.add_argument(
        "--max-new-tokens", default="512", metavar="N", help="answer budget per query (default 512)"
    )
    p.add_argument(
        "--max-file-bytes", default="524288", metavar="N", help="skip larger files (default 512 KiB)"
    )
    p.add_argument(
        "--concurrency", default="4", metavar="N", help="queries in flight / engine batch (default 4)"
    )
    p.add_argument("--chat", action="store_true", help="embedded engine: wrap prompts in the chat template")
    p.add_argument(
        "--no-git", action="store_true", help="apply .gitignore files directly instead of asking git"
    )
    p.add_argument("--pack-report", metavar="FILE", help="write what was packed / left out as JSON")
    add_embedded_engine_args(p)
    p.set_defaults(func=run)


def _check_out(path: str) -> None:
    """--out before the long part (packing, loading the model): not a directory, and a file that can be
    written in its nearest existing directory (run_retrieve makes the directories below that)."""
    out = Path(path).absolute()
    base = nearest_existing(out.parent)
    if out.is_dir() or not base.is_dir() or not os.access(out if out.exists() else base, os.W_OK):
        raise UsageError(
            f"--out {path}: not a file that can be written (a directory, under a file, or read-only)"
        )


def _settings(
    args: argparse.Namespace,
    model: str,
    max_context: int,
    max_new: int,
    max_file: int,
    tokenizer: str,
    engine_kw: dict[str, Any],
) -> dict[str, Any]:
    """What a run's answers depend on besides the queries, recorded beside --out so that a rerun under
    others is refused: the model, tokenizer and engine flags (`model_settings`), the repository and how
    it is packed, the answer budget and the prompt form."""
    return {
        **model_settings(args, model, tokenizer, engine_kw),
        "repo": str(Path(args.repo).resolve()),
        "max_context": max_context,
        "max_new_tokens": max_new,
        "max_file_bytes": max_file,
        "no_git": bool(args.no_git),
        "chat": bool(args.chat),
    }


def run(args: argparse.Namespace) -> int:
    from longctx.workloads.repo_pack import pack_repo
    from longctx.workloads.retrieve import (
        Prompting,
        files_written,
        read_queries,
        reserve_tokens,
        run_retrieve,
    )
    from longctx.workloads.tokens import load_counter

    for name in ("repo", "queries", "out"):
        if not getattr(args, name):
            raise UsageError(f"--{name} is required")
    if bool(args.model) == bool(args.base_url):
        raise UsageError("give one of --model DIR or --base-url URL")
    if not Path(args.repo).is_dir():
        raise UsageError(f"--repo {args.repo}: not a directory")
    if args.model and not Path(args.model).is_dir():
        raise UsageError(f"--model {args.model}: not a directory")
    _check_out(args.out)
    if args.chat and args.base_url:
        raise UsageError("--chat is for --model; servers are always asked through chat endpoints")
    max_new = int_arg("max_new_tokens", args.max_new_tokens)
    max_file = int_arg("max_file_bytes", args.max_file_bytes)
    concurrency = int_arg("concurrency", args.concurrency)
    engine_kw = embedded_engine_kwargs(args)
    if args.max_context:
        max_context = int_arg("max_context", args.max_context)
    else:
        max_context = model_context(args.model) if args.model else DEFAULT_MAX_CONTEXT
    queries = read_queries(args.queries)

    tok_dir = args.model if args.model and (Path(args.model) / "tokenizer.json").exists() else args.tokenizer
    counter = load_counter(tok_dir)
    prompting = Prompting()
    if args.chat:
        from longctx.checkpoint.chat_template import apply_chat_template, load_chat_template

        template = load_chat_template(args.model)
        prompting = Prompting(
            lambda text: apply_chat_template([{"role": "user", "content": text}], template=template)
        )
    budget = max_context - reserve_tokens(counter, queries, prompting, max_new)
    if budget <= 0:
        raise UsageError.about(
            "max_context", max_context, "leaves no room for the repository after questions and answers"
        )

    from longctx.workloads.clients import ClientError, EngineClient

    client: Any = served_client(args, "longctx retrieve", chat=True)
    try:
        model = client.model if client is not None else args.model
        settings = _settings(args, model, max_context, max_new, max_file, counter.name, engine_kw)
        # rows of other settings in --out are refused before the long part (run_retrieve checks again
        # under its lock, and records these)
        effective = settings_in_effect(args.model) if args.model else None
        check_settings(Path(args.out), settings, effective)
        written = files_written(Path(args.out)) + ([Path(args.pack_report)] if args.pack_report else [])
        pack = pack_repo(
            args.repo,
            counter,
            budget,
            max_file_bytes=max_file,
            use_git=False if args.no_git else None,
            exclude=written,  # (what this run writes: a rerun would pack the first run's answers)
        )
        print(
            f"longctx retrieve: packed {len(pack.files)} files, {pack.tokens:,} tokens of {budget:,} "
            f"available ({pack.method}); {pack.report()}",
            file=sys.stderr,
        )
        if args.pack_report:
            Path(args.pack_report).write_text(json.dumps(pack.to_json(), indent=2) + "\n")
        if not pack.files:
            cut = [f.path for f in pack.skipped if f.reason == "context full"]
            if cut:  # (packing stops at the first file that does not fit: this one)
                raise UsageError(
                    f"nothing of {args.repo} fits: its first file, {cut[0]}, needs more than the {budget:,} "
                    f"tokens a context of {max_context:,} leaves for the repository after the longest question "
                    "and --max-new-tokens; give a larger --max-context (or --max-file-bytes to leave it out)"
                )
            raise UsageError(f"nothing to pack in {args.repo}")
        if client is None:
            client = EngineClient(args.model, **engine_kw)
        try:
            s = run_retrieve(
                pack, queries, client, counter, args.out, max_new, concurrency, prompting, settings, effective
            )
        except ClientError as e:
            raise ClientError(
                f"{e}; the answers done are kept in {args.out}, and the same command resumes"
            ) from None
    finally:
        if client is not None:
            client.close()
    reasons = ", ".join(f"{n} {r}" for r, n in s["skipped_by_reason"].items()) or "none"
    ignored = f", {s['ignored']} ignored" if s["ignored"] is not None else ""
    print(
        f"retrieve: {s['queries']} queries, mean latency {s['mean_latency_s']:.2f} s, "
        f"{s['files_packed']} files packed ({s['context_tokens']:,} context tokens), "
        f"{s['files_skipped']} skipped ({reasons}){ignored}, "
        f"{s['prompt_tokens']:,} prompt + {s['completion_tokens']:,} completion tokens -> {args.out}",
        file=sys.stderr,
    )
    return 0
