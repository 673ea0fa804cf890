"""Error types. Every error a user can cause is a `LongctxError` whose message is one line."""

from __future__ import annotations


class LongctxError(Exception):
    """Bad input or an unusable model directory; the CLI prints it as one line (exit code 2)."""

    # a request's fault (a RequestError) has the HTTP server's OpenAI error code for it and, where one is
    # known, the request field at fault; None: not a request's fault
    code: str | None = None
    param: str | None = None


class ConfigError(LongctxError, ValueError):
    """A config.json longctx cannot run."""


class CheckpointError(LongctxError):
    """A checkpoint that does not match its config (missing/unexpected tensor, shape, file)."""


class RequestError(LongctxError, ValueError):
    """A request that cannot be served (too long, bad sampling parameters, ...)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


class EngineDeadError(LongctxError, RuntimeError):
    """A stage process died; pending requests fail with this error."""


def os_error_line(e: OSError) -> str:
    """An OSError on a path the user gave (missing, not a directory, not writable, disk full) as one line:
    `No such file or directory: PATH`."""
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (the type alone for an empty message), for logs and reports."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
