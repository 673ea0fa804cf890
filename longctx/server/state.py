"""Server settings and the per-app state every route reads (`request.app.state.longctx`)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from longctx.checkpoint.generation_config import load_generation_config
from longctx.errors import clipped
from longctx.server import messages as m
from longctx.server.engine_client import EngineClient
from longctx.server.engine_proc import EngineSpec
from longctx.server.metrics import Metrics
from longctx.server.protocol import ApiError, validation_error
from longctx.server.text import TextCodec

M = TypeVar("M", bound=BaseModel)
BIG_TEXT = 100_000  # tokenise texts longer than this off the event loop
_SURROGATE = re.compile("[\ud800-\udfff]")
log = logging.getLogger("longctx.server")


@dataclass(frozen=True)
class ServerSettings:
    """What `longctx serve` was asked for."""

    spec: EngineSpec
    served_model_name: str
    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 128 * 2**20
    drain_timeout_s: float = 30.0
    engine_start_timeout_s: float = 1800.0
    reasoning_parser: str = (
        "none"  # "glm" / "deepseek_v3": chat outputs' <think> blocks to `reasoning_content`
    )
    tool_call_parser: str = "glm"  # the format "auto" tool calls are read in (a key of `tools.FORMATS`)
    generation_config: str = "auto"  # "auto": requests' unset sampling fields from generation_config.json
    chat_template: str | None = None  # a template instead of the model directory's (`--chat-template`)


@dataclass
class Document:
    id: str
    engine_id: str
    name: str | None
    ids: list[int]  # tokens of `prefix_text`: chat-template head + document text
    prefix_text: str
    text_chars: int
    created: int = field(default_factory=lambda: int(time.time()))

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "document",
            "name": self.name,
            "tokens": len(self.ids),
            "characters": self.text_chars,
            "created": self.created,
        }


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.codec = TextCodec(settings.spec.model_dir, settings.chat_template)
        # the sampling defaults of the model's generation_config.json (`--generation-config auto`)
        self.sampling_defaults: dict[str, Any] = {}
        if settings.generation_config == "auto" and Path(settings.spec.model_dir).is_dir():
            self.sampling_defaults = load_generation_config(settings.spec.model_dir).sampling()
            if self.sampling_defaults:
                log.info(
                    "sampling defaults from the model's generation_config.json: %s", self.sampling_defaults
                )
        self.metrics = Metrics()
        self.client = EngineClient(settings.spec)
        self.documents: dict[str, Document] = {}
        self.draining = False

    @property
    def ready(self) -> m.EngineReady:
        assert self.client.ready is not None
        return self.client.ready

    @property
    def max_context(self) -> int:
        r = self.client.ready
        return r.max_context if r is not None else self.settings.spec.max_context

    def model_names(self) -> set[str]:
        return {self.settings.served_model_name, self.settings.spec.model_dir}

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names():
            raise ApiError(
                404,
                f"The model {_shown(name)} does not exist; this server serves `{self.settings.served_model_name}`",
                param="model",
                code="model_not_found",
            )

    def check_admission(self, n: int = 1) -> None:
        """Whether `n` more engine requests may queue (a request's n choices are n engine requests)."""
        if self.draining:
            raise ApiError(503, "server is shutting down", "server_error", code="shutting_down")
        if not self.client.healthy:
            raise ApiError(
                503, f"engine unavailable: {self.client.dead_reason}", "server_error", code="engine_dead"
            )
        if self.client.num_queued() + n > self.settings.max_queue:
            raise ApiError(
                429,
                f"too many queued requests (limit {self.settings.max_queue}); retry later",
                "rate_limit_error",
                code="queue_full",
            )

    async def encode(
        self, text: str, add_special_tokens: bool = False, param: str = "prompt", fits: bool = True
    ) -> list[int]:
        """`text`'s tokens; with `fits` (no truncation asked for) a text that cannot fit the context
        whatever its tokens is a 400 at once."""
        if len(text) <= BIG_TEXT:
            return self.codec.encode(text, add_special_tokens)
        if fits and (least := self.codec.min_tokens(text)) > self.max_context:
            raise ApiError(
                400,
                f"the {param} has at least {least} tokens, more than the maximum context of {self.max_context}",
                param=param,
                code="context_length_exceeded",
            )
        return await asyncio.to_thread(self.codec.encode, text, add_special_tokens)

    def refresh_metrics(self) -> None:
        c = self.client
        self.metrics.update_engine(c.stats, c.num_waiting, c.num_running, c.healthy)
        self.metrics.in_flight.set(c.num_in_flight())
        self.metrics.documents.set(len(self.documents))


def get_state(request: Request) -> ServerState:
    return request.app.state.longctx


async def read_json(request: Request, model: type[M]) -> M:
    """Body -> validated model; any malformed input is ApiError(400) (413 when too large)."""
    st = get_state(request)
    body = await read_body(request, st.settings.max_body_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8"
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    except RecursionError:  # (Python's limits, said in Python's words before: "maximum recursion depth ...")
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    except ValueError:  # (an integer past int()'s 4300 digits: "... use sys.set_int_max_str_digits()")
        raise ApiError(
            400, "request body has a number of more than 4300 digits", code="invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if "\\u" in text and _has_lone_surrogate(obj):  # (only a \u escape can make one)
        raise ApiError(
            400,
            "request body has an unpaired surrogate escape (\\ud800-\\udfff): not valid Unicode",
            code="invalid_utf8",
        )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether a string (or key) in parsed JSON holds a surrogate code point: json.loads joins an escaped
    pair into one character, so what is left is unpaired, which no tokenizer or UTF-8 response takes."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


async def read_body(request: Request, limit: int) -> bytes:
    return b"".join([chunk async for chunk in body_stream(request, limit)])


async def body_stream(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The request body in chunks as they arrive; past `limit` bytes (declared or sent) a 413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="body_too_large")
    n = 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"request body larger than {limit} bytes", code="body_too_large")
            yield chunk
    except ClientDisconnect:  # (hung up mid-body: nobody reads this answer, and it is no server error)
        raise ApiError(
            499, "client disconnected while sending the body", code="client_disconnected"
        ) from None


def _shown(name: str, limit: int = 200) -> str:
    """A client's model name as an error repeats it: as given in backticks, or (a name with a line break or
    another unprintable character, or one past `limit` characters) its repr, cut, so the message stays one
    short line."""
    if len(name) > limit:
        return clipped(name, limit)
    return f"`{name}`" if name.isprintable() else repr(name)
