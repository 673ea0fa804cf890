"""One stage process (one TP rank of one pipeline stage): join the groups, build the shard, run plans.

Per plan, in the order the driver sent them: stage 0 embeds the plan's tokens, every later stage
receives the [T, hidden] states of its predecessor (same TP rank, point-to-point; T is known from
the plan), runs its layers, and sends the result on with `isend`, so it can start on the next plan
while the transfer runs: with several plans submitted the pipeline stays full. Every TP rank of the
last stage runs the vocab-parallel lm_head over the same rows (its all-gather needs them all); rank 0
samples (`StageWorker.finish`) and returns the `BatchResult`.

Process groups: the world is the P*T stage ranks (rank = stage * T + tp_rank); each stage has a TP
group (NCCL on GPUs, gloo on CPU) for the all-reduces and the logits' all-gather of
`longctx.stages.tp` (`longctx.stages.collectives`) and a gloo group for host-pool coordination. The driver is not a member: plans and results travel through a
`Transport` (multiprocessing queues for a local spawn, see `longctx.stages.launch` for torchrun).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from longctx.engine.plan import BatchResult
from longctx.engine.worker import DTYPES, StageWorker, build_model, keeps_fp8
from longctx.errors import ConfigError, LongctxError, one_line
from longctx.kvstore.host_pool import unlink_owned
from longctx.kvstore.pool import PagedKVPool, host_kv_spec
from longctx.stages.collectives import group_gather, group_reduce
from longctx.stages.host import HostBackedKV, open_stage_host_pool
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
from longctx.stages.tp import TPShard

log = logging.getLogger("longctx.stages")
MAX_PENDING_SENDS = 4  # isends of hidden states not yet known to be complete
STORE_TIMEOUT = timedelta(minutes=10)


class Transport(Protocol):
    """How a stage process talks to the driver."""

    def get(self, timeout: float) -> Any:
        """The next message, or None after `timeout` seconds without one."""

    def put(self, msg: Any) -> None: ...

    def driver_alive(self) -> bool: ...

    def close(self) -> None: ...


class QueueTransport:
    """Local spawn: one inbox per rank, one outbox shared by all ranks."""

    def __init__(self, inbox: Any, outbox: Any) -> None:
        self.inbox, self.outbox = inbox, outbox

    def get(self, timeout: float) -> Any:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def put(self, msg: Any) -> None:
        self.outbox.put(msg)

    def driver_alive(self) -> bool:
        parent = multiprocessing.parent_process()
        return parent is None or parent.is_alive()

    def close(self) -> None:
        # flush what we put (a Failed message must reach the driver before we exit)
        self.outbox.close()
        self.outbox.join_thread()


# What gloo and NCCL say when the rank at the other end of a connection went away (killed, out of
# memory): a consequence of another rank's death, which the driver reports as the cause
_PEER_LOST = re.compile(
    r"(Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited"
    r"|NCCL communicator was aborted)",
    re.IGNORECASE,
)


def peer_lost(e: BaseException) -> str | None:
    """The short reason when `e` is a collective failing because a peer rank is gone, else None."""
    if not isinstance(e, RuntimeError):  # (torch's DistBackendError is one)
        return None
    m = _PEER_LOST.search(str(e))
    return m.group(1) if m else None


class StageProcess:
    """The state of one rank: groups, model shard, KV (device pool + host pool), counters."""

    def __init__(self, spec: StageSpec, transport: Transport) -> None:
        self.spec, self.transport = spec, transport
        cuda = spec.device == "cuda"
        if cuda:
            local = spec.rank % torch.cuda.device_count()
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
            if spec.num_threads:
                torch.set_num_threads(spec.num_threads)
        self.dtype = DTYPES[spec.dtype]
        if spec.store_host:
            store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=STORE_TIMEOUT)
            dist.init_process_group(
                "nccl" if cuda else "gloo", store=store, rank=spec.rank, world_size=spec.world_size
            )
        self.tp_group: Any = None
        self.ctrl_group: Any = None
        if spec.tp > 1:
            # every rank creates every group, in the same order
            for s in range(spec.pp):
                ranks = list(range(s * spec.tp, (s + 1) * spec.tp))
                g = dist.new_group(ranks)
                c = dist.new_group(ranks, backend="gloo") if cuda else g
                if s == spec.stage:
                    self.tp_group, self.ctrl_group = g, c

        cfg, layers = spec.cfg, range(*spec.layers)
        keep_fp8 = keeps_fp8(cfg, self.device)
        prepare = weight_filter = None
        if spec.tp > 1:
            shard = TPShard(cfg, spec.tp_rank, spec.tp)
            reduce, gather = group_reduce(self.tp_group), group_gather(self.tp_group)

            def prepare(m: Any) -> None:
                shard.shard_model(m, reduce, gather)

            weight_filter = shard.shard_weights
        model = build_model(
            spec.model_dir, cfg, layers, self.device, self.dtype, keep_fp8, weight_filter, prepare
        )
        hspec = host_kv_spec(cfg, layers, spec.num_pages * spec.page_size, spec.kv_kind, self.dtype)
        layout = open_stage_host_pool(
            hspec, spec.stage, spec.tp_rank, spec.stage * spec.tp, self.ctrl_group, cuda
        )
        if spec.hisparse_device_tokens:
            inner = self._hisparse(layout, layers)
        else:
            inner = PagedKVPool(
                cfg, layers, spec.num_pages, spec.kv_kind, self.dtype, self.device, spec.page_size
            )
        # under HiSparse the cache itself writes the host rows it was given (or keeps its own)
        writer = spec.tp_rank == 0 and not spec.hisparse_device_tokens
        self.kv = HostBackedKV(inner, layout, writer, spec.use_triton)
        # other ranks read host rows (HiSparse swap-in) only once a barrier says they are there
        self.step_barrier = self.ctrl_group if (spec.hisparse_device_tokens and spec.tp > 1) else None
        self.worker = StageWorker(
            model, self.kv, self.device, spec.use_triton, spec.prefill_form, spec.page_size
        )
        self.hidden = cfg.hidden_size
        # IndexShare across a stage boundary: a stage whose first layer is "shared" needs the
        # top-k [T, index_topk] its predecessor ended with, sent right after the hidden states.
        self.recv_topk = spec.stage > 0 and not cfg.is_full_indexer(layers.start)
        self.send_topk = layers.stop < cfg.num_hidden_layers and not cfg.is_full_indexer(layers.stop)
        self.steps = 0
        self.busy_s = 0.0
        self.tokens = 0
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()

    def _hisparse(self, layout: Any, layers: range) -> Any:
        try:
            from longctx.hisparse.cache import HiSparseKVCache, preallocated_requests
        except ImportError:
            raise ConfigError(
                "hisparse_device_tokens needs longctx.hisparse.cache, which is not available"
            ) from None
        s = self.spec
        assert s.hisparse_device_tokens is not None
        return HiSparseKVCache(
            s.cfg,
            layers,
            s.num_pages,
            s.kv_kind,
            self.dtype,
            self.device,
            device_tokens=s.hisparse_device_tokens,
            page_size=s.page_size,
            use_triton=s.use_triton,
            host_layout=layout,
            max_requests=preallocated_requests(
                s.max_running, s.num_pages, s.page_size, s.hisparse_device_tokens, s.max_context
            ),
            max_context=s.max_context,
        )

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            msg = self.transport.get(timeout=1.0)
            if msg is None:
                if not self.transport.driver_alive():
                    return
                continue
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, StatsRequest):
                if self.spec.tp_rank == 0:  # one answer per stage
                    self.transport.put(StageStats(msg.seq, self.spec.stage, self.stats()))
            elif isinstance(msg, RunPlan):
                self.step(msg)
            elif isinstance(msg, Release):
                self.worker.release(list(msg.rids))
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")

    def step(self, msg: RunPlan) -> None:
        spec, plan = self.spec, msg.plan
        h = topk = None
        T = plan.num_tokens
        if spec.stage > 0:
            h = torch.empty(T, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(h, src=spec.rank - spec.tp)
            if self.recv_topk:
                topk = torch.empty(T, spec.cfg.index_topk, dtype=torch.int32, device=self.device)
                dist.recv(topk, src=spec.rank - spec.tp)
        t0 = time.perf_counter()
        h = self.worker.forward(plan, h, topk)
        if spec.stage < spec.pp - 1:
            self._send(h, spec.rank + spec.tp)
            if self.send_topk:
                assert self.worker.last_topk is not None
                self._send(self.worker.last_topk, spec.rank + spec.tp)
        elif spec.tp_rank == 0:
            rows = self.worker.finish(plan, h)
            payload = pickle.dumps(BatchResult(plan.step_id, rows), protocol=pickle.HIGHEST_PROTOCOL)
            self.transport.put(Result(msg.seq, payload))
        else:  # the other TP ranks' lm_head shards, for rank 0's all-gather of the logits
            self.worker.finish_async(plan, h, sample=False)
        self.kv.end_step(self.step_barrier)
        self.busy_s += time.perf_counter() - t0
        self.steps += 1
        self.tokens += plan.num_tokens

    def _send(self, h: torch.Tensor, dst: int) -> None:
        while len(self._sends) >= MAX_PENDING_SENDS:
            self._sends.popleft()[0].wait()
        self._sends.append((dist.isend(h.contiguous(), dst=dst), h))

    def stats(self) -> dict[str, Any]:
        s = self.spec
        out: dict[str, Any] = {
            "stage": s.stage,
            "layers": list(s.layers),
            "tp": s.tp,
            "kv_bytes_device": self.kv.nbytes(),
            "host_pool_bytes": self.kv.layout.spec.nbytes,
            "host_pool_name": self.kv.layout.pool.name,
            "steps": self.steps,
            "tokens": self.tokens,
            "busy_s": self.busy_s,
        }
        out.update(self.kv.stats())
        return out

    def close(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.kv.close()
        if self.spec.store_host and dist.is_initialized():
            dist.destroy_process_group()


def stage_main(spec: StageSpec, transport: Transport, exit_process: bool = False) -> None:
    """Entry point of a stage process: build, say Ready, run until Shutdown; report any failure."""
    proc: StageProcess | None = None
    code = 0
    try:
        proc = StageProcess(spec, transport)
        transport.put(Ready(spec.rank, os.getpid()))
        proc.run()
    except BaseException as e:  # noqa: BLE001 (anything that stops a stage must reach the driver)
        code = 1
        lost = peer_lost(e)
        if lost is not None:  # a consequence: one line, not a traceback beside the cause's
            message = f"lost a peer rank: {lost}"
            print(
                f"longctx stage {spec.stage} (tp rank {spec.tp_rank}): {message}", file=sys.stderr, flush=True
            )
        else:
            message = one_line(e)
            if not isinstance(e, LongctxError):  # bad input / config says what is wrong in its message
                traceback.print_exc(file=sys.stderr)
        transport.put(Failed(spec.rank, spec.stage, spec.tp_rank, message, consequence=lost is not None))
    finally:
        try:
            if proc is not None and code == 0:
                proc.close()
        finally:
            transport.close()
    if exit_process:
        # everything is released; skip the interpreter teardown (seconds for torch + gloo on a
        # loaded machine) so a shutdown does not wait on it
        exit_now(code)
    sys.exit(code)


def exit_now(code: object) -> None:
    """Flush stdout / stderr and end the process without the interpreter's teardown; `code` as
    sys.exit takes it (None: 0; an int; anything else: 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def exit_with_driver(transport: Transport, poll_s: float = 1.0) -> None:
    """Watchdog thread of a local spawn: once the driver is gone, unlink the host-pool file this
    process still owns and exit. The loop in `StageProcess.run` notices a dead driver only between
    messages; a stage still starting (connecting to the driver's store, which retries for
    STORE_TIMEOUT) or blocked in a collective on such a peer would otherwise outlive it."""
    while transport.driver_alive():
        time.sleep(poll_s)
    unlink_owned()
    os._exit(1)


def spawn_main(spec: StageSpec, inbox: Any, outbox: Any) -> None:
    """`multiprocessing` target for a local spawn."""
    # tqdm's default lock is a named multiprocessing semaphore; this process ends with os._exit,
    # which never unlinks it, so the resource tracker would (with a "leaked semaphore" warning)
    tqdm.set_lock(threading.RLock())
    # Ctrl-C in a terminal, and systemd's or `timeout`'s SIGTERM, reach the whole process group: the
    # driver decides when its stages end (a server drains first; it shuts them down, escalating to
    # SIGKILL), and they exit with it through the watchdog below, not on the signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    transport = QueueTransport(inbox, outbox)
    threading.Thread(target=exit_with_driver, args=(transport,), name="driver-watch", daemon=True).start()
    stage_main(spec, transport, exit_process=True)
