"""Error types. Every error a user can cause is a `LongctxError` whose message is one line."""

from __future__ import annotations


class LongctxError(Exception):
    """Bad input or an unusable model directory; the CLI prints it as one line (exit code 2)."""


class ConfigError(LongctxError, ValueError):
    """A config.json longctx cannot run."""


class CheckpointError(LongctxError):
    """A checkpoint that does not match its config (missing/unexpected tensor, shape, file)."""


class RequestError(LongctxError, ValueError):
    """A request that cannot be served (too long, bad sampling parameters, ...)."""


class EngineDeadError(LongctxError, RuntimeError):
    """A stage process died; pending requests fail with this error."""


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (the type alone for an empty message), for logs and reports."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
