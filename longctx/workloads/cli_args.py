"""Argument checks shared by the workload subcommands (`longctx ruler`, `longctx retrieve`)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from longctx.config import SELECTION_FIELDS, check_kv_dtype, check_selection_min, int_text
from longctx.engine.args import skip_layers_arg
from longctx.errors import LongctxError, UsageError

DEFAULT_MAX_CONTEXT = 1_048_576  # the embedded Engine's default max_context
# the embedded engine's flags (Engine keywords) that change how the same weights select or store, so
# what they answer: the others change where and how fast
SELECTION_ENGINE_KW = (*SELECTION_FIELDS, "kv_dtype", "kv_fp8_skip_layers")
# selection A/Bs an evaluation sets through the environment (longctx/model/indexer.py): record key -> variable
SELECTION_ENV = {"topk_long_decode": "LONGCTX_TOPK_LONG_DECODE"}


def selection_env() -> dict[str, str]:
    """The SELECTION_ENV variables this process has set, by record key (unset or empty: left out)."""
    return {k: os.environ[v].strip() for k, v in SELECTION_ENV.items() if os.environ.get(v, "").strip()}


def model_settings(
    args: argparse.Namespace, model: str, tokenizer: str, engine_kw: dict[str, Any]
) -> dict[str, Any]:
    """The settings a workload's rows depend on whatever the workload, recorded beside its results so
    that a rerun under others is refused (`jsonl.check_settings`): the model (`--model`'s directory, or
    the name a `--base-url` server serves: how it is asked differs too), the tokenizer prompts are
    counted with, and the embedded engine's flags that change what it computes (the device: `auto`
    dtypes and KV cache differ; SELECTION_ENGINE_KW and SELECTION_ENV; not HiSparse's cap, which only
    moves KV)."""
    out: dict[str, Any] = {
        "model": str(Path(model).resolve()) if args.model else model,
        "via": "engine" if args.model else "server",
        "tokenizer": tokenizer if tokenizer == "bytes" else str(Path(tokenizer).resolve()),
    }
    if args.model:
        from longctx.engine.sizing import resolve_device

        out["device"] = resolve_device(engine_kw["device"]).type
        out.update((k, engine_kw.get(k)) for k in SELECTION_ENGINE_KW)  # (None: the model's)
        env = selection_env()
        out.update((k, env.get(k)) for k in SELECTION_ENV)  # (None: unset)
    return out


def settings_in_effect(model_dir: str) -> Callable[[Mapping[str, Any]], dict[str, Any]] | None:
    """How the embedded engine of `model_dir` takes a record's engine flags (`model_settings`), for
    `jsonl.check_settings` to compare: a selection flag left out (null) as the model's own value and one given
    as `with_selection` takes it, `kv_fp8_skip_layers` likewise (the layers, in order), `kv_dtype` as the pool
    kind it gives on the recorded device (`auto` is `fp8_e4m3` on CUDA). So `--index-topk 256` on a model whose
    own index_topk is 256 is the flag left out, both ways. A value the model does not take (a record of another
    model's flags, one edited by hand) is compared as given; None when the model's config cannot be read
    (everything compared as given: the engine says what is wrong with it)."""
    from longctx.config import ModelConfig, with_selection
    from longctx.kv_kinds import resolve_kv_kind

    try:
        cfg = ModelConfig.from_json(model_dir)
    except Exception:
        return None

    def in_effect(settings: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # (a value the model does not take, or of the wrong type: left as given)
        with contextlib.suppress(LongctxError, TypeError, ValueError, AttributeError):
            if all(k in settings for k in SELECTION_FIELDS):
                sel = with_selection(cfg, **{k: settings[k] for k in SELECTION_FIELDS})
                out.update((k, getattr(sel, k)) for k in SELECTION_FIELDS)
        if "kv_fp8_skip_layers" in settings:
            skip = settings["kv_fp8_skip_layers"]
            skip = cfg.kv_fp8_skip_layers if skip is None else skip
            if isinstance(skip, (list, tuple)) and all(isinstance(x, int) for x in skip):
                out["kv_fp8_skip_layers"] = sorted(skip)
        with contextlib.suppress(LongctxError, TypeError, ValueError, AttributeError):
            if "kv_dtype" in settings:
                device = str(settings.get("device"))
                out["kv_dtype"] = resolve_kv_kind(settings["kv_dtype"] or "auto", device)
        return out

    return in_effect


def served_client(args: argparse.Namespace, command: str, chat: bool) -> Any:
    """The HTTPClient of `--base-url`, made now for the name of the model it serves (part of a run's
    settings), its retries told on stderr as `command`'s; None with an embedded engine (--model)."""
    if not args.base_url:
        return None
    from longctx.workloads.clients import HTTPClient

    return HTTPClient(
        args.base_url,
        api_key=args.api_key,
        model_name=args.model_name,
        chat=chat,
        tell=lambda line: print(f"{command}: {line}", file=sys.stderr),
    )


def model_context(model_dir: str) -> int:
    """The longest request (prompt + output) the embedded engine of `model_dir` takes: the config's
    max_position_embeddings, at most DEFAULT_MAX_CONTEXT."""
    try:
        from longctx.config import ModelConfig

        return min(ModelConfig.from_json(model_dir).max_position_embeddings, DEFAULT_MAX_CONTEXT)
    except LongctxError:
        raise
    except Exception:
        return DEFAULT_MAX_CONTEXT


def int_arg(name: str, text: str | None, lo: float = 1) -> int:
    """The integer flag of dest `name` given as `text` ("1_000" and "1,000" read as 1000: `int_text`), at
    least `lo` (-math.inf: any, for a caller that checks its own range)."""
    try:
        v = int_text(text)
    except ValueError:
        raise UsageError.about(name, repr(text), "must be an integer") from None
    if v < lo:
        raise UsageError.about(name, text, f"must be >= {lo}")
    return v


def add_embedded_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags passed to the engine a workload embeds with --model."""
    p.add_argument("--hisparse-device-tokens", metavar="N", help="passed to the embedded Engine")
    p.add_argument(
        "--index-topk",
        metavar="N",
        help="tokens each full layer selects (embedded Engine; default the model's)",
    )
    p.add_argument(
        "--index-local-window",
        metavar="N",
        help="each query's newest positions kept in every full layer's selection (embedded Engine; "
        "default the model's)",
    )
    p.add_argument(
        "--index-topk-long",
        metavar="N",
        help="tokens each full layer selects for queries from --index-topk-long-from on (embedded Engine; "
        "default the model's, 0: off)",
    )
    p.add_argument(
        "--index-topk-long-from",
        metavar="P",
        help="the position from which --index-topk-long applies (embedded Engine; default the model's)",
    )
    p.add_argument(
        "--kv-dtype",
        metavar="DTYPE",
        help="the embedded Engine's KV cache: auto (fp8 on CUDA), model, bf16 or fp8_e4m3",
    )
    p.add_argument(
        "--kv-fp8-skip-layers",
        metavar="L,..",
        help="layers the embedded Engine's fp8 cache keeps in the model dtype, or 'none' (default: the "
        "model's kv_fp8_skip_layers)",
    )
    p.add_argument("--device", default="auto", help="embedded engine device: auto, cpu or cuda")


def _selection_arg(name: str, text: str) -> int:
    """A selection flag's integer, at least its least value (`check_selection_min`, as `serve` checks its)."""
    v = int_arg(name, text, lo=-math.inf)
    check_selection_min(name, v, shown=text)
    return v


def embedded_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`add_embedded_engine_args`' flags as Engine keywords (each only when given); they are refused
    without --model, since a server runs with the engine it was started with."""
    kw: dict[str, Any] = {"device": args.device}
    parsers: dict[str, Callable[[str, str], Any]] = {
        "hisparse_device_tokens": partial(int_arg, lo=1),
        **dict.fromkeys(SELECTION_FIELDS, _selection_arg),
        "kv_dtype": lambda _, text: check_kv_dtype(text),
        "kv_fp8_skip_layers": lambda _, text: skip_layers_arg(text),
    }
    for name, parse in parsers.items():
        text = getattr(args, name)
        if text:
            if not args.model:
                raise UsageError.about(
                    name, None, "is for {} (a server runs the engine it was started with)", "model"
                )
            kw[name] = parse(name, text)
    return kw
