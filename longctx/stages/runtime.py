"""`StageRuntime`: the driver side of the pipeline (runs in the Engine's process).

It partitions the layers (`longctx.stages.partition`), spawns pp * tp stage processes
(`longctx.stages.process`), hosts their rendezvous (a TCPStore on 127.0.0.1, port picked by the
OS), sends every plan to every rank and collects the last stage's results.

Plans in flight: `submit(plan)` returns at once and `collect()` returns the oldest outstanding
result, so a caller can keep up to P plans in the pipeline (stage 0 works on plan k+1 while stage
1 works on plan k). `run(plan)` is submit + collect, what the synchronous `Engine.step` uses.
The plans in flight must be independent: a request may appear in at most one of them (its next
token depends on the previous result). A scheduler that keeps P micro-batches in flight would
split its running requests into P disjoint groups, submit one plan per group, and on each
`collect()` update that group and submit its next plan (`Engine.step` stays one plan at a time).

Faults: while waiting, the driver polls the processes' liveness; a stage that died or failed makes
the waiting call (and every later one) raise `EngineDeadError` within a poll interval, and all
other stage processes are terminated. A stage killed without a report is named as the cause even
when a peer's report of the broken connection arrives first. `close()` is idempotent, also runs at interpreter exit, and
removes any host-pool file a killed stage left behind (`cleanup_stale`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import time
import weakref
from collections import deque
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longctx.config import ModelConfig, check_layout
from longctx.engine.plan import BatchPlan, BatchResult
from longctx.errors import ConfigError, EngineDeadError
from longctx.kv_kinds import KVKinds
from longctx.kvstore.host_pool import NAME_PREFIX, cleanup_stale
from longctx.stages.messages import (
    Failed,
    Ready,
    Release,
    Result,
    RunPlan,
    Shutdown,
    StageSpec,
    StageStats,
    StatsRequest,
)
from longctx.stages.partition import partition

POLL_S = 0.1
SHUTDOWN_GRACE_S = 5.0
# after a stage's failure report: how long to look for a silently dead peer that caused it
FAILURE_SETTLE_S = 0.3
CONSEQUENCE_SETTLE = 10  # times FAILURE_SETTLE_S, when the only reports are of a lost peer
# set by `longctx.stages.launch` under torchrun: the next StageRuntime drives those ranks
_ATTACHED: list[Any] = []


def attached_stages(stages: Any) -> None:
    """Make the next `StageRuntime` (e.g. the one an Engine builds) use `stages` instead of spawning."""
    _ATTACHED.append(stages)


def take_attached_stages() -> Any:
    """The stages `attached_stages` left for the next runtime (None if none): for a caller that hands
    them to a runtime in another process (`longctx.stages.relay`)."""
    return _ATTACHED.pop() if _ATTACHED else None


class SpawnedStages:
    """Local stage processes (torch.multiprocessing spawn), one inbox queue each, one outbox.

    The interface `StageRuntime` drives (also implemented by `longctx.stages.launch` for
    torchrun): `rendezvous()` -> (store host, port) ("" if the process group exists),
    `start(specs)`, `send(rank, msg)`, `get(timeout)` (None on timeout), `dead()` (a (rank, exit
    code) of a stage that is gone, or None), `close(graceful)`.
    """

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.inboxes: list[Any] = []
        self.outbox: Any = None
        self.store: Any = None
        self.closed = False

    def rendezvous(self) -> tuple[str, int]:
        # the driver hosts the store; port 0 lets the OS pick a free port, race-free
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        return "127.0.0.1", int(self.store.port)

    def start(self, specs: list[StageSpec]) -> None:
        from longctx.stages.process import spawn_main

        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        for spec in specs:
            inbox = ctx.Queue()
            self.inboxes.append(inbox)
            self.procs.append(
                ctx.Process(
                    target=spawn_main,
                    args=(spec, inbox, self.outbox),
                    name=f"longctx-stage{spec.stage}-tp{spec.tp_rank}",
                    daemon=True,
                )
            )
        for p in self.procs:
            p.start()

    def send(self, rank: int, msg: Any) -> None:
        self.inboxes[rank].put(msg)

    def get(self, timeout: float) -> Any:
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def dead(self, skip: Collection[int] = ()) -> tuple[int, int | None] | None:
        """(rank, exit code) of a stage process that is gone, ranks in `skip` aside."""
        for rank, p in enumerate(self.procs):
            if rank not in skip and not p.is_alive():
                return rank, p.exitcode
        return None

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        procs = [p for p in self.procs if p.pid is not None]  # (a failed start leaves some unstarted)
        if graceful:
            for q in self.inboxes:
                with contextlib.suppress(Exception):
                    q.put(Shutdown())
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()  # (stages ignore SIGTERM: their driver decides when they end, `spawn_main`)
        for p in procs:
            p.join()
        for q in [*self.inboxes, self.outbox]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        # each queue holds named semaphores (/dev/shm/sem.mp-*), unlinked when it is collected: drop
        # them now rather than when the engine object goes
        self.inboxes, self.outbox = [], None
        self.store = None
        # a stage killed between creating its host pool and unlinking it leaves the file behind;
        # only our stages' files: another engine's may belong to a pid not visible here
        cleanup_stale(NAME_PREFIX, pids={p.pid for p in procs})


def stage_layers(
    cfg: ModelConfig, pp: int, tp: int, num_pages: int, page_size: int, layer_split: list[int] | None
) -> list[tuple[int, int]]:
    """Each stage's layers [start, stop): the planner's split (or `layer_split`) at the context the pool
    holds. The engine's room check asks before the stages are built, so the layout is checked here first
    (pp=99 was refused as the partition's, not as `pp`)."""
    check_layout(cfg, pp, tp)
    context = min(num_pages * page_size, cfg.max_position_embeddings)
    return [p.layers for p in partition(cfg, pp, context, layer_split, tp=tp, gpus_per_node=pp * tp)]


class StageRuntime:
    """pp pipeline stages of tp processes each, driven from this process. See the module doc."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        *,
        pp: int = 1,
        tp: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_kind: str | KVKinds = "auto",
        num_pages: int = 256,
        use_triton: bool = False,
        prefill_form: str = "auto",
        hisparse_device_tokens: int | None = None,
        layer_split: list[int] | None = None,
        page_size: int = 64,
        max_context: int | None = None,
        max_running: int = 1,
        num_threads: int | None = None,
        poll_s: float = POLL_S,
        stages: Any = None,
    ) -> None:
        check_layout(cfg, pp, tp)
        dev = torch.device(device)
        world = pp * tp
        # `stages`: how the processes are run; default a local spawn, under torchrun the
        # already-running ranks (`longctx.stages.launch` passes them through `attached_stages`)
        if stages is None:
            stages = take_attached_stages() or SpawnedStages()
        if isinstance(stages, SpawnedStages):
            if dev.type == "cuda" and torch.cuda.device_count() < world:
                raise ConfigError(
                    f"pp={pp} x tp={tp} needs {world} GPUs, {torch.cuda.device_count()} visible"
                )
        elif stages.world_size != world:
            raise ConfigError(f"pp={pp} x tp={tp} needs {world} ranks, the launch has {stages.world_size}")
        self.layers = stage_layers(cfg, pp, tp, num_pages, page_size, layer_split)
        self.pp, self.tp, self.poll_s = pp, tp, poll_s
        if num_threads is None:
            num_threads = max(1, (os.cpu_count() or 1) // world) if dev.type == "cpu" else 0

        self._p = stages
        self._finalizer = weakref.finalize(self, self._p.close)
        store_host, store_port = self._p.rendezvous()
        dtype_name = str(dtype).replace("torch.", "")
        self.specs: list[StageSpec] = [
            StageSpec(
                model_dir=str(model_dir),
                cfg=cfg,
                pp=pp,
                tp=tp,
                stage=s,
                tp_rank=t,
                layers=(a, b),
                device=dev.type,
                dtype=dtype_name,
                kv_kind=kv_kind,
                num_pages=num_pages,
                page_size=page_size,
                use_triton=use_triton,
                prefill_form=prefill_form,
                hisparse_device_tokens=hisparse_device_tokens,
                store_host=store_host,
                store_port=store_port,
                num_threads=num_threads,
                max_context=max_context,
                max_running=max_running,
            )
            for s, (a, b) in enumerate(self.layers)
            for t in range(tp)
        ]
        self._dead: str | None = None
        self._seq = itertools.count()
        self._pending: deque[int] = deque()
        self._results: dict[int, bytes] = {}
        self._stats: dict[int, dict[int, dict[str, Any]]] = {}
        self._ready: dict[int, int] = {}  # rank -> pid
        try:
            self._p.start(self.specs)
            while len(self._ready) < world:
                self._pump()
        except BaseException:
            self.close()
            raise

    # ---- processes ---------------------------------------------------------------------------
    @property
    def pids(self) -> list[list[int]]:
        """pids[stage][tp_rank] of the stage processes."""
        return [[self._ready[s * self.tp + t] for t in range(self.tp)] for s in range(self.pp)]

    def _where(self, rank: int) -> str:
        if rank < 0:  # (a report no rank could be named for: torchrun's results link broke)
            return "the stage ranks"
        return (
            f"stage {rank // self.tp} (layers {list(self.layers[rank // self.tp])}, tp rank {rank % self.tp})"
        )

    def _die(self, why: str) -> None:
        self._dead = why
        self._pending.clear()
        self._p.close(graceful=False)
        raise EngineDeadError(why)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        gone = self._p.dead()
        if gone is not None:
            # a failing stage reports why before it exits: prefer that message
            deadline = time.monotonic() + 0.5
            while (msg := self._p.get(max(0.0, deadline - time.monotonic()))) is not None:
                self._dispatch(msg)
            self._die(f"{self._where(gone[0])} exited with code {gone[1]}")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, Result):
            self._results[msg.seq] = msg.payload
        elif isinstance(msg, StageStats):
            self._stats.setdefault(msg.seq, {})[msg.stage] = msg.stats
        elif isinstance(msg, Ready):
            self._ready[msg.rank] = msg.pid
        elif isinstance(msg, Failed):
            self._die(self._cause(msg))

    def _cause(self, failed: Failed) -> str:
        """What to report for a stage's failure. A stage that died without a report (killed, out of
        memory) is the cause, and its peers' failures on the closed connection are consequences:
        whichever of them reaches the driver first. A stage that fails reports before it exits, so
        for a short while the reports are drained and a dead rank that sent none is looked for."""
        reported = {failed.rank}
        start = time.monotonic()
        while True:
            while (m := self._p.get(0.0)) is not None:
                if isinstance(m, Failed):
                    reported.add(m.rank)
                    if failed.consequence and not m.consequence:  # (a peer's loss seen first: the cause)
                        failed = m
            gone = self._p.dead(skip=reported)
            if gone is not None:
                return (
                    f"{self._where(gone[0])} exited with code {gone[1]}"
                    f" (then {self._where(failed.rank)} failed: {failed.message})"
                )
            # a consequence alone waits longer for the report naming the cause (under torchrun a vanished
            # rank's receiver thread on rank 0 reports it, racing rank 0's stage on the same broken link)
            settle = FAILURE_SETTLE_S * (CONSEQUENCE_SETTLE if failed.consequence else 1)
            if time.monotonic() - start >= settle:
                return f"{self._where(failed.rank)} failed: {failed.message}"
            time.sleep(0.02)

    def _pump(self) -> None:
        """Handle one message from the stages, or check their liveness after `poll_s` of silence."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        msg = self._p.get(self.poll_s)
        if msg is None:
            self._check_alive()
            return
        self._dispatch(msg)

    # ---- plans -------------------------------------------------------------------------------
    def submit(self, plan: BatchPlan) -> int:
        """Send `plan` into the pipeline without waiting; returns its sequence number."""
        self._check_alive()
        seq = next(self._seq)
        msg = RunPlan(seq, plan)
        for rank in range(self.pp * self.tp):
            self._p.send(rank, msg)
        self._pending.append(seq)
        return seq

    def collect(self) -> BatchResult:
        """The result of the oldest submitted plan (blocks; raises EngineDeadError on a fault)."""
        if not self._pending:
            raise RuntimeError("collect() without a submitted plan")
        seq = self._pending[0]
        while seq not in self._results:
            self._pump()
        self._pending.popleft()
        return pickle.loads(self._results.pop(seq))

    def release(self, rids: list[str]) -> None:
        """Finished / aborted requests: every rank frees their per-request KV state, in plan order."""
        self._check_alive()
        msg = Release(tuple(rids))
        for rank in range(self.pp * self.tp):
            self._p.send(rank, msg)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def run(self, plan: BatchPlan) -> BatchResult:
        """Synchronous: submit + collect (with nothing else in flight)."""
        if self._pending:
            raise RuntimeError("run() while plans are in flight; use collect()")
        self.submit(plan)
        return self.collect()

    # ---- introspection / lifecycle -----------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """{"stages": [per stage: layers, tp, kv_bytes_device, host_pool_bytes, steps, busy_s, ...]}."""
        if self._dead is not None:
            return {"stages": [], "error": self._dead}
        seq = next(self._seq)
        for s in range(self.pp):
            self._p.send(s * self.tp, StatsRequest(seq))
        while len(self._stats.get(seq, {})) < self.pp:
            self._pump()
        got = self._stats.pop(seq)
        pids = self.pids
        return {"stages": [dict(got[s], pids=pids[s]) for s in range(self.pp)]}

    def close(self) -> None:
        """Stop every stage process and release everything. Idempotent; also runs at exit."""
        self._finalizer()

    def __enter__(self) -> StageRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
