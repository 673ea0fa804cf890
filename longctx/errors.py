"""Error types. Every error a user can cause is a `LongctxError` whose message is one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

E = TypeVar("E", bound="LongctxError")


class LongctxError(Exception):
    """Bad input or an unusable model directory; the CLI prints it as one line (exit code 2)."""

    # a request's fault (a RequestError) has the HTTP server's OpenAI error code for it and, where one is
    # known, the request field at fault; None: not a request's fault
    code: str | None = None
    param: str | None = None
    # an error `about` one setting: its name, its value as shown, what is wrong (with {} for each of the
    # `others` settings it names); None: not about a setting
    setting: str | None = None
    value: str | None = None
    problem: str = ""
    others: tuple[str, ...] = ()

    @classmethod
    def about(cls: type[E], setting: str, value: object, problem: str, *others: str) -> E:
        """An error about the setting `setting` (a config field) of value `value` (None or empty: not shown), e.g.
        `kl_rows 0: must be >= 1`; each {} in `problem` names one of `others`. A CLI tells it with the
        flags its user typed instead of the field names (`named`)."""
        shown = None if value is None else str(value)
        e = cls(_said(setting, shown, problem, others, str))
        e.setting, e.value, e.problem, e.others = setting, shown, problem, others
        return e

    def named(self, name: Callable[[str], str]) -> str:
        """The message with every setting it is about said as `name(setting)` (`--kl-rows 0: must be
        >= 1`); the message as it is for an error not about a setting."""
        if self.setting is None:
            return str(self)
        return _said(self.setting, self.value, self.problem, self.others, name)


def _said(
    setting: str, value: str | None, problem: str, others: tuple[str, ...], name: Callable[[str], str]
) -> str:
    # (only a `problem` that names other settings is formatted: a value, or a problem quoting one, may hold
    # braces)
    shown = f" {value}" if value else ""  # (an empty value, as None, shows as nothing)
    return f"{name(setting)}{shown}: {problem.format(*map(name, others)) if others else problem}"


class UsageError(LongctxError):
    """A bad command-line argument (one line, exit code 2)."""


class ConfigError(LongctxError, ValueError):
    """A config.json longctx cannot run."""


class CheckpointError(LongctxError):
    """A checkpoint that does not match its config (missing/unexpected tensor, shape, file)."""


class RequestError(LongctxError, ValueError):
    """A request that cannot be served (too long, bad sampling parameters, ...)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


class KernelInputError(LongctxError, ValueError):
    """A kernel wrapper was given tensors of the wrong shape, dtype, stride or device, or a KV layout an
    unknown kind or shape (here, not in `longctx.kernels.common`, for the torch-free `longctx.kv_kinds`)."""


class EngineDeadError(LongctxError, RuntimeError):
    """A stage process died; pending requests fail with this error."""


def os_error_line(e: OSError) -> str:
    """An OSError on a path the user gave (missing, not a directory, not writable, disk full) as one line:
    `No such file or directory: PATH`."""
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def clipped(text: str, keep: int) -> str:
    """A client's long string as an error repeats it: the repr of its first `keep` characters and its length,
    `'abc'... (5000 characters)`, so the message stays one short line."""
    return f"{text[:keep]!r}... ({len(text)} characters)"


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (the type alone for an empty message), for logs and reports."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
