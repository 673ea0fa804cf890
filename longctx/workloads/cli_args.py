"""Argument checks shared by the workload subcommands (`longctx ruler`, `longctx retrieve`)."""

from __future__ import annotations

import argparse
from typing import Any

from longctx.engine.args import KV_DTYPE_CHOICES
from longctx.errors import LongctxError


class UsageError(LongctxError):
    """A bad command-line argument (one line, exit code 2)."""


def int_arg(name: str, text: str | None, lo: int = 1) -> int:
    """The integer flag `name` given as `text` ("1_000" and "1,000" read as 1000), at least `lo`."""
    try:
        v = int(str(text).replace("_", "").replace(",", ""))
    except ValueError:
        raise UsageError(f"{name} must be an integer, not {text!r}") from None
    if v < lo:
        raise UsageError(f"{name} must be >= {lo}")
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
        "--kv-dtype",
        metavar="DTYPE",
        help="the embedded Engine's KV cache: auto (fp8 on CUDA), model, bf16 or fp8_e4m3",
    )
    p.add_argument("--device", default="auto", help="embedded engine device: auto, cpu or cuda")


def embedded_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`add_embedded_engine_args`' flags as Engine keywords (each only when given); they are refused
    without --model, since a server runs with the engine it was started with."""
    ints = (
        ("--hisparse-device-tokens", "hisparse_device_tokens", 1),
        ("--index-topk", "index_topk", 1),
        ("--index-local-window", "index_local_window", 0),
    )
    for flag, name in [(f, n) for f, n, _ in ints] + [("--kv-dtype", "kv_dtype")]:
        if getattr(args, name) and not args.model:
            raise UsageError(f"{flag} is for --model (a server runs the engine it was started with)")
    kw: dict[str, Any] = {"device": args.device}
    for flag, name, lo in ints:
        if getattr(args, name):
            kw[name] = int_arg(flag, getattr(args, name), lo)
    if args.kv_dtype:
        if args.kv_dtype not in KV_DTYPE_CHOICES:
            raise UsageError(
                f"--kv-dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, not {args.kv_dtype!r}"
            )
        kw["kv_dtype"] = args.kv_dtype
    return kw
