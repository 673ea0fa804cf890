"""Argument checks shared by the workload subcommands (`longctx ruler`, `longctx retrieve`)."""

from __future__ import annotations

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
