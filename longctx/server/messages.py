"""Messages between the HTTP frontend and the engine process (ZMQ + msgpack).

Each message is a frozen dataclass registered under a short tag. `encode` packs
a msgpack extension holding `[tag, field0, field1, ...]` (positional, so the wire stays small);
nested registered dataclasses are packed the same way.
Arrays decode as tuples, which is what frozen dataclasses want.

Frontend -> engine: AddRequest, AbortRequest, PinDocument, UnpinDocument, StatsQuery,
ResetPrefixCache, Shutdown.
Engine -> frontend: EngineReady, EngineFailed, OutputBatch (TokenOutput per request that
progressed, plus the queue counts), RpcReply (answers PinDocument / UnpinDocument / StatsQuery /
ResetPrefixCache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

_REGISTRY: dict[str, type] = {}
_TAGS: dict[type, str] = {}


def message(tag: str):
    """Class decorator: register a frozen dataclass under `tag` for `encode` / `decode`."""

    def wrap(cls: type) -> type:
        if tag in _REGISTRY:
            raise ValueError(f"message tag {tag!r} registered twice")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return wrap


_EXT = 1  # msgpack extension code for a registered dataclass: payload = [tag, field values...]


def _default(obj: Any) -> Any:
    tag = _TAGS.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return msgpack.ExtType(_EXT, msgpack.packb([tag, *fields], default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, use_list=False, strict_map_key=False)
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise ValueError(f"unknown message tag {tag!r}")
    return cls(*values)


def encode(msg: Any) -> bytes:
    """Pack a registered message (or any msgpack-able value containing them)."""
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Inverse of `encode`. Raises ValueError on bytes that are not a known message."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, use_list=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable message: {e}") from e


# ---- frontend -> engine ------------------------------------------------------------------------


@message("sp")
@dataclass(frozen=True)
class WireSamplingParams:
    """`longctx.engine.request.SamplingParams` on the wire (kept separate so the engine type may grow)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    guided: tuple[str, ...] = ()
    priority: int = 0


@message("add")
@dataclass(frozen=True)
class AddRequest:
    rid: str
    prompt_ids: tuple[int, ...]
    params: WireSamplingParams
    pin_prefix: bool = False


@message("abort")
@dataclass(frozen=True)
class AbortRequest:
    rid: str


def pin_rid(call_id: int) -> str:
    """The engine request id of a PinDocument call's prefill (and so the pinned document's id): an
    AbortRequest with it withdraws the upload."""
    return f"pin-{call_id}"


@message("pin")
@dataclass(frozen=True)
class PinDocument:
    call_id: int
    token_ids: tuple[int, ...]


@message("unpin")
@dataclass(frozen=True)
class UnpinDocument:
    call_id: int
    doc_id: str


@message("statsq")
@dataclass(frozen=True)
class StatsQuery:
    call_id: int


@message("resetpc")
@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop the prefix cache's pages no request or document holds; the reply's result is
    {"freed_pages", "kept_pages"} (`Engine.reset_prefix_cache`)."""

    call_id: int


@message("shutdown")
@dataclass(frozen=True)
class Shutdown:
    """Abort whatever is left and exit. The frontend drains before sending it."""


# ---- engine -> frontend ------------------------------------------------------------------------


@message("ready")
@dataclass(frozen=True)
class EngineReady:
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    info: dict = dataclasses.field(default_factory=dict)


@message("failed")
@dataclass(frozen=True)
class EngineFailed:
    """The engine could not start (or hit an unrecoverable error); `error` is one line."""

    error: str


@message("lp")
@dataclass(frozen=True)
class WireLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # (prompt logprobs) 1 + how many tokens are likelier


@message("out")
@dataclass(frozen=True)
class TokenOutput:
    """`longctx.engine.request.StepOutput` on the wire; `finish_reason` is the enum's value."""

    rid: str
    new_token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    prompt_done: int = 0
    prompt_total: int = 0
    cached_tokens: int = 0
    logprobs: tuple[WireLogprob, ...] = ()
    error: str | None = None
    # an error that is the request's fault (-> 4xx): its OpenAI code ("invalid_value", "queue_full", ...)
    # and the field at fault if known (`RequestError`'s); no code: the engine's fault (-> 5xx)
    error_code: str | None = None
    error_param: str | None = None
    prompt_logprobs: tuple[WireLogprob, ...] = ()  # the next prompt tokens' (from token 1 on)


@message("batch")
@dataclass(frozen=True)
class OutputBatch:
    outputs: tuple[TokenOutput, ...]
    num_waiting: int = 0
    num_running: int = 0
    stats: dict | None = None  # eng.stats(), sent now and then rather than every step


@message("reply")
@dataclass(frozen=True)
class RpcReply:
    call_id: int
    ok: bool
    result: Any = None
    error: str | None = None
    error_code: str | None = None  # as TokenOutput's
