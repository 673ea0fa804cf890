"""The engine process: owns an `Engine`, talks to the frontend over two ZMQ PUSH/PULL sockets.

Loop: drain every pending message (add / abort / pin / unpin / stats / prefix-cache reset /
shutdown), run one `step()` when there is work, send one `OutputBatch` with everything that
progressed. A bad request becomes an error output for that rid only; the loop itself never raises.
It exits on `Shutdown`, or when the frontend process disappears (so a killed server leaves no orphan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq

from longctx.engine.request import Request, SamplingParams
from longctx.errors import EngineDeadError, LongctxError, one_line
from longctx.server import messages as m

log = logging.getLogger("longctx.engine_proc")

STATS_EVERY_S = 0.25  # how often queue/page stats ride along with the outputs
COMPILE_POLL_MS = 2  # an idle loop's wait for messages while a guide compiles


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build the engine in the child (picklable for 'spawn')."""

    model_dir: str
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "auto"
    pp: int = 1
    tp: int = 1
    hisparse_device_tokens: int | None = None
    max_context: int = 1_048_576
    backend: str = "auto"
    index_topk: int | None = None
    index_local_window: int | None = None
    index_topk_long: int | None = None
    index_topk_long_from: int | None = None
    kv_fp8_skip_layers: tuple[int, ...] | None = None
    scheduling_policy: str = "fcfs"
    kv_pages: int | None = None
    chunk_size: int | None = None
    max_running: int = 64
    cuda_graphs: bool | None = None
    fake: dict[str, Any] | None = field(default=None)  # FakeEngine options; None = the real Engine
    # after a SIGTERM of its own (a whole process group signalled: systemd, `timeout`), how long the
    # engine keeps serving while its frontend drains and then shuts it down
    term_grace_s: float = 60.0


def build_engine(spec: EngineSpec) -> Any:
    if spec.fake is not None:
        from longctx.server.fake_engine import FakeEngine

        return FakeEngine(max_context=spec.max_context, **spec.fake)
    from longctx import Engine
    from longctx.engine.args import engine_kwargs

    return Engine(spec.model_dir, **engine_kwargs(spec))


def _kv_info(eng: Any) -> str:
    """The engine's KV cache for the startup log: "fp8", "fp8 (layers 4 in the model dtype)", ..."""
    kinds = getattr(eng, "kv_kinds", None)
    if kinds is None:
        return "-"
    kept = sorted(kinds.model_layers)
    return kinds.base + (f" (layers {','.join(map(str, kept))} in the model dtype)" if kept else "")


def _eos_ids(cfg: Any) -> tuple[int, ...]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _wire_logprobs(lps: Any) -> tuple[m.WireLogprob, ...]:
    return tuple(
        m.WireLogprob(
            int(lp.token_id),
            float(lp.logprob),
            tuple((int(t), float(p)) for t, p in lp.top),
            None if lp.rank is None else int(lp.rank),
        )
        for lp in lps
    )


def _wire_output(o: Any) -> m.TokenOutput:
    reason = o.finish_reason.value if o.finish_reason is not None else None
    lps = _wire_logprobs(o.logprobs)
    return m.TokenOutput(
        rid=o.rid,
        new_token_ids=tuple(int(t) for t in o.new_token_ids),
        finished=bool(o.finished),
        finish_reason=reason,
        prompt_done=int(o.prompt_done),
        prompt_total=int(o.prompt_total),
        cached_tokens=int(o.cached_tokens),
        logprobs=lps,
        error=o.error,
        prompt_logprobs=_wire_logprobs(o.prompt_logprobs),
    )


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def sampling_params(p: m.WireSamplingParams) -> SamplingParams:
    """The engine's sampling params of a request off the wire: field for field (the two dataclasses keep
    the same fields, tests/test_server_messages.py), any list (a message built in process) as a tuple."""
    return SamplingParams(**{f.name: _tuples(getattr(p, f.name)) for f in dataclasses.fields(p)})


