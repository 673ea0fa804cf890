"""`EngineCore`: the engine a driver steps: its set-up, the step-level API, the step-API driver's
contract, overlapped decode and the lifecycle.

`__init__` sizes everything before it builds anything (`sizing`), then builds the runner (`runner`: the
one stage in this process, or stage processes), the page allocator, the prefix cache and the
scheduler. `step()` runs one scheduler iteration through the runner; with overlap on, step n+1 is
planned and launched while step n runs. `Engine` (engine.py) is this with the blocking calls on top
(`generate`, `score`, documents), which step it through the same lock and mailboxes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx.checkpoint.generation_config import load_generation_config
from longctx.checkpoint.tokenizer import load_tokenizer, token_bytes_table
from longctx.config import (
    SCHEDULING_POLICIES,
    ModelConfig,
    check_device_tokens,
    check_kv_fp8_skip_layers,
    dtype_name,
    with_selection,
)
from longctx.engine.guided import GuideCache, GuideState, VocabBytes, check_guided
from longctx.engine.plan import BatchPlan, BatchResult
from longctx.engine.request import (
    FinishReason,
    Request,
    SamplingParams,
    StepOutput,
    bad_word_ids,
    check_token_ids,
)
from longctx.engine.runner import LocalRunner, build_runner, device_fed
from longctx.engine.scheduler import Scheduler
from longctx.engine.sizing import PAGE_SIZE, check_engine_room, check_sizes, default_pages, resolve_device
from longctx.engine.stop_strings import ends_in_stop
from longctx.engine.turn_lock import TurnLock
from longctx.engine.worker import DTYPES, PendingRows
from longctx.errors import ConfigError, RequestError, one_line
from longctx.kernels.common import use_triton as _use_triton
from longctx.kv_kinds import resolve_kv_kinds
from longctx.kvstore.allocator import PageAllocator
from longctx.kvstore.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger("longctx.engine")


class EngineCore:
    """A checkpoint loaded onto its runner, the scheduler over its KV pages, and the step-level API the
    server's engine process drives. Threads, the driver's contract and the public surface: `Engine`."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        kv_dtype: str = "auto",
        pp: int = 1,
        tp: int = 1,
        hisparse_device_tokens: int | None = None,
        max_context: int = 1_048_576,
        backend: str = "auto",
        *,
        kv_pages: int | None = None,
        chunk_size: int | None = None,
        max_running: int = 64,
        max_queue: int = 1024,
        prefill_form: str = "auto",
        layer_split: list[int] | None = None,
        cuda_graphs: bool | None = None,
        overlap: bool | None = None,
        index_topk: int | None = None,
        index_local_window: int | None = None,
        index_topk_long: int | None = None,
        index_topk_long_from: int | None = None,
        kv_fp8_skip_layers: Sequence[int] | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if not isinstance(model_dir, str | os.PathLike):
            raise ConfigError(f"model_dir must be a path, got {model_dir!r}")
        # (hisparse_device_tokens: None is no cap; 0 read as "no cap" before, while -1 was an error)
        check_sizes(
            {
                "pp": pp,
                "tp": tp,
                "max_context": max_context,
                "max_running": max_running,
                "max_queue": max_queue,
            },
            {
                "kv_pages": kv_pages,
                "chunk_size": chunk_size,
                "hisparse_device_tokens": hisparse_device_tokens,
            },
        )
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError.about(
                "scheduling_policy", repr(scheduling_policy), "must be 'fcfs' or 'priority'"
            )
        if prefill_form not in ("auto", "expanded", "absorbed"):
            raise ConfigError.about(
                "prefill_form", repr(prefill_form), "must be 'auto', 'expanded' or 'absorbed'"
            )
        self.model_dir = Path(model_dir)
        self.cfg = ModelConfig.from_json(self.model_dir)
        # generation_config.json's EOS ids end a generation too (transformers' and vLLM's rule)
        more_eos = [
            e for e in load_generation_config(self.model_dir).eos_token_ids if e < self.cfg.vocab_size
        ]
        if set(more_eos) - set(self.cfg.eos_ids()):
            eos = list(dict.fromkeys([*self.cfg.eos_ids(), *more_eos]))
            self.cfg = dataclasses.replace(self.cfg, eos_token_id=eos)
        # (the same weights selecting otherwise: a wider or narrower top-k, another window, a narrowing)
        self.cfg = with_selection(
            self.cfg, index_topk, index_local_window, index_topk_long, index_topk_long_from
        )
        check_device_tokens(self.cfg, hisparse_device_tokens)
        self.device = resolve_device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = DTYPES[dtype_name(dtype, extra=("auto",))]
        # an fp8 cache keeps these layers' KV in the model dtype (None: as the checkpoint says)
        skip = self.cfg.kv_fp8_skip_layers if kv_fp8_skip_layers is None else kv_fp8_skip_layers
        skip = check_kv_fp8_skip_layers(skip, self.cfg.num_hidden_layers)
        self.kv_kinds = resolve_kv_kinds(kv_dtype, self.device, skip)
        self.kv_kind = self.kv_kinds.base
        self.use_triton = _use_triton(backend, self.device)
        # (a larger top-k selects nothing more, and its [tokens, index_topk] buffers ran out of memory)
        if index_topk is not None and index_topk > max_context:
            raise ConfigError.about(
                "index_topk",
                index_topk,
                f"is more than {{}} ({max_context}): no query has more keys to select",
                "max_context",
            )
        self.max_context = max_context
        self.tokenizer = load_tokenizer(self.model_dir)
        self._guides: GuideCache | None = None
        self._guides_lock = threading.Lock()
        self.chunk_size = chunk_size or (8192 if self.device.type == "cuda" else 512)
        self.hisparse_device_tokens = hisparse_device_tokens
        self._ids = itertools.count()
        self._closed = False
        self._lock = TurnLock()  # one thread at a time in the scheduler, the stages, `_pending`
        self._watchers: tuple[Callable[[], None], ...] = ()  # `watch`; replaced whole under _watch_lock
        self._watch_lock = threading.Lock()
        # a running blocking call's request id -> its outputs another thread's step produced, not yet read
        self._mail: dict[str, list[StepOutput]] = {}

        sized = (self.cfg, self.device, self.dtype, self.kv_kinds)  # what pages and pools are sized by
        num_pages = default_pages(*sized, max_context, pp, tp) if kv_pages is None else kv_pages
        check_engine_room(
            *sized,
            num_pages=num_pages,
            default=kv_pages is None,
            pp=pp,
            tp=tp,
            max_running=max_running,
            max_context=max_context,
            hisparse_device_tokens=hisparse_device_tokens,
            layer_split=layer_split,
        )
        self.runner: Any = build_runner(
            self.model_dir,
            *sized,
            self.use_triton,
            pp=pp,
            tp=tp,
            num_pages=num_pages,
            prefill_form=prefill_form,
            cuda_graphs=cuda_graphs,
            max_running=max_running,
            max_context=max_context,
            hisparse_device_tokens=hisparse_device_tokens,
            layer_split=layer_split,
        )
        self.allocator = PageAllocator(num_pages, PAGE_SIZE)
        self.prefix_cache = PrefixCache(self.allocator)
        self.scheduler = Scheduler(
            self.allocator,
            self.prefix_cache,
            max_context=max_context,
            chunk_size=self.chunk_size,
            max_running=max_running,
            max_queue=max_queue,
            eos_ids=tuple(self.cfg.eos_ids()),
            scheduling_policy=scheduling_policy,
        )
        self._documents: dict[str, list[bytes]] = {}  # doc id -> its pinned prefix-cache page keys
        self._stop_text: dict[str, str] = {}
        self._requests: dict[str, Request] = {}
        self._held: list[StepOutput] = []  # step-API outputs produced inside a blocking call
        # overlapped decode (plan step n+1 while step n runs): on by default for one CUDA stage;
        # LONGCTX_OVERLAP=0 turns it off, =1 on (also on CPU, where it only reorders host work).
        # Stage runtimes (pp/tp > 1) run steps one at a time.
        if overlap is None:
            env = os.environ.get("LONGCTX_OVERLAP", "")
            overlap = env == "1" or (env != "0" and self.device.type == "cuda")
        self.overlap = bool(overlap) and isinstance(self.runner, LocalRunner)
        self._pending: PendingRows | None = None  # a launched step whose tokens are not read yet
        # the continuation of `_pending` with its forward launched already (late-shaped rows: its draw waits
        # for `_pending`'s tokens), and its plan
        self._ahead: tuple[BatchPlan, PendingRows] | None = None
        self._deferred: Exception | None = None
        self.launched_ahead = 0  # continuations launched by the step before the one that draws them
        self.device_fed_steps = 0  # continuations launched with their tokens still on the device

    # ---- step-level API (the server's engine process drives these) ----------------------------
    def add_request(self, req: Request) -> None:
        self._check_open()
        # checked before the scheduler takes it: a request id that is not a string (unhashable, a list) was
        # queued, then failed every later step with a TypeError, the requests already running with it
        if not isinstance(req, Request):
            raise RequestError(f"add_request takes a Request, got {type(req).__name__}")
        if not isinstance(req.rid, str):
            raise RequestError(f"a request id must be a string, got {type(req.rid).__name__}")
        if not isinstance(req.params, SamplingParams):
            raise RequestError(f"a request's params must be SamplingParams, got {type(req.params).__name__}")
        req.params.validate()
        with self._lock:
            self._add(req)

    def _add(self, req: Request) -> None:
        """A request whose params are valid (`add_request` checked them, or `generate` once for all its
        prompts) into the scheduler, after the checks that need the model: its token ids, its stop strings'
        tokenizer."""
        check_token_ids(req, self.cfg.vocab_size, self.cfg.eos_ids())
        if req.params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer (tokenizer.json)", "stop")
        if req.params.bad_words:
            if self.tokenizer is None:
                raise RequestError("bad_words need the model's tokenizer (tokenizer.json)", "bad_words")
            tok = self.tokenizer
            req.bad_ids = bad_word_ids(
                lambda w: tok.encode(w, add_special_tokens=False).ids, req.params.bad_words
            )
        if req.params.guided:
            req.guide = GuideState(self._guide_cache().get(*req.params.guided))
        self.scheduler.add(req)
        self._requests[req.rid] = req

    def _guide_cache(self) -> GuideCache:
        """Compiled guides over this model's vocabulary (made on the first guided request)."""
        with self._guides_lock:
            if self._guides is None:
                if self.tokenizer is None:
                    raise RequestError(
                        "guided decoding needs the model's tokenizer (tokenizer.json)", "guided"
                    )
                pieces = token_bytes_table(self.tokenizer, self.cfg.vocab_size)
                self._guides = GuideCache(VocabBytes.build(pieces, self.cfg.eos_ids()))
            return self._guides

    def guide_ready(self, guided: Sequence[str]) -> bool:
        """Whether SamplingParams.guided `guided` is compiled (a request with it is added without compiling)."""
        return self._guides is not None and tuple(guided) in self._guides

    def prepare_guide(self, guided: Sequence[str]) -> None:
        """Compile a guide (SamplingParams.guided) into the engine's cache, RequestError for a bad one. Safe to
        call from another thread while the engine steps: the server's loop compiles a request's new guide
        so, and adds the request when it is ready, instead of stalling every running request meanwhile."""
        check_guided(guided)
        self._guide_cache().get(*guided)

    def abort(self, rid: str) -> None:
        with self._lock:
            self.scheduler.abort(rid)
            self._requests.pop(rid, None)
            self._release([rid])
            self._notify_watchers()

    @property
    def context_capacity(self) -> int:
        """The most tokens (prompt + output) one request can hold: `max_context`, or less when the KV
        page pool is smaller (a request never fits a pool it outgrows, whatever else is free)."""
        return min(self.max_context, self.allocator.num_pages * self.allocator.page_size)

    def fail_step(self) -> list[str]:
        """After `step()` raised: abort the requests the failed step held (the running ones, whose
        KV and sampling state it may have left half-written) and forget any step launched or deferred
        beside it; returns their ids. Waiting requests were in no step: they stay queued, and their
        prefix-cache pages are only pages a finished step computed."""
        with self._lock:
            self._pending = None
            self._ahead = None
            self._deferred = None
            rids = [req.rid for req in self.scheduler.running]
            for rid in rids:
                self.abort(rid)
            return rids

    def has_work(self) -> bool:
        with self._lock:
            return self._pending is not None or self.scheduler.has_work()

    def num_waiting(self) -> int:
        with self._lock:
            return len(self.scheduler.waiting)

    def num_running(self) -> int:
        with self._lock:
            return len(self.scheduler.running)

    def step(self) -> list[StepOutput]:
        """One scheduler iteration; outputs for every request that progressed.

        Outputs of requests added through `add_request` that progressed while a blocking call
        (`generate`, `score`, `pin_document`) was stepping the engine are delivered here first.
        """
        with self._lock:
            self._check_open()
            if self._held:
                held, self._held = self._held, []
                return held
            return [o for o in self._step() if not self._post(o)]

    def _post(self, o: StepOutput) -> bool:
        """Put `o` in the mailbox of the blocking call waiting for its request, if one is; whether it was."""
        box = self._mail.get(o.rid)
        if box is not None:
            box.append(o)
        return box is not None

    def _deliver(self, o: StepOutput) -> None:
        """An output of a request not the stepping call's: to the blocking call waiting for it, else (a
        step-API request's) kept for `step()`."""
        if not self._post(o):
            self._held.append(o)

    # ---- the step-API driver's contract --------------------------------------------------------
    # What a thread driving `step()` for callers of its own (AsyncEngine) needs beyond the public API, and
    # all of the engine it may use: turns at the engine, admission of requests it checked, what the engine
    # still holds of them, the recovery from a failed step, a call when something changed that could let a
    # stalled step move; and a finished request's Completion (`Engine.completion`, beside `generate`).
    @property
    def closed(self) -> bool:
        """Whether `close()` ran: every call and step after it raises RequestError("the engine is closed")."""
        return self._closed

    def turn(self) -> contextlib.AbstractContextManager[bool]:
        """`with engine.turn():` the calls made inside (adds, aborts, a step and the handling of its
        failure) run as one turn of this thread at the engine: no other thread steps, adds or aborts between
        them. Reentrant (the engine's own calls inside take it again); it waits for a step another thread
        is running (and for the whole of a `pin_document`)."""
        return self._lock

    def give_way(self) -> None:
        """After a turn, out of it: let the threads waiting for the engine (blocking calls) take their turns
        before this thread's next one, waiting for them a few milliseconds at most. A thread stepping in a
        loop calls it after each step (`TurnLock`)."""
        self._lock.give_way()

    def admit(self, req: Request, kind: str | None = None) -> None:
        """`add_request` for a request whose params the caller has already validated (once, at its call):
        into the engine after the checks that need its state (the engine open, token ids, the stop strings'
        tokenizer, the request's size, the queue, a duplicate id). `kind`: `req.rid` is replaced by a drawn
        id "<kind>-<n>" that no request in the engine has. Raises RequestError; nothing is added then."""
        with self._lock:
            self._check_open()
            if kind is not None:
                req.rid = self._new_rid(kind)
            self._add(req)

    def has_held_outputs(self) -> bool:
        """Whether the next `step()` returns outputs that other threads' steps made for step-API requests
        (it returns them at once, without stepping)."""
        with self._lock:
            return bool(self._held)

    def lost(self, rids: Iterable[str]) -> list[str]:
        """Those of `rids` (step-API requests) the engine will report nothing more of: neither in it nor
        with an output waiting for `step()`, aborted through `abort` (by another thread, say)."""
        with self._lock:
            held = {o.rid for o in self._held}
            return [rid for rid in rids if rid not in self._requests and rid not in held]

    def fail_others(self, e: Exception, pending: set[str]) -> list[str] | None:
        """After a step raised (`e`), in the turn that ran it: every request the step held is aborted (its
        KV and sampling state may be half-written), as the server's engine process fails a step's requests;
        another thread's blocking call raises the step's error, a step-API request gets a finished output
        with it. The caller's own requests (`pending`) are left to it. Returns the failed requests' ids,
        None when telling them apart failed itself (a dead stage: every later step fails with it anyway)."""
        try:
            failed = self.fail_step()
        except Exception:
            return None
        err = one_line(e)
        for rid in failed:
            if rid not in pending:
                self._deliver(StepOutput(rid, finished=True, finish_reason=FinishReason.ERROR, error=err))
        return failed

    def watch(self, fn: Callable[[], None]) -> None:
        """Call `fn()` after anything that could let a step that moved none of a driver's requests move
        them: a step ran (its requests moved or finished, pages taken and freed, outputs kept for `step()`),
        a request was aborted, a document unpinned, the engine closed. A step that found nothing to run
        calls nothing. `fn` runs in the turn of the thread that made the change: it must be quick, must not
        raise and must not wait for another thread (wake the driver, as a condition's notify does)."""
        with self._watch_lock:
            self._watchers = (*self._watchers, fn)

    def unwatch(self, fn: Callable[[], None]) -> None:
        """Stop calling `fn` (`watch`); one not watching is ignored."""
        with self._watch_lock:
            self._watchers = tuple(w for w in self._watchers if w != fn)

    def _notify_watchers(self) -> None:
        for fn in self._watchers:
            try:
                fn()
            except Exception:  # (a watcher's bug must not fail the step that called it)
                log.error("an engine watcher failed:\n%s", traceback.format_exc())

    def _step(self) -> list[StepOutput]:
        if not self.overlap:
            plan = self.scheduler.schedule()
            if plan is None:
                return []
            return self._finish_step(plan, self.runner.run(plan))
        # Overlapped: step n was launched by the previous call (or is launched now). While the GPU
        # runs it, plan step n+1 (a pure decode continuation) and launch it at once, its input
        # tokens taken on the device from step n's samples, so the GPU never waits for the host;
        # then read step n's tokens (the one synchronisation) and update. Rows whose request
        # finishes at step n compute one token nobody reads (their pages hold the slot until the
        # release). With logprobs the logits of step n must be read before the next replay
        # overwrites them: then n+1 is launched after the read, with the host's tokens. Guided rows
        # (and rows with bad words of several tokens) may draw only what step n's token allows: then
        # n+1's forward is launched at once and its draw queued behind it once step n is read.
        if self._deferred is not None:  # launching the last continuation failed: report it now
            err, self._deferred = self._deferred, None
            raise err
        pending, self._pending = self._pending, None
        ahead, self._ahead = self._ahead, None
        if pending is None:
            plan = self.scheduler.schedule()
            if plan is None:
                return []
            pending = self.runner.launch(plan)
        early: PendingRows | None = None
        nxt: BatchPlan | None
        late = False  # rows whose shaping needs step n's tokens: step n+1 draws after they are read
        if ahead is not None:  # (launched by the last call, right after it queued step n's draw)
            (nxt, early), late = ahead, True
        else:
            nxt = self.scheduler.plan_continuation(pending.plan)
            if nxt is not None and device_fed(pending):
                late = self.scheduler.shapes_late(nxt)
                try:
                    early = self.runner.launch(nxt, tokens=pending.toks, sample=not late)
                except Exception as e:  # step n's outputs go back first
                    self._deferred, nxt = e, None
        outs = self._finish_step(pending.plan, self.runner.resolve(pending))
        if early is not None and nxt is not None:
            # checks and counts; finished rows are skipped at update
            full = self.scheduler.confirm_continuation(nxt, keep_finished=True)
            self._pending = early
            self.device_fed_steps += 1
            if late and full is not None:
                try:  # queued behind step n+1's forward, which ran while the host read step n
                    self.runner.sample(early, full)
                    self._launch_ahead(early)
                except Exception as e:  # step n's outputs are already applied: deliver them first
                    self._deferred, self._pending, self._ahead = e, None, None
        elif nxt is not None:
            nxt = self.scheduler.confirm_continuation(nxt)
            if nxt is not None:
                try:
                    self._pending = self.runner.launch(nxt)
                except Exception as e:  # step n's outputs are already applied: deliver them first
                    self._deferred = e
        return outs

    def _launch_ahead(self, pending: PendingRows) -> None:
        """After step n+1's draw is queued (late-shaped rows), step n+2's forward too, device-fed from n+1's
        tokens: the GPU then has a forward to run while the host delivers step n's outputs and comes back,
        where it would idle after the short draw. Its own draw waits for the next call, which reads n+1.
        (The scheduler is where the next call would find it: nothing but arrivals and aborts happen in
        between, and those wait a step or skip their row, as for any launched continuation.)"""
        if not (device_fed(pending) and self.scheduler.shapes_late(pending.plan)):
            return  # (no late-shaped row left: the next call launches its continuation whole, as usual)
        nxt = self.scheduler.plan_continuation(pending.plan)
        if nxt is not None:
            self._ahead = (nxt, self.runner.launch(nxt, tokens=pending.toks, sample=False))
            self.launched_ahead += 1

    def _finish_step(self, plan: BatchPlan, result: BatchResult) -> list[StepOutput]:
        outs = self.scheduler.update(plan, result)
        outs = [self._apply_stop_strings_to_one(o) for o in outs]
        self._release([o.rid for o in outs if o.finished])
        self._notify_watchers()
        return outs

    def _release(self, rids: list[str]) -> None:
        # per-request state outside the page pool (penalties' tokens, HiSparse slots); runners without it skip
        release = getattr(self.runner, "release", None)
        if rids and release is not None:
            release(rids)

    def _apply_stop_strings_to_one(self, out: StepOutput) -> StepOutput:
        """`_apply_stop_strings`, failing only this request if its text cannot be checked (the others
        of the step go on; the step's tokens are already in every request's state)."""
        try:
            return self._apply_stop_strings(out)
        except Exception as e:
            log.error("request %s failed after its step:\n%s", out.rid, traceback.format_exc())
            req = self._requests.pop(out.rid, None)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ERROR)
            return dataclasses.replace(
                out, finished=True, finish_reason=FinishReason.ERROR, error=one_line(e)
            )

    def _apply_stop_strings(self, out: StepOutput) -> StepOutput:
        req = self._requests.get(out.rid)
        if req is None:
            return out
        if out.finished:
            self._requests.pop(out.rid, None)
            return out
        if self.tokenizer is not None and ends_in_stop(self.tokenizer, req, len(out.new_token_ids)):
            self.scheduler.finish(req, FinishReason.STOP)
            self._requests.pop(out.rid, None)
            return dataclasses.replace(out, finished=True, finish_reason=FinishReason.STOP)
        return out

    def _new_rid(self, kind: str) -> str:
        """An id for a blocking call's request that no request in the engine has (a step-API caller's
        "gen-0" made generate() fail as a duplicate)."""
        with self._lock:  # (`_requests` changes under another thread's step)
            while (rid := f"{kind}-{next(self._ids)}") in self._requests:
                pass
            return rid

    # ---- introspection / lifecycle ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_kind": self.kv_kind,
            "kv_fp8_skip_layers": sorted(self.kv_kinds.model_layers),
            "backend": "triton" if self.use_triton else "torch",
            "page_size": PAGE_SIZE,
            "time": time.time(),
        }
        s.update(self.scheduler.stats())
        s["device_fed_steps"] = self.device_fed_steps
        s["launched_ahead"] = self.launched_ahead
        s.update(self.runner.stats())
        hs = [st.get("hisparse") for st in s.get("stages", []) if st.get("hisparse")]
        if hs:
            keys = ("hits", "misses", "swap_bytes", "swap_seconds")
            agg = {k: sum(h[k] for h in hs) for k in keys}
            agg["device_tokens_max"] = max(h["device_tokens_max"] for h in hs)
            s["hisparse"] = agg
        s["host_pool_bytes"] = sum(st.get("host_pool_bytes", 0) for st in s.get("stages", []))
        return s

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop every prefix-cache page that no request or document holds, so the next prompt is prefilled
        cold (vLLM's `LLM.reset_prefix_cache()`, SGLang's `/flush_cache`): {"freed_pages", "kept_pages"},
        kept being the pages running requests and pinned documents hold, which stay cached and valid.

        Safe while requests run: it takes a turn at the engine, between steps (an overlapped step still on
        the device writes past its requests' cached pages only, and a freed page's next owner writes it in a
        later step, behind it on the stream, as after `evict`). Freeing the pages in the allocator is all it
        takes, with stages or HiSparse too: the scheduler owns every page id (one allocator for all
        stages), stage workers and HiSparse's host pool only hold KV rows at those ids, and HiSparse's
        device slots belong to requests, not pages. No watcher is told: admission could already evict
        exactly these pages (`PrefixCache.ensure_free`), so no stalled step can move now."""
        with self._lock:
            self._check_open()
            done = self.prefix_cache.reset()
            return {"freed_pages": done.freed_pages, "kept_pages": done.kept_pages}

    @property
    def config(self) -> ModelConfig:
        return self.cfg

    def _check_open(self) -> None:
        if self._closed:
            raise RequestError("the engine is closed")

    def close(self) -> None:
        with self._lock:  # (after the step another thread runs: its next one finds the engine closed)
            if not self._closed:
                self._closed = True
                self._pending = None  # a launched step nobody will read
                self._ahead = None
                self.runner.close()
                self._notify_watchers()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
