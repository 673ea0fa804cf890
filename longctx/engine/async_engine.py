"""`AsyncEngine`: an asyncio API over one `Engine` (what vLLM's AsyncLLM and SGLang's async_generate give).

One background thread drives `Engine.step()` while any of its requests is in flight and sleeps on a
condition while none is, or, after a step that moved none of them (their pages held by other threads'
requests, say), until the engine reports a change that could let them move (`Engine.watch`). Requests
enter and leave the engine on that thread, between steps, so no coroutine ever waits for the engine's
lock (held for a whole step): the event loop is never blocked by a step. Each request's outputs go to
its own `asyncio.Queue`, on the loop that asked for it, through `loop.call_soon_threadsafe`. Leaving a
stream early (`break`, `aclose`, a cancelled task) aborts its request, so it stops holding a batch row and
KV pages.

Blocking calls (`Engine.generate`, `score`, `pin_document`) made from other threads keep working beside
the driver: whichever thread runs a step, the engine posts a blocking call's outputs to that call's
mailbox and keeps the step-API requests' (the driver's) for the driver's next `step()`. The one thing
that cannot share an engine with an AsyncEngine is another step-API consumer: its `step()` would take
the driver's outputs (and the driver its).

Of the engine it uses the public API and the step-API driver's contract (`Engine.turn`, `give_way`,
`admit`, `has_held_outputs`, `lost`, `fail_others`, `completion`, `closed`, `watch`), nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longctx.engine.engine import Completion, Engine
from longctx.engine.request import FinishReason, Request, SamplingParams, StepOutput, as_token_ids
from longctx.errors import EngineDeadError, RequestError, one_line

log = logging.getLogger("longctx.async_engine")

# The longest the driver waits before stepping again after a step that moved none of its requests: a
# safety net only, as the wait ends at the engine's next change (`Engine.watch`: another thread's step,
# an abort, an unpinned document) or a new request or abort of this API.
_STALLED_WAIT_S = 0.1


def _closed() -> Exception:
    return RequestError("the engine is closed")  # (the words of the engine's own calls once closed)


@dataclass(eq=False)
class _Stream:
    """One request of the async API: its outputs go to `queue`, on `loop`. A queued exception ends it."""

    req: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput | BaseException]
    kind: str | None  # the request id is drawn by the engine (`Engine.admit(req, kind)`) as it is added


class AsyncEngine:
    """An `Engine` driven by one background thread, for asyncio callers.

    `generate` streams one request's step outputs; `complete` returns its `Completion`, as
    `Engine.generate` does for one prompt; `score` returns `Engine.score`'s logits. Bad input raises the
    sync path's `RequestError`: a bad prompt or SamplingParams at the call, what the engine refuses (a
    token outside the vocabulary, a prompt too long, a request id in use) at the stream's first step;
    other requests go on as they were. A step that raises fails the requests it held (each of their
    streams raises `RequestError` with the step's error, as a blocking call in another thread does) and
    the engine serves on; a dead stage (`EngineDeadError`) or a closed engine ends every stream.

    `close()` (or leaving `async with`) ends the streams in flight with `RequestError("the engine is
    closed")`, stops the thread and, unless `close_engine=False`, closes the engine.
    """

    def __init__(self, engine: Engine, *, close_engine: bool = True) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"AsyncEngine takes an Engine, got {type(engine).__name__}")
        self.engine = engine
        self.close_engine = close_engine
        self._cond = threading.Condition()
        # guarded by _cond: what the driver is to do next, in the order asked (an abort after its add),
        # whether close() was called, and why no request can be added any more (None: they can)
        self._inbox: list[tuple[str, Any]] = []
        self._closing = False
        self._ended: Callable[[], Exception] | None = None
        self._changed = False  # guarded by _cond: the engine changed since the driver's last step
        self._live: dict[str, _Stream] = {}  # the driver thread's: requests in the engine, by id
        engine.watch(self._wake)
        self._thread = threading.Thread(target=self._drive, name="longctx-async-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model_dir: str | Path, **kwargs: Any) -> AsyncEngine:
        """`AsyncEngine(Engine(model_dir, **kwargs))`; the engine is closed with it. (Loading blocks: call it
        before the event loop runs, or in a thread.)"""
        return cls(Engine(model_dir, **kwargs))

    # ---- public API ------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream the request's `StepOutput`s, one a step that moved it (a prefill chunk's: no tokens, a
        larger `prompt_done`), the last one `finished`. The tokens of a stop string are streamed; the
        Completion of `complete` cuts its text there, as `Engine.generate` does. Leaving the stream before
        that output aborts the request. `request_id`: the caller's (a string no request in the engine
        has), else one is drawn."""
        return self._stream(self._request(prompt, params, request_id), None if request_id else "async")

    async def complete(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Completion:
        """The finished request as `Engine.generate` returns it: token ids, text, finish reason, logprobs."""
        req = self._request(prompt, params, request_id)
        lps: list[Any] = []
        prompt_lps: list[Any] = []
        async for o in self._stream(req, None if request_id else "async"):
            lps.extend(o.logprobs)
            prompt_lps.extend(o.prompt_logprobs)
        return self.engine.completion(req, lps, prompt_lps)

    async def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [n, vocab] at every position of `token_ids`, as `Engine.score` (cancelling aborts)."""
        ids = as_token_ids(token_ids, "token_ids")
        req = Request("", ids, SamplingParams(max_new_tokens=0), return_logits=True)
        async for _ in self._stream(req, "async-score"):
            pass
        return torch.cat([t.float() for t in req.logits], dim=0)

    def abort(self, request_id: str) -> None:
        """Abort a request of this engine's streams by its id: its stream ends with a finished output of
        finish reason `abort`. An id of no running stream is ignored."""
        self._post("abort_id", request_id)

    async def stats(self) -> dict[str, Any]:
        """`Engine.stats()` (read on an executor thread: it waits for the step that is running), with
        `async_streams`, the requests in flight through this API."""
        s = await asyncio.get_running_loop().run_in_executor(None, self.engine.stats)
        s["async_streams"] = len(self._live)
        return s

    async def reset_prefix_cache(self) -> dict[str, int]:
        """`Engine.reset_prefix_cache()` on an executor thread (it takes its turn between steps); streams in
        flight go on, their pages kept."""
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.reset_prefix_cache)

    async def close(self) -> None:
        """End the streams in flight with `the engine is closed`, stop the thread (after the step it is
        running) and close the engine unless `close_engine=False`. Idempotent."""
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def shutdown(self) -> None:
        """`close()` for a caller outside an event loop (it blocks for the running step)."""
        with self._cond:
            self._closing = True
            if self._ended is None:
                self._ended = _closed
            self._cond.notify()
        self._thread.join()
        if self.close_engine:
            self.engine.close()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- the caller's side -------------------------------------------------------------------------
    def _request(
        self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str | None
    ) -> Request:
        """The request of one call, its params checked once (before its prompt is read, as `Engine.generate`
        checks them); the checks that need the engine's state (`Engine.admit`) run on the driver."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"a request id must be a string, got {type(request_id).__name__}")
        if isinstance(prompt, str):
            ids = self.engine.encode(prompt)
        else:
            ids = as_token_ids(prompt, "prompt")
        return Request(request_id or "", ids, params)

    async def _stream(self, req: Request, kind: str | None) -> AsyncIterator[StepOutput]:
        guided = req.params.guided
        if guided and not self.engine.guide_ready(guided):
            # a new guide compiles on a worker thread, not in the driver's turn (it would stall every
            # running request meanwhile)
            await asyncio.to_thread(self.engine.prepare_guide, guided)
        s = _Stream(req, asyncio.get_running_loop(), asyncio.Queue(), kind)
        self._post("add", s)
        done = False
        try:
            while not done:
                item = await s.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                if item.error is not None:
                    raise RequestError(item.error)
                yield item
        finally:
            if not done:  # left early: a break, aclose, a cancelled task, an error in the consumer
                self._post("abort", s)

    def _post(self, what: str, arg: Any) -> None:
        with self._cond:
            if self._ended is None:
                self._inbox.append((what, arg))
                self._cond.notify()
                return
            ended = self._ended
        if what == "add":  # (aborts need nothing: nothing runs any more)
            arg.queue.put_nowait(ended())

    # ---- the driver thread --------------------------------------------------------------------------
    def _wake(self) -> None:
        """`Engine.watch`'s call (in the turn of the thread that changed the engine): wake the driver."""
        with self._cond:
            self._changed = True
            self._cond.notify()

    def _drive(self) -> None:
        try:
            self._run()
        except BaseException as e:  # a bug here would leave every stream waiting forever: end them
            log.error("the async engine's driver failed:\n%s", traceback.format_exc())
            err = one_line(e)
            self._end(lambda: RequestError(f"the async engine failed: {err}"))
        finally:
            self.engine.unwatch(self._wake)

    def _run(self) -> None:
        eng = self.engine
        stalled = False
        while True:
            with self._cond:
                while not (self._inbox or self._closing or self._live):
                    self._cond.wait()
                if stalled:  # until something could let its requests move (the timeout: a safety net)
                    self._cond.wait_for(
                        lambda: self._inbox or self._closing or self._changed, _STALLED_WAIT_S
                    )
                inbox, self._inbox = self._inbox, []
                closing = self._closing
            if inbox:
                with eng.turn():
                    for what, arg in inbox:
                        if what == "add":
                            self._add(arg, closing)
                        elif what == "abort":
                            self._abort(arg)
                        else:
                            self._abort_id(arg)
            if closing:
                with eng.turn():
                    for rid in self._live:
                        with contextlib.suppress(Exception):
                            eng.abort(rid)
                self._end(_closed)
                return
            if self._live:
                stalled = not self._step()
                eng.give_way()  # (blocking calls of other threads waiting for the lock go first)

    def _add(self, s: _Stream, closing: bool) -> None:
        """Into the engine (under its lock), or the error why not into the stream."""
        eng, req = self.engine, s.req
        try:
            if closing or eng.closed:
                raise _closed()
            if s.kind is None and req.rid in self._live:  # (finished in the engine, not out of step() yet)
                raise RequestError(f"duplicate request id {req.rid!r}")
            eng.admit(req, s.kind)
        except Exception as e:
            self._put(s, e)
            return
        self._live[req.rid] = s

    def _abort(self, s: _Stream) -> None:
        rid = s.req.rid
        if self._live.get(rid) is s:  # (not a later request that took the id after this one finished)
            del self._live[rid]
            try:
                self.engine.abort(rid)
            except Exception:
                log.error("abort %s failed:\n%s", rid, traceback.format_exc())

    def _abort_id(self, rid: str) -> None:
        s = self._live.get(rid)
        if s is not None:
            self._abort(s)
            self._put(s, StepOutput(rid, finished=True, finish_reason=FinishReason.ABORT))

    def _step(self) -> bool:
        """One engine step, its outputs to their streams; whether any of this engine's requests moved."""
        eng = self.engine
        moved = False
        # one turn through a failure's handling, as a blocking call's step holds the lock: no other thread
        # steps over the failed step's half-written requests before they are failed
        with eng.turn():
            # what another thread's step kept for this one comes out of `step()` without a step: then step
            # too, or a blocking call in another thread would run every step while this thread only read
            for _ in range(2 if eng.has_held_outputs() else 1):
                try:
                    outs = eng.step()
                except Exception as e:
                    self._step_failed(e)
                    return True
                for o in outs:
                    s = self._live.get(o.rid)
                    if s is None:  # aborted meanwhile (or another step-API caller's: see the module's doc)
                        continue
                    moved = True
                    if o.finished:
                        del self._live[o.rid]
                    self._put(s, o)
            if not moved:
                self._end_lost()
            with self._cond:  # (what changes the engine from here on is another thread's turn)
                self._changed = False
        return moved

    def _end_lost(self) -> None:
        """After a step that moved none of them: end the streams whose request the engine no longer has and
        will report nothing more of (aborted through `Engine.abort` by someone else) with an abort output."""
        for rid in self.engine.lost(self._live):
            self._put(self._live.pop(rid), StepOutput(rid, finished=True, finish_reason=FinishReason.ABORT))

    def _step_failed(self, e: Exception) -> None:
        """`Engine.fail_others` for the driver's step (in its turn): the requests the step held are aborted,
        this engine's streams among them end with the step's error, other threads' blocking calls get it in
        their mailboxes. The requests still waiting stay queued."""
        eng = self.engine
        if eng.closed:  # (Engine.close from another thread: no step will run again)
            self._end(_closed)
            return
        if isinstance(e, EngineDeadError):
            msg = str(e)
            log.error("engine failed: %s", msg)
            self._end(lambda: EngineDeadError(msg))
            return
        log.error("engine step failed:\n%s", traceback.format_exc())
        err = one_line(e)
        failed = eng.fail_others(e, set(self._live))  # (other threads' requests: their mailboxes)
        if failed is None:  # (every later step fails with it anyway: fail ours now)
            log.error("could not tell the failed step's requests apart")
            failed = list(self._live)
            for rid in failed:
                with contextlib.suppress(Exception):
                    eng.abort(rid)
        for rid in failed:
            s = self._live.pop(rid, None)
            if s is not None:
                self._put(s, StepOutput(rid, finished=True, finish_reason=FinishReason.ERROR, error=err))

    def _end(self, error: Callable[[], Exception]) -> None:
        """No request can be added any more: every stream in flight or asked for ends with `error()`."""
        with self._cond:
            if self._ended is None:
                self._ended = error
            inbox, self._inbox = self._inbox, []
        for what, arg in inbox:
            if what == "add":
                self._put(arg, error())
        live, self._live = self._live, {}
        for s in live.values():
            self._put(s, error())

    def _put(self, s: _Stream, item: StepOutput | BaseException) -> None:
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody will read the stream, so stop its request
            if self._live.pop(s.req.rid, None) is s:
                with contextlib.suppress(Exception):
                    self.engine.abort(s.req.rid)


__all__ = ["AsyncEngine"]