class EngineLoop:
    """The message/step loop around one engine; separate from `main` so tests can drive it."""

    def __init__(
        self,
        engine: Any,
        pull: zmq.Socket,
        push: zmq.Socket,
        parent_pid: int | None = None,
        term_at: list[float] | None = None,
        term_grace_s: float = 60.0,
    ):
        self.eng = engine
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.live: set[str] = set()
        self.pins: dict[str, tuple[int, list[int]]] = {}  # rid of a document prefill -> (call id, ids)
        self.doc_keys: dict[str, list[bytes]] = {}  # pinned document -> its prefix-cache keys
        self.stop = False
        self.dead: str | None = None  # why the engine can run no more steps
        self._last_stats = 0.0
        # when a SIGTERM came, if one did (`main`'s handler fills it); then the loop ends at the latest
        # term_grace_s later
        self.term_at = term_at if term_at is not None else []
        self.term_grace_s = term_grace_s
        # requests waiting for their guide to compile (rid -> (the compile, the request)), and the thread
        self.compiling: dict[str, tuple[Future, m.AddRequest]] = {}
        self._compiler: ThreadPoolExecutor | None = None

    def _handle(self, msg: Any, outs: list[m.TokenOutput]) -> None:
        if isinstance(msg, m.AddRequest):
            if msg.params.guided and self._compile_first(msg):
                return
            try:
                params = sampling_params(msg.params)
                req = Request(
                    msg.rid, list(msg.prompt_ids), params, arrival=time.time(), pin_prefix=msg.pin_prefix
                )
                self.eng.add_request(req)
                self.live.add(msg.rid)
            except Exception as e:
                self._add_failed(msg.rid, e, outs)
        elif isinstance(msg, m.AbortRequest) and msg.rid in self.compiling:
            del self.compiling[msg.rid]  # (its guide still goes into the cache)
            outs.append(m.TokenOutput(msg.rid, finished=True, finish_reason="abort"))
        elif isinstance(msg, m.AbortRequest):
            if msg.rid in self.live:
                self.live.discard(msg.rid)
                try:
                    self.eng.abort(msg.rid)
                except Exception:
                    log.error("abort %s failed:\n%s", msg.rid, traceback.format_exc())
                outs.append(m.TokenOutput(msg.rid, finished=True, finish_reason="abort"))
            elif msg.rid in self.pins:  # a document upload whose client hung up
                call_id, _ = self.pins.pop(msg.rid)
                with contextlib.suppress(Exception):
                    self.eng.abort(msg.rid)
                self.push.send(m.encode(m.RpcReply(call_id, False, error="document upload cancelled")))
            elif msg.rid in self.doc_keys:  # ... that had just finished: nobody learnt its id
                self.eng.prefix_cache.unpin_keys(self.doc_keys.pop(msg.rid))
        elif isinstance(msg, m.PinDocument) and self._pins_in_loop():
            self._start_pin(msg)
        elif isinstance(msg, (m.PinDocument, m.UnpinDocument, m.StatsQuery, m.ResetPrefixCache)):
            try:
                if isinstance(msg, m.PinDocument):
                    doc_id, n = self.eng.pin_document(list(msg.token_ids))
                    result: Any = [str(doc_id), int(n)]
                elif isinstance(msg, m.UnpinDocument):
                    keys = self.doc_keys.pop(msg.doc_id, None)
                    if keys is not None:
                        self.eng.prefix_cache.unpin_keys(keys)
                    else:
                        self.eng.unpin_document(msg.doc_id)
                    result = None
                elif isinstance(msg, m.ResetPrefixCache):
                    result = self.eng.reset_prefix_cache()
                else:
                    result = self._stats()
                reply = m.RpcReply(msg.call_id, True, result)
            except LongctxError as e:
                reply = m.RpcReply(msg.call_id, False, error=str(e), error_code=e.code)
            except Exception as e:
                log.error("rpc failed:\n%s", traceback.format_exc())
                reply = m.RpcReply(msg.call_id, False, error=one_line(e))
            self.push.send(m.encode(reply))
        elif isinstance(msg, m.Shutdown):
            self.stop = True
        else:
            log.error("unknown message %r", type(msg).__name__)

    @staticmethod
    def _add_failed(rid: str, e: Exception, outs: list[m.TokenOutput]) -> None:
        """A request that could not be added ends at once: the request's fault (a LongctxError) with its code
        and field, any other with its type and first line."""
        if isinstance(e, LongctxError):
            err = m.TokenOutput(
                rid,
                finished=True,
                finish_reason="error",
                error=str(e),
                error_code=e.code,
                error_param=e.param,
            )
        else:
            log.error("add_request %s failed:\n%s", rid, "".join(traceback.format_exception(e)))
            err = m.TokenOutput(rid, finished=True, finish_reason="error", error=one_line(e))
        outs.append(err)

    # ---- guides ---------------------------------------------------------------------------------
    # A new guide's automaton takes the engine from a few ms to a second or two to compile (JSON mode
    # 0.25 s). Compiled in `_handle`, it stalled every running request that long; here a worker thread
    # compiles it and the request is added when it is ready (`_admit_compiled`, each loop turn).
    def _compile_first(self, msg: m.AddRequest) -> bool:
        """Whether `msg` waits for its guide: one this engine compiles and has not yet."""
        ready = getattr(self.eng, "guide_ready", None)
        if ready is None or ready(msg.params.guided):
            return False
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="guide-compile")
        self.compiling[msg.rid] = (self._compiler.submit(self.eng.prepare_guide, msg.params.guided), msg)
        return True

    def _admit_compiled(self, outs: list[m.TokenOutput]) -> None:
        for rid, (fut, msg) in list(self.compiling.items()):
            if fut.done():
                del self.compiling[rid]
                exc = fut.exception()
                if exc is None:
                    self._handle(msg, outs)  # (added now: its guide is cached)
                else:
                    self._add_failed(rid, exc if isinstance(exc, Exception) else RuntimeError(exc), outs)

    # ---- documents ----------------------------------------------------------------------------
    # `Engine.pin_document` runs its own step loop, which would swallow other requests' outputs
    # and stall them for the whole document. Engines with a prefix cache get the same effect
    # without blocking: the document is an ordinary `pin_prefix` request (chunked prefill,
    # interleaved with decodes); when it finishes its pages are cached and pinned, and the loop
    # records their keys for the unpin.
    def _pins_in_loop(self) -> bool:
        cache = getattr(self.eng, "prefix_cache", None)
        return cache is not None and hasattr(cache, "pin_prefix") and hasattr(cache, "unpin_keys")

    def _start_pin(self, msg: m.PinDocument) -> None:
        rid = m.pin_rid(msg.call_id)
        ids = list(msg.token_ids)
        try:
            self.eng.add_request(Request(rid, ids, SamplingParams(max_new_tokens=0), pin_prefix=True))
        except LongctxError as e:
            self.push.send(m.encode(m.RpcReply(msg.call_id, False, error=str(e), error_code=e.code)))
            return
        self.pins[rid] = (msg.call_id, ids)

    def _finish_pin(self, out: Any) -> None:
        call_id, ids = self.pins.pop(out.rid)
        if out.error or (out.finish_reason is not None and out.finish_reason.value in ("error", "abort")):
            reply = m.RpcReply(call_id, False, error=out.error or "document prefill was aborted")
        else:
            cache = self.eng.prefix_cache
            keys = cache.pin_prefix(ids)  # take our own pin to learn the keys...
            cache.unpin_keys(keys)  # ...and drop it: the request's pin (taken on release) remains
            self.doc_keys[out.rid] = keys
            reply = m.RpcReply(call_id, True, [out.rid, len(ids)])
        self.push.send(m.encode(reply))

    def _stats(self) -> dict[str, Any]:
        s = dict(self.eng.stats())
        s["num_waiting"] = int(self.eng.num_waiting())
        s["num_running"] = int(self.eng.num_running())
        s["documents"] = len(self.doc_keys)
        # msgpack carries plain scalars; nested dicts ({"prefix_cache": {"hit_tokens"}}) flatten
        # one level to "prefix_cache_hit_tokens"
        flat: dict[str, Any] = {}
        for k, v in s.items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    if isinstance(v2, (int, float, str, bool)):
                        flat[f"{k}_{k2}"] = v2
            elif isinstance(v, (int, float, str, bool)) or v is None:
                flat[str(k)] = v
        return flat

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def run_once(self, idle_timeout_ms: int = 50) -> None:
        outs: list[m.TokenOutput] = []
        self._admit_compiled(outs)
        timeout = 0 if self.eng.has_work() else COMPILE_POLL_MS if self.compiling else idle_timeout_ms
        if self.pull.poll(timeout):
            while True:
                try:
                    raw = self.pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = m.decode(raw)
                except ValueError as e:
                    log.error("%s", e)
                    continue
                self._handle(msg, outs)
        if self.eng.has_work() and not self.stop:
            try:
                step_outs = self.eng.step()
            except Exception as e:
                self._step_failed(e, outs)
                step_outs = []
            for o in step_outs:
                if o.rid in self.pins:
                    if o.finished:
                        self._finish_pin(o)
                    continue
                if o.rid not in self.live:
                    continue  # aborted while the step ran, or a pinned document's internal request
                outs.append(_wire_output(o))
                if o.finished:
                    self.live.discard(o.rid)
        now = time.monotonic()
        stats = None
        if now - self._last_stats >= STATS_EVERY_S:
            self._last_stats = now
            try:
                stats = self._stats()
            except Exception:
                log.error("stats failed:\n%s", traceback.format_exc())
        if outs or stats is not None:
            batch = m.OutputBatch(
                tuple(outs), int(self.eng.num_waiting()), int(self.eng.num_running()), stats
            )
            self.push.send(m.encode(batch))
        if self.dead is not None:
            # tell the frontend (503s and an unhealthy /health from now on, not one 500 per request)
            # and exit
            self.push.send(m.encode(m.EngineFailed(self.dead)))
            self.stop = True

    def _step_failed(self, e: Exception, outs: list[m.TokenOutput]) -> None:
        """A failed step poisons the requests in it: fail those (500s) and keep serving the rest,
        the waiting ones included (`Engine.fail_step`). A dead stage (EngineDeadError) means no
        step will run again: the requests and pins are not failed one by one but all at once by the
        EngineFailed that `run_once` sends, which the frontend turns into 503 engine_dead, as for a
        dead engine process."""
        err = one_line(e)
        failed: set[str] | None = None  # None: every request
        if isinstance(e, EngineDeadError):  # its message names the stage and why
            self.dead = err
            log.error("engine failed: %s", err)
        else:
            log.error("engine step failed:\n%s", traceback.format_exc())
            try:
                failed = set(self.eng.fail_step())
            except Exception:
                log.error("could not tell the failed step's requests apart:\n%s", traceback.format_exc())
        for rid in [r for r in self.live if failed is None or r in failed]:
            with contextlib.suppress(Exception):
                self.eng.abort(rid)
            self.live.discard(rid)
            if self.dead is None:
                outs.append(m.TokenOutput(rid, finished=True, finish_reason="error", error=err))
        for rid, (call_id, _) in [(r, c) for r, c in self.pins.items() if failed is None or r in failed]:
            with contextlib.suppress(Exception):
                self.eng.abort(rid)
            del self.pins[rid]
            if self.dead is None:
                self.push.send(m.encode(m.RpcReply(call_id, False, error=err)))

    def run(self) -> None:
        while not self.stop:
            self.run_once()
            if self._parent_gone():
                log.error("frontend process is gone; engine process exiting")
                break
            if self.term_at and time.monotonic() - self.term_at[0] > self.term_grace_s:
                log.error("SIGTERM %.0f s ago and no shutdown from the frontend; exiting", self.term_grace_s)
                break
        for rid in list(self.live):
            with contextlib.suppress(Exception):
                self.eng.abort(rid)
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)


