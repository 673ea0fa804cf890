"""One generation as a stream of events: prefill progress, text deltas, the finish.

Turns the engine's token outputs into text (incremental detokenizer), applies stop strings
(truncating the text and aborting the engine request so its pages come back early), records
latency metrics, and guarantees the engine request is aborted if the consumer goes away.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from longctx.engine.request import find_stop
from longctx.errors import EngineDeadError
from longctx.server import messages as m
from longctx.server.engine_client import EngineClient
from longctx.server.metrics import Metrics
from longctx.server.protocol import ApiError, engine_error
from longctx.server.text import IncrementalDetokenizer, TextCodec

KEEPALIVE_S = 1.0  # a quiet stream (queued request) still yields, so disconnects are noticed


@dataclass
class Progress:
    done: int
    total: int


@dataclass
class Keepalive:
    pass


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[m.WireLogprob]


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[m.WireLogprob] = field(default_factory=list)


Event = Progress | Keepalive | Delta | Done


def new_rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    """Drive one request through the engine; iterate `events()` exactly once."""

    def __init__(
        self,
        client: EngineClient,
        codec: TextCodec,
        metrics: Metrics,
        rid: str,
        prompt_ids: list[int],
        params: m.WireSamplingParams,
        stop: list[str],
    ) -> None:
        self.client, self.codec, self.metrics = client, codec, metrics
        self.rid, self.prompt_ids, self.params, self.stop = rid, prompt_ids, params, stop
        self.t0 = time.monotonic()
        self.prefilled = asyncio.Event()  # set once the prompt is prefilled (or this ended)
        self.after: asyncio.Event | None = None  # submit only once this is set (another's `prefilled`)
        self.prompt_logprobs: list[m.WireLogprob] = []  # prompt tokens 1.. (params.prompt_logprobs)
        self.echo_text = ""  # the prompt as a completions `echo` repeats it

    async def events(self, keepalive: bool = False) -> AsyncGenerator[Event, None]:
        detok = IncrementalDetokenizer(self.codec)
        holdback = max((len(s) for s in self.stop), default=1) - 1
        text = ""  # everything decoded so far (stop strings are searched in it)
        # no stop string may end within the first min_tokens tokens' text (its length, once they are in)
        floor: int | None = 0 if self.params.min_tokens == 0 else None
        emitted = 0  # chars of `text` already yielded
        ids: list[int] = []
        lps: list[m.WireLogprob] = []
        cached = 0
        last_tok_t: float | None = None
        finished = False
        try:
            if self.after is not None:  # (the prompt's pages are in the prefix cache by then)
                await self.after.wait()
            handle = await self.client.submit(self.rid, self.prompt_ids, self.params)
            self.metrics.prompt_tokens.inc(len(self.prompt_ids))
            while True:
                out = await handle.get(KEEPALIVE_S if keepalive else None)
                if out is None:
                    yield Keepalive()
                    continue
                if out.error:
                    finished = True
                    raise engine_error(out.error, out.error_code, out.error_param)
                cached = max(cached, out.cached_tokens)
                self.prompt_logprobs.extend(out.prompt_logprobs)
                if not out.new_token_ids and not out.finished:
                    yield Progress(out.prompt_done, out.prompt_total)
                    continue
                self.prefilled.set()
                now = time.monotonic()
                n = len(out.new_token_ids)
                if n:
                    if last_tok_t is None:
                        self.metrics.ttft.observe(now - self.t0)
                    else:
                        for _ in range(n):
                            self.metrics.itl.observe((now - last_tok_t) / n)
                    last_tok_t = now
                    self.metrics.add_tokens(n)
                ids.extend(out.new_token_ids)
                lps.extend(out.logprobs)
                text += detok.add(out.new_token_ids)
                if floor is None and len(ids) >= self.params.min_tokens:
                    floor = len(text)
                reason = out.finish_reason if out.finished else None
                if out.finished:
                    finished = True
                    text += detok.flush()
                    if reason == "abort":
                        raise ApiError(503, "request aborted by the server", "server_error")
                cut = None
                if floor is not None:
                    include = self.params.include_stop_str_in_output
                    cut = find_stop(text, self.stop, emitted - holdback, floor, include)
                if cut is not None:
                    text = text[:cut]
                    reason = "stop"
                    if not finished:
                        finished = True
                        await self.client.abort(self.rid)
                end = len(text) if reason else max(emitted, len(text) - holdback)
                if end > emitted or n:
                    yield Delta(text[emitted:end], list(out.new_token_ids), list(out.logprobs))
                    emitted = end
                if reason:
                    self.metrics.e2e.observe(time.monotonic() - self.t0)
                    yield Done(reason, len(self.prompt_ids), len(ids), cached, text, ids, lps)
                    return
        except EngineDeadError as e:
            finished = True
            raise ApiError(503, f"engine unavailable: {e}", "server_error", code="engine_dead") from e
        finally:
            self.prefilled.set()
            if not finished:
                await self.client.abort(self.rid)  # client went away or was cancelled

    async def collect(self) -> Done:
        """Run to completion (non-streaming)."""
        async for ev in self.events():
            if isinstance(ev, Done):
                return ev
        raise ApiError(500, "generation ended without a result", "server_error")
