"""`Engine`: the public, in-process API (score, generate, stats, close) and the step-level serving API.

Every call goes through the real path: the scheduler plans batches over paged KV, stage workers
run the layers (sparse attention over the indexer's top-k), the last stage samples. With pp=1 and
tp=1 the single stage runs in this process; otherwise `longctx.stages` runs stage processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from longctx.checkpoint.tokenizer import load_tokenizer
from longctx.config import (
    ModelConfig,
    check_device_tokens,
    check_kv_fp8_skip_layers,
    dtype_name,
    is_int,
    with_selection,
)
from longctx.engine.cuda_graph import DecodeGraphs
from longctx.engine.plan import BatchPlan, BatchResult
from longctx.engine.request import (
    FinishReason,
    Request,
    SamplingParams,
    StepOutput,
    TokenLogprob,
    as_token_ids,
    check_token_ids,
    find_stop,
)
from longctx.engine.scheduler import Scheduler
from longctx.engine.worker import DTYPES, PendingRows, StageWorker, build_model, keeps_fp8
from longctx.errors import ConfigError, EngineDeadError, RequestError, one_line
from longctx.kernels.common import use_triton as _use_triton
from longctx.kv_kinds import kv_bytes_per_token, resolve_kv_kinds
from longctx.kvstore.allocator import PageAllocator
from longctx.kvstore.pool import PagedKVPool, host_kv_spec
from longctx.kvstore.prefix_cache import PrefixCache
from longctx.memory import available_memory, check_parts, check_room
from longctx.model.params import loaded_weight_bytes

log = logging.getLogger("longctx.engine")
_SURROGATE = re.compile("[\ud800-\udfff]")
PAGE_SIZE = 64


@dataclass
class Completion:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry (logprobs=N)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (prompt_logprobs=N)


def resolve_device(device: str) -> torch.device:
    """`auto` (CUDA when present), `cpu`, `cuda` or `cuda:N` of a device this machine has; ConfigError else."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):  # ('meta' failed as a checkpoint missing every tensor)
        raise ConfigError.about("device", repr(device), "must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError.about("device", repr(device), "CUDA is not available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError.about("device", repr(device), f"there are {torch.cuda.device_count()} CUDA devices")
    return dev


def _check_sizes(sizes: dict[str, object], optional: dict[str, object]) -> None:
    """Each value a positive int (not a bool), those of `optional` None too; checked before anything is
    loaded (0 or -1 running slots left generate() waiting forever, a float page count failed deep in
    the pool's allocation, kv_pages=0 was read as the default)."""
    for name, v in {**sizes, **optional}.items():
        if not (is_int(v) and v >= 1) and not (v is None and name in optional):
            raise ConfigError.about(name, repr(v), "must be a positive integer")


def _device_fed(p: PendingRows) -> bool:
    """Whether a continuation of `p` can take its tokens from `p`'s device samples: every row
    sampled one token and none reads its logits back (logprobs) after the next replay."""
    return (
        p.toks is not None
        and len(p.last) == len(p.plan.rows)
        and all(r.logprobs is None for r in p.plan.rows)
    )


class TurnLock:
    """A reentrant lock whose holder, having stepped and released it, lets the threads waiting for it take
    it before it steps again (`give_way`). A released lock goes back to the thread that released it far
    more often than to one waiting to be woken, so a thread stepping in a loop (a long `generate`,
    AsyncEngine's driver) kept another thread's call from adding its requests, or reading outputs its
    steps had made, for hundreds of steps."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._turn = threading.Condition(threading.Lock())
        self._waiting = 0  # threads blocked in acquire
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> bool:
        if not self._lock.acquire(blocking=False):
            with self._turn:
                self._waiting += 1
            try:
                self._lock.acquire()
            finally:
                with self._turn:
                    self._waiting -= 1
                    self._turn.notify_all()
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def give_way(self, timeout: float = 0.005) -> None:
        """Wait (at most `timeout` seconds) until the threads waiting for the lock have taken it; nothing
        to wait for while this thread still holds it (`pin_document` steps holding it throughout)."""
        if self._waiting and self._owner != threading.get_ident():
            with self._turn:
                self._turn.wait_for(lambda: not self._waiting, timeout)


class LocalRunner:
    """pp=1, tp=1: the one stage runs in this process."""

    def __init__(self, worker: StageWorker, graphs: DecodeGraphs | None = None) -> None:
        self.worker = worker
        self.graphs = graphs

    def run(self, plan: BatchPlan) -> BatchResult:
        return self.resolve(self.launch(plan))

    def launch(self, plan: BatchPlan, tokens: torch.Tensor | None = None) -> PendingRows:
        """Queue the step on the device; its sampled tokens stay there until `resolve`. `tokens`:
        the rows' input tokens as a device tensor (the previous step's samples, not yet read)."""
        if self.graphs is not None and self.graphs.bucket(plan) is not None:
            return self.worker.finish_async(plan, None, self.graphs.run(plan, tokens))
        return self.worker.finish_async(plan, self.worker.forward(plan, tokens=tokens))

    def resolve(self, pending: PendingRows) -> BatchResult:
        """Wait for a launched step and read its tokens back (the step's one host synchronisation)."""
        return BatchResult(pending.plan.step_id, self.worker.resolve(pending))

    def stats(self) -> dict[str, Any]:
        kv = self.worker.kv
        s = {"kv_bytes_device": kv.nbytes() if hasattr(kv, "nbytes") else 0}
        if hasattr(kv, "stats"):
            s.update(kv.stats())
        out: dict[str, Any] = {"stages": [s]}
        if self.graphs is not None:  # decode graphs: how often they were captured, replayed, dropped
            g = self.graphs
            out["cuda_graphs"] = {
                "buckets": len(g._graphs),
                "replays": g.replays,
                "recaptures": g.recaptures,
                "prep_s": g.prep_s,
                "launch_s": g.launch_s,
            }
        out["token_wait_s"] = self.worker.token_wait_s
        return out

    def release(self, rids: list[str]) -> None:
        """Requests finished or aborted: the worker frees their penalty and per-request KV state."""
        self.worker.release(rids)

    def close(self) -> None:
        close = getattr(self.worker.kv, "close", None)
        if close is not None:
            close()


class Engine:
    """Load a checkpoint and serve it. See DESIGN.md "Public surface".

    Safe to share between threads: one caller at a time drives the scheduler and the stages (a lock
    held for a step, not for a whole call), and blocking calls (`generate`, `score`) made from
    several threads at once run batched together, each step delivering every call's outputs to it
    whichever thread ran the step. `pin_document` holds the engine for its whole prefill.

    A thread that drives `step()` for callers of its own (AsyncEngine) uses the public API and the
    driver's contract below it (`closed`, `turn`, `give_way`, `admit`, `has_held_outputs`, `lost`,
    `fail_others`, `completion`, `watch` / `unwatch`), nothing else of the engine's.
    """

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
    ) -> None:
        if not isinstance(model_dir, str | os.PathLike):
            raise ConfigError(f"model_dir must be a path, got {model_dir!r}")
        # (hisparse_device_tokens: None is no cap; 0 read as "no cap" before, while -1 was an error)
        _check_sizes(
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
        if prefill_form not in ("auto", "expanded", "absorbed"):
            raise ConfigError.about(
                "prefill_form", repr(prefill_form), "must be 'auto', 'expanded' or 'absorbed'"
            )
        self.model_dir = Path(model_dir)
        self.cfg = ModelConfig.from_json(self.model_dir)
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
        self.chunk_size = chunk_size or (8192 if self.device.type == "cuda" else 512)
        self.hisparse_device_tokens = hisparse_device_tokens
        self._ids = itertools.count()
        self._closed = False
        self._lock = TurnLock()  # one thread at a time in the scheduler, the stages, `_pending`
        self._watchers: tuple[Callable[[], None], ...] = ()  # `watch`; replaced whole under _watch_lock
        self._watch_lock = threading.Lock()
        # a running blocking call's request id -> its outputs another thread's step produced, not yet read
        self._mail: dict[str, list[StepOutput]] = {}

        num_pages = self._default_pages(max_context, pp, tp) if kv_pages is None else kv_pages
        self._check_room(num_pages, kv_pages is None, pp, tp, max_running, layer_split)
        if pp == 1 and tp == 1:
            self.runner: Any = self._local_runner(num_pages, prefill_form, cuda_graphs, max_running)
        else:
            from longctx.stages.runtime import StageRuntime

            self.runner = StageRuntime(
                self.model_dir,
                self.cfg,
                pp=pp,
                tp=tp,
                device=self.device,
                dtype=self.dtype,
                kv_kind=self.kv_kinds,
                num_pages=num_pages,
                use_triton=self.use_triton,
                prefill_form=prefill_form,
                hisparse_device_tokens=hisparse_device_tokens,
                layer_split=layer_split,
                max_context=max_context,
                max_running=max_running,
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
        self._deferred: Exception | None = None
        self.device_fed_steps = 0  # continuations launched with their tokens still on the device

    def _default_pages(self, max_context: int, pp: int = 1, tp: int = 1) -> int:
        if self.device.type == "cuda":
            cfg, layers = self.cfg, range(self.cfg.num_hidden_layers)
            per_token = PagedKVPool.bytes_per_token(cfg, layers, self.kv_kinds, self.dtype)
            # weights are not loaded yet: half the free memory, and no more than 80% of what this GPU's
            # share of the weights leaves (weights past half the GPU were refused by the room check)
            free = available_memory(self.device)
            fp8 = keeps_fp8(cfg, self.device)
            share = loaded_weight_bytes(cfg, layers, self.dtype.itemsize, fp8, tp) // pp
            budget = max(0, min(free // 2, int((free - share) * 0.8)))
            return max(16, min(budget // (per_token * PAGE_SIZE), 2 * max_context // PAGE_SIZE + 64))
        # CPU: room for a few requests of a modest context
        return max(64, min(max_context, 1 << 16) * 2 // PAGE_SIZE)

    def _check_room(
        self,
        num_pages: int,
        default: bool,
        pp: int,
        tp: int,
        max_running: int,
        layer_split: list[int] | None = None,
    ) -> None:
        """Refuse a model and KV pools this machine cannot hold before any is loaded or allocated
        (kv_pages=10**9 died in the allocation with a traceback, or took the host's memory page by page;
        weights past a GPU's memory died mid-load). Counted, per TP rank of each stage (the split the
        stages will use): its share of the weights as they are loaded (`loaded_weight_bytes`: the model
        dtype, or block-fp8 with its scales on CUDA) and its device pool at num_pages + 1 pages (one pads
        captured batches): the stage's MLA rows and index keys (under HiSparse the index keys and the slot
        buffers: the MLA rows are in its host pool); and the host pools (HiSparse's; one per stage under
        pp or tp > 1). A lower bound: activations, CUDA graphs and the allocator's slack come on top, so
        only what cannot fit at all is refused."""
        cfg, N = self.cfg, self.hisparse_device_tokens
        slots = (num_pages + 1) * PAGE_SIZE
        n = cfg.num_hidden_layers
        if pp == 1:
            stages = [(0, n)]
        else:
            from longctx.stages.runtime import stage_layers

            stages = stage_layers(cfg, pp, tp, num_pages, PAGE_SIZE, layer_split)
        blocks = 0
        if N:
            from longctx.hisparse.cache import preallocated_requests

            blocks = preallocated_requests(max_running, num_pages, PAGE_SIZE, N, self.max_context)
        fp8 = keeps_fp8(cfg, self.device)
        ranks = []  # (weights, device KV) of one TP rank of each stage
        for a, b in stages:
            mla, index = kv_bytes_per_token(cfg, range(a, b), self.kv_kinds, self.dtype)
            kv = slots * index + (1 + blocks * N) * mla if N else slots * (mla + index)
            ranks.append((loaded_weight_bytes(cfg, range(a, b), self.dtype.itemsize, fp8, tp), kv))
        world = pp * tp
        host = host_kv_spec(cfg, range(n), slots, self.kv_kinds, self.dtype).nbytes if N or world > 1 else 0
        cap = f" with hisparse_device_tokens={N}" if N else ""
        subject = f"the model does not fit{cap}" if default else f"kv_pages={num_pages}{cap}"
        kv_name = "the default KV cache" if default else "the KV cache"
        if self.device.type == "cuda":
            # the stage ranks' GPUs (and under torchrun their nodes) taken to be alike: the most loaded
            # rank against this GPU's free memory, a node's share of the host pools against its RAM
            weights, kv = max(ranks, key=sum)
            per_gpu = " per GPU" if world > 1 else ""
            parts = {"the weights": weights, kv_name: kv}
            check_parts(subject, parts, f"GPU memory{per_gpu}", available_memory(self.device))
            nodes = -(-world // torch.cuda.device_count())
            check_room(f"{subject}: {kv_name}", host // nodes, "host memory", available_memory())
        else:
            weights = tp * sum(w for w, _ in ranks)
            kv = tp * sum(k for _, k in ranks) + host
            check_parts(subject, {"the weights": weights, kv_name: kv}, "memory", available_memory())

    def _local_runner(
        self, num_pages: int, prefill_form: str, cuda_graphs: bool | None, max_running: int
    ) -> LocalRunner:
        cfg = self.cfg
        layers = range(cfg.num_hidden_layers)
        model = build_model(self.model_dir, cfg, layers, self.device, self.dtype, keeps_fp8(cfg, self.device))
        # one page more than the allocator hands out: padding rows of captured decode batches
        if self.hisparse_device_tokens:
            from longctx.hisparse.cache import HiSparseKVCache, preallocated_requests

            N = self.hisparse_device_tokens
            kv: Any = HiSparseKVCache(
                cfg,
                layers,
                num_pages + 1,
                self.kv_kinds,
                self.dtype,
                self.device,
                device_tokens=N,
                page_size=PAGE_SIZE,
                use_triton=self.use_triton,
                max_requests=preallocated_requests(max_running, num_pages, PAGE_SIZE, N, self.max_context),
                max_context=self.max_context,
            )
        else:
            kv = PagedKVPool(cfg, layers, num_pages + 1, self.kv_kinds, self.dtype, self.device, PAGE_SIZE)
        worker = StageWorker(model, kv, self.device, self.use_triton, prefill_form, PAGE_SIZE)
        if cuda_graphs is None:  # on by default on CUDA; LONGCTX_CUDA_GRAPHS=0 turns them off
            cuda_graphs = self.device.type == "cuda" and os.environ.get("LONGCTX_CUDA_GRAPHS", "1") != "0"
        graphs = None
        # the torch references read sizes back to the host, so on CUDA only the Triton path is captured
        # (on CPU nothing is captured: the static-buffer path runs as is)
        capturable = self.use_triton or self.device.type != "cuda"
        if cuda_graphs and capturable:
            graphs = DecodeGraphs(
                worker, self.max_context, dummy_page=num_pages, capture=self.device.type == "cuda"
            )
        return LocalRunner(worker, graphs)

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
        check_token_ids(req, self.cfg.vocab_size)
        if req.params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer (tokenizer.json)", "stop")
        self.scheduler.add(req)
        self._requests[req.rid] = req

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
    # stalled step move; and a finished request's Completion (`completion`, beside `generate`).
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
        # overwrites them: then n+1 is launched after the read, with the host's tokens.
        if self._deferred is not None:  # launching the last continuation failed: report it now
            err, self._deferred = self._deferred, None
            raise err
        pending, self._pending = self._pending, None
        if pending is None:
            plan = self.scheduler.schedule()
            if plan is None:
                return []
            pending = self.runner.launch(plan)
        nxt = self.scheduler.plan_continuation(pending.plan)
        early: PendingRows | None = None
        if nxt is not None and _device_fed(pending):
            try:
                early = self.runner.launch(nxt, tokens=pending.toks)
            except Exception as e:  # step n's outputs go back first
                self._deferred, nxt = e, None
        outs = self._finish_step(pending.plan, self.runner.resolve(pending))
        if early is not None and nxt is not None:
            self.scheduler.confirm_continuation(nxt)  # checks and counts; finished rows are skipped at update
            self._pending = early
            self.device_fed_steps += 1
        elif nxt is not None:
            nxt = self.scheduler.confirm_continuation(nxt)
            if nxt is not None:
                try:
                    self._pending = self.runner.launch(nxt)
                except Exception as e:  # step n's outputs are already applied: deliver them first
                    self._deferred = e
        return outs

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
        p = req.params
        if p.stop and out.new_token_ids and self.tokenizer is not None and len(req.output_ids) > p.min_tokens:
            # A new match must end in the new tokens, so only a tail can hold it: a stop string of
            # n characters spans at most 4n tokens (one UTF-8 byte per token at worst), plus one
            # token whose partial character may decode as U+FFFD.
            window = 4 * max(len(s) for s in p.stop) + len(out.new_token_ids) + 1
            if self._stop_in(req, max(0, len(req.output_ids) - window))[1] is not None:
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

    # ---- documents (long-document QA) ----------------------------------------------------------
    def pin_document(self, token_ids: list[int]) -> tuple[str, int]:
        """Prefill a document once and pin its pages in the prefix cache."""
        ids = as_token_ids(token_ids, "token_ids")
        # the lock held throughout: another thread's step between the last one and the pin could evict
        with self._lock:
            rid = self._new_rid("doc")
            req = Request(rid, ids, SamplingParams(max_new_tokens=0))
            self._run_to_completion([req], desc="document")
            # released into the prefix cache by the last step; nothing ran since, so nothing was evicted
            self._documents[rid] = self.prefix_cache.pin_prefix(ids)
            return rid, len(ids)

    def unpin_document(self, doc_id: str) -> None:
        with self._lock:
            keys = self._documents.pop(doc_id, None)
            if keys is None:
                raise RequestError(f"no document {doc_id!r}")
            self.prefix_cache.unpin_keys(keys)
            self._notify_watchers()  # (its pages can be evicted for a waiting request now)

    # ---- public API ------------------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, vocab] at every position of `token_ids`, through the paged sparse path."""
        ids = as_token_ids(token_ids, "token_ids")
        req = Request(self._new_rid("score"), ids, SamplingParams(max_new_tokens=0), return_logits=True)
        self._run_to_completion([req], desc="score")
        return torch.cat([t.float() for t in req.logits], dim=0)

    def generate(
        self,
        prompts: list[list[int]] | list[str] | list[int] | str,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | list[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_tokens: int = 0,
        min_p: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> list[Completion]:
        """Generate for a batch of prompts (token-id lists or strings), or for one prompt (a string or a
        token-id list, as SGLang's Engine and vLLM's LLM take it); one Completion each, a list either way.
        The penalties, min_tokens, min_p, logit_bias (token id -> bias), logprobs and prompt_logprobs (the
        top-N alternatives of each generated / prompt token) are `SamplingParams`'."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list | tuple) and prompts and all(is_int(t) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[assignment]
        if not isinstance(prompts, list | tuple):
            raise RequestError("prompts must be a list of prompts (token-id lists or strings)", "prompt")
        # a bare string is one stop string, as in vLLM and OpenAI's API (it was one per character)
        stops: Any = [stop] if isinstance(stop, str | int) else stop or []
        if not isinstance(stops, list | tuple):
            raise RequestError(f"stop must be a list of stop strings and token ids, got {stop!r}", "stop")
        if not isinstance(logit_bias or {}, dict):
            raise RequestError("logit_bias must be a dict of token id -> bias", "logit_bias")
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(s for s in stops if is_int(s)),
            stop=tuple(s for s in stops if not is_int(s)),  # (validate refuses what is not a string)
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            min_tokens=min_tokens,
            min_p=min_p,
            logit_bias=tuple((logit_bias or {}).items()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        params.validate()  # before any prompt is read, once for every prompt (seed + i stays valid)
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p) if isinstance(p, str) else as_token_ids(p, f"prompts[{i}]")
            one = params if seed is None else dataclasses.replace(params, seed=seed + i)
            reqs.append(Request(self._new_rid("gen"), ids, one))
        lps = self._run_to_completion(reqs, desc="generate")
        return [self.completion(r, *lps[r.rid]) for r in reqs]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"a text prompt must be a string, got {type(text).__name__}", "prompt")
        if self.tokenizer is None:
            raise RequestError("string prompts need the model's tokenizer (tokenizer.json)")
        # (the tokenizer refuses a lone surrogate with a TypeError; a command line's byte that is not UTF-8
        # reads as one, U+DC80..U+DCFF)
        bad = _SURROGATE.search(text)
        if bad is not None:
            c = ord(bad.group())
            byte = f" (byte 0x{c - 0xDC00:02X}, not UTF-8)" if 0xDC80 <= c <= 0xDCFF else ""
            raise RequestError(
                f"the prompt is not valid Unicode: an unpaired surrogate U+{c:04X}{byte} at character "
                f"{bad.start()}",
                "prompt",
            )
        return self.tokenizer.encode(text).ids

    def completion(
        self, req: Request, logprobs: list[TokenLogprob], prompt_logprobs: list[TokenLogprob]
    ) -> Completion:
        """The Completion of a finished request, as `generate` returns it (its text cut at its first stop
        string), with the logprobs its outputs carried."""
        text = None
        if self.tokenizer is not None:
            text, cut = self._stop_in(req, 0)
            if cut is not None:
                text = text[:cut]
        reason = req.finish_reason.value if req.finish_reason else FinishReason.LENGTH.value
        return Completion(
            list(req.output_ids), text, reason, len(req.prompt_ids), req.num_cached, logprobs, prompt_logprobs
        )

    def _stop_in(self, req: Request, start: int) -> tuple[str, int | None]:
        """The text of req's tokens from `start` on, and where its first stop string begins in it (None:
        nowhere). No stop string may end within the first min_tokens tokens' text."""
        assert self.tokenizer is not None
        ids, n_min = req.output_ids, req.params.min_tokens
        text = self.tokenizer.decode(ids[start:])
        if not req.params.stop:
            return text, None
        floor = len(self.tokenizer.decode(ids[start:n_min])) if n_min > start else 0
        return text, find_stop(text, req.params.stop, floor=floor)

    def _run_to_completion(
        self, reqs: list[Request], desc: str
    ) -> dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]]:
        """Step until `reqs` (the engine's own, their params already valid) finish; each one's (logprobs,
        prompt logprobs) as the steps reported them. If it raises (a rejected request, a failed step, an
        interrupt), the requests of `reqs` still in the engine are aborted first, so nothing of this call
        stays queued or holds pages."""
        pending: set[str] = set()
        try:
            with self._lock:
                self._check_open()
                for r in reqs:
                    self._add(r)
                    pending.add(r.rid)
                    self._mail[r.rid] = []
            return self._step_until_done(reqs, pending, desc)
        except BaseException:
            with self._lock:
                for rid in pending:
                    try:
                        self.abort(rid)
                    except EngineDeadError:
                        pass  # its stages are gone, and what they held for the request with them
                    except Exception as e:  # (a closed engine): the error raised is the one that matters
                        log.warning("could not abort %s after a failed %s: %s", rid, desc, e)
            raise
        finally:
            with self._lock:
                for r in reqs:
                    self._mail.pop(r.rid, None)

    def _step_until_done(
        self, reqs: list[Request], pending: set[str], desc: str
    ) -> dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]]:
        lps: dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]] = {r.rid: ([], []) for r in reqs}
        total = sum(len(r.prompt_ids) for r in reqs)
        show = sys.stderr.isatty() and total >= 8 * self.chunk_size
        done: dict[str, int] = {}
        with tqdm(total=total, desc=f"{desc} prefill", unit="tok", disable=not show, leave=False) as bar:
            while pending:
                with self._lock:  # (released between steps: other threads' calls step, and batch with these)
                    self._check_open()
                    outs = [o for rid in sorted(pending) for o in self._mail[rid]]  # what their steps made
                    for rid in pending:
                        self._mail[rid].clear()
                    if not outs:
                        try:
                            stepped = self._step()
                        except Exception as e:
                            self.fail_others(e, pending)
                            raise
                        if not stepped and not self.has_work():
                            break
                        for o in stepped:
                            if o.rid in pending:
                                outs.append(o)
                            else:
                                self._deliver(o)
                self._lock.give_way()  # other threads wait for the lock (their calls, a stream's driver)
                for o in outs:
                    bar.update(o.prompt_done - done.get(o.rid, 0))
                    done[o.rid] = o.prompt_done
                    lps[o.rid][0].extend(o.logprobs)
                    lps[o.rid][1].extend(o.prompt_logprobs)
                    if o.finished:
                        pending.discard(o.rid)
                        if o.error:
                            raise RequestError(o.error)
        return lps

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
        s.update(self.runner.stats())
        hs = [st.get("hisparse") for st in s.get("stages", []) if st.get("hisparse")]
        if hs:
            keys = ("hits", "misses", "swap_bytes", "swap_seconds")
            agg = {k: sum(h[k] for h in hs) for k in keys}
            agg["device_tokens_max"] = max(h["device_tokens_max"] for h in hs)
            s["hisparse"] = agg
        s["host_pool_bytes"] = sum(st.get("host_pool_bytes", 0) for st in s.get("stages", []))
        return s

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
                self.runner.close()
                self._notify_watchers()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