def main(
    spec: EngineSpec,
    to_engine: str,
    from_engine: str,
    parent_pid: int,
    log_level: int = logging.INFO,
    stages: Any = None,
) -> None:
    """Entry point of the spawned engine process.

    The frontend decides when it ends: Ctrl-C in a terminal reaches the whole process group, and the
    frontend drains on it, so SIGINT is ignored here; a SIGTERM of its own (a process group
    signalled at once) leaves it serving the drain for up to `spec.term_grace_s` (it exits sooner
    with its frontend, or when that sends Shutdown)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    term_at: list[float] = []  # (the first SIGTERM's time, read by the loop)

    def on_term(*_: object) -> None:
        if not term_at:
            term_at.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_term)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(to_engine)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(from_engine)
    eng = None
    if stages is not None:
        from longctx.stages.runtime import attached_stages

        attached_stages(stages)
    try:
        try:
            eng = build_engine(spec)
        except Exception as e:
            if not isinstance(e, LongctxError):  # bad configuration says what is wrong in its message
                log.error("engine failed to start:\n%s", traceback.format_exc())
            push.send(m.encode(m.EngineFailed(one_line(e))))
            return
        cfg = getattr(eng, "config", None)
        setting = int(getattr(eng, "max_context", None) or spec.max_context)
        ready = m.EngineReady(
            # what one request can hold: the server clamps max_tokens and reports max_model_len by it
            max_context=int(getattr(eng, "context_capacity", None) or setting),
            vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
            eos_token_ids=_eos_ids(cfg),
            info={
                "fake": spec.fake is not None,
                "pid": os.getpid(),
                "kv": _kv_info(eng),
                "max_context_setting": setting,
            },
        )
        push.send(m.encode(ready))
        EngineLoop(eng, pull, push, parent_pid, term_at, spec.term_grace_s).run()
    finally:
        if eng is not None:
            try:
                eng.close()
            except Exception:
                log.error("engine close failed:\n%s", traceback.format_exc())
        pull.close(0)
        push.close()
        ctx.term()
        if os.getppid() != parent_pid:
            _remove_sockets(to_engine, from_engine)


def _remove_sockets(*endpoints: str) -> None:
    """A frontend that was killed leaves its private socket dir behind: remove the two ipc:// socket
    files and the dir, if empty (the frontend removes it itself on a normal close)."""
    dirs: dict[str, list[str]] = {}
    for ep in endpoints:
        path = ep.removeprefix("ipc://")
        dirs.setdefault(os.path.dirname(path), []).append(os.path.basename(path))
    for d, names in dirs.items():
        remove_socket_dir(d, names)


def remove_socket_dir(directory: str, names: list[str]) -> None:
    """Unlink the socket files `names` in `directory`, then the dir if that left it empty."""
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)
