"""`longctx generate` and `longctx score`: run the engine on prompts from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from longctx.engine.args import add_engine_args, engine_kwargs
from longctx.engine.guided import guide_of
from longctx.engine.request import SamplingParams, TokenLogprob
from longctx.errors import LongctxError


def _engine_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, model_help="checkpoint directory (config.json + safetensors)", choices=False)


def _engine(args: argparse.Namespace):
    from longctx import Engine

    if not Path(args.model).is_dir():
        raise LongctxError(f"model directory not found: {args.model}")
    return Engine(args.model, **engine_kwargs(args))


def _read_prompt(args: argparse.Namespace) -> list[str] | list[list[int]]:
    if args.token_ids and (args.prompt or args.prompt_file):
        raise LongctxError("give the prompt as text (PROMPT or --prompt-file) or as --token-ids, not both")
    if args.token_ids:
        return [_parse_ids("token_ids", args.token_ids)]
    if args.prompt_file:
        p = Path(args.prompt_file)
        if not p.is_file():
            raise LongctxError(f"prompt file not found: {p}" + (" (a directory)" if p.is_dir() else ""))
        try:
            return [p.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise LongctxError(f"prompt file {p} is not valid UTF-8 (byte {e.start})") from None
    if isinstance(args.prompt, str):
        return [args.prompt]
    if args.prompt:
        return list(args.prompt)
    if not sys.stdin.isatty():
        return [sys.stdin.read()]
    raise LongctxError("give a prompt: PROMPT, --prompt-file, --token-ids or stdin")


def _parse_ids(name: str, spec: str) -> list[int]:
    """'1,2,3' (or spaces) -> [1, 2, 3]."""
    try:
        return [int(x) for x in spec.replace(",", " ").split()]
    except ValueError:
        raise LongctxError.about(
            name, repr(spec), "expected integers separated by commas or spaces"
        ) from None


def _parse_logit_bias(spec: str | None) -> dict[int, float]:
    """'ID:BIAS,ID:BIAS' -> {id: bias}."""
    out: dict[int, float] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        tok, sep, bias = part.partition(":")
        try:
            t, b = int(tok), float(bias)
        except ValueError:
            raise LongctxError.about("logit_bias", repr(part.strip()), "expected ID:BIAS pairs") from None
        if not sep or t in out:
            raise LongctxError.about(
                "logit_bias", repr(part.strip()), "expected ID:BIAS pairs with each ID once"
            )
        out[t] = b
    return out


def _lp_json(x: TokenLogprob) -> dict:
    out = {
        "token_id": x.token_id,
        "logprob": round(x.logprob, 6),
        "top": [[t, round(p, 6)] for t, p in x.top],
    }
    if x.rank is not None:  # (a prompt token's)
        out["rank"] = x.rank
    return out


def _guide(args: argparse.Namespace) -> tuple[str, ...]:
    names = ("--guided-regex", "--guided-choice", "--guided-json", "--json-object")
    return guide_of(args.guided_regex, args.guided_choice, args.guided_json, args.json_object, names)


def run_generate(args: argparse.Namespace) -> int:
    bias = _parse_logit_bias(args.logit_bias)
    allowed = tuple(_parse_ids("allowed_token_ids", args.allowed_token_ids or ""))
    SamplingParams(  # the sampling flags checked before the model loads
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        min_p=args.min_p,
        logit_bias=tuple(sorted(bias.items())),
        stop=tuple(args.stop or ()),
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        include_stop_str_in_output=args.include_stop_str_in_output,
        allowed_token_ids=allowed,
        bad_words=tuple(args.bad_words or ()),
        guided=_guide(args),
    ).validate()
    if (args.logprobs is not None or args.prompt_logprobs is not None) and not args.json:
        raise LongctxError("--logprobs / --prompt-logprobs need --json")
    prompts = _read_prompt(args)
    with _engine(args) as eng:
        outs = eng.generate(
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=args.stop or None,
            include_stop_str_in_output=args.include_stop_str_in_output,
            allowed_token_ids=list(allowed),
            bad_words=args.bad_words,
            guided_regex=args.guided_regex,
            guided_choice=args.guided_choice,
            guided_json=args.guided_json,
            guided_json_object=args.json_object,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            min_tokens=args.min_tokens,
            min_p=args.min_p,
            logit_bias=bias,
            logprobs=args.logprobs,
            prompt_logprobs=args.prompt_logprobs,
        )
    for o in outs:
        if args.json:
            row: dict = {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
            if args.logprobs is not None:
                row["logprobs"] = [_lp_json(x) for x in o.logprobs]
            if args.prompt_logprobs is not None:  # (the first prompt token has none)
                row["prompt_logprobs"] = [None, *(_lp_json(x) for x in o.prompt_logprobs)]
            print(json.dumps(row))
        else:
            print(o.text if o.text is not None else " ".join(map(str, o.token_ids)))
    return 0


def run_score(args: argparse.Namespace) -> int:
    import torch

    prompts = _read_prompt(args)
    if args.out and (Path(args.out).is_dir() or not Path(args.out).resolve().parent.is_dir()):
        raise LongctxError(f"--out {args.out}: not a file in an existing directory")
    with _engine(args) as eng:
        ids = prompts[0] if isinstance(prompts[0], list) else eng.encode(prompts[0])
        logits = eng.score(ids)
    lp = torch.log_softmax(logits, dim=-1)
    # log-probability of each next token given its prefix
    tok_lp = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    # (one token: nothing is predicted, so no NLL; null in the JSON, which has no NaN)
    nll = float(-tok_lp.mean()) if len(ids) > 1 else None
    result: dict[str, object] = {
        "tokens": len(ids),
        "mean_nll": nll,
        "perplexity": None if nll is None else float(torch.exp(torch.tensor(nll))),
    }
    if args.out:
        # (opened here: torch.save's own open failed as a RuntimeError, a traceback, not main's one line)
        with open(args.out, "wb") as f:
            torch.save(logits, f)
        result["logits_file"] = args.out
    if args.per_token:
        result["token_logprobs"] = [None] + [round(float(x), 6) for x in tok_lp]
    print(json.dumps(result))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    _engine_args(g)
    g.add_argument("prompt", nargs="*", default=None, help="prompt text (several give a batch)")
    g.add_argument("--prompt-file")
    g.add_argument("--token-ids", help="a prompt as token ids: '1,2,3'")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="over the prompt's and the generated tokens (1: off)",
    )
    g.add_argument(
        "--min-tokens", type=int, default=0, help="no EOS, stop token or stop string before this many"
    )
    g.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens under min_p x the likeliest one's probability"
    )
    g.add_argument("--logit-bias", help="biases added to the logits: 'ID:BIAS,ID:BIAS' (BIAS in [-100, 100])")
    g.add_argument("--allowed-token-ids", help="the only tokens drawn: 'ID,ID,...'")
    g.add_argument(
        "--bad-word", action="append", dest="bad_words", help="a word never generated (repeatable)"
    )
    g.add_argument("--guided-regex", metavar="PATTERN", help="the output matches this regular expression")
    g.add_argument(
        "--guided-choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)"
    )
    g.add_argument(
        "--guided-json", metavar="SCHEMA", help="the output is JSON valid against this JSON schema"
    )
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument(
        "--logprobs", type=int, default=None, metavar="N", help="with --json: each token's logprob, top N"
    )
    g.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each prompt token's, top N",
    )
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument(
        "--include-stop",
        action="store_true",
        dest="include_stop_str_in_output",
        help="the text keeps the stop string that ended it",
    )
    g.add_argument("--json", action="store_true", help="one JSON object per completion")
    g.set_defaults(func=run_generate)

    s = sub.add_parser("score", help="logits of a prompt at every position (prints mean NLL / perplexity)")
    _engine_args(s)
    s.add_argument("prompt", nargs="?", default=None)
    s.add_argument("--prompt-file")
    s.add_argument("--token-ids")
    s.add_argument("--out", help="save the [n, vocab] fp32 logits with torch.save")
    s.add_argument("--per-token", action="store_true", help="also print each token's log-probability")
    s.set_defaults(func=run_score)
