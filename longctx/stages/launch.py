"""Run the stages under torchrun (several nodes): every torchrun rank is one stage process.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:PORT \\
        -m longctx.stages.launch serve --model DIR --pp 2 --tp 8 [serve options]

The arguments after the module are an ordinary `longctx` command line (`serve`, `generate`,
`score`, ...); it runs on global rank 0, whose Engine drives the stages: pp * tp must equal the
torchrun world size (rank = stage * tp + tp_rank, so a TP group sits on one node when tp divides
--nproc-per-node). The rendezvous is torchrun's (env://); nothing here picks a port.

How it differs from the local spawn (`longctx.stages.runtime.SpawnedStages`):
- rank 0 runs its own stage (stage 0, TP rank 0) in a thread beside the command;
- plans reach the other ranks by a gloo object broadcast from rank 0 (`ctrl` group) and results
  come back to rank 0 by gloo point-to-point sends (`results` group), received by one thread per
  rank;
- liveness: a rank that fails reports it (`Failed`); a rank that vanishes breaks its link to rank
  0's receiver for it, which reports it at once (a receive from any rank would wait forever), and
  its neighbours' gloo/NCCL connections, which fail and report. There is no pid to poll across
  nodes;
- `serve`: the engine runs in a process the frontend spawns, and drives these ranks through
  `longctx.stages.relay` (the frontend, rank 0's main process, holds them);
- signals: torchrun passes SIGINT / SIGTERM to every rank; the stage ranks ignore them and end
  when rank 0's command closes them (a server drains first) or their links to it break.
CI runs this module under `torchrun --standalone` on one node (tests/test_torchrun.py).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from longctx.errors import one_line
from longctx.stages.messages import Failed, Shutdown, StageSpec
from longctx.stages.process import exit_now, peer_lost, stage_main
from longctx.stages.runtime import attached_stages

# plans may be hours apart on an idle server: the control groups must not time out
IDLE_TIMEOUT = timedelta(days=365)
# how long a shutdown waits to tell the other ranks when rank 0's stage is gone
SHUTDOWN_BROADCAST_S = 5.0
# how long a shutdown waits for rank 0's stage thread and the receivers to end
CLOSE_JOIN_S = 30.0


def _broadcast_quietly(obj: Any, group: Any) -> None:
    with contextlib.suppress(Exception):  # (a rank that is gone: the others see the broken link)
        dist.broadcast_object_list([obj], src=0, group=group)


def _send_obj(obj: Any, group: Any) -> None:
    """Pickle `obj` to rank 0 of `group`: its length, then its bytes (gloo, CPU tensors)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=0, group=group)
    dist.send(data, dst=0, group=group)


def _recv_obj(src: int, group: Any) -> Any:
    """The next object rank `src` sent with `_send_obj`. A receive from one named rank, not from any:
    gloo fails the former at once when that rank dies, and leaves the latter waiting forever."""
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src=src, group=group)
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())


class _RankZeroTransport:
    """Rank 0's stage thread: plans from the driver (in-process queue), rebroadcast to all ranks."""

    def __init__(self, stages: TorchrunStages) -> None:
        self.stages = stages

    def get(self, timeout: float) -> Any:
        try:
            msg = self.stages.local.get(timeout=timeout)
        except queue.Empty:
            return None
        dist.broadcast_object_list([msg], src=0, group=self.stages.ctrl)
        return msg

    def put(self, msg: Any) -> None:
        self.stages.out.put(msg)

    def driver_alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class _RankTransport:
    """Ranks > 0: plans by broadcast from rank 0, results and reports sent to rank 0."""

    def __init__(self, ctrl: Any, results: Any) -> None:
        self.ctrl, self.results = ctrl, results

    def get(self, timeout: float) -> Any:
        buf: list[Any] = [None]
        dist.broadcast_object_list(buf, src=0, group=self.ctrl)
        return buf[0]

    def put(self, msg: Any) -> None:
        _send_obj(msg, self.results)

    def driver_alive(self) -> bool:
        return True

    def close(self) -> None:
        self.put(Shutdown())  # tells rank 0's receiver this rank is done


class TorchrunStages:
    """The `StageRuntime` process backend over an existing torchrun world (see the module doc)."""

    def __init__(self, ctrl: Any, results: Any) -> None:
        self.ctrl, self.results = ctrl, results
        self.world_size = dist.get_world_size()
        self.local: queue.Queue[Any] = queue.Queue()  # driver -> rank 0's stage thread
        self.out: queue.Queue[Any] = queue.Queue()  # every rank -> driver
        self.started = False
        self.closed = False
        self._threads: list[threading.Thread] = []

    def rendezvous(self) -> tuple[str, int]:
        return "", 0  # the process group exists already

    def start(self, specs: list[StageSpec]) -> None:
        dist.broadcast_object_list([specs], src=0, group=self.ctrl)
        self.started = True
        t_stage = threading.Thread(
            target=stage_main,
            args=(specs[0], _RankZeroTransport(self)),
            name="longctx-stage0-tp0",
            daemon=True,
        )
        receivers = [
            threading.Thread(
                target=self._receive, args=(spec,), name=f"longctx-results-{spec.rank}", daemon=True
            )
            for spec in specs[1:]
        ]
        self._threads = [t_stage, *receivers]
        for t in self._threads:
            t.start()

    def _receive(self, spec: StageSpec) -> None:
        """Results and reports of one rank, until its Shutdown; a broken link reports the rank as failed
        (a rank that vanishes sends nothing else, and there is no pid to poll on another node)."""
        try:
            while True:
                msg = _recv_obj(spec.rank, self.results)
                if isinstance(msg, Shutdown):
                    return
                self.out.put(msg)
        except Exception as e:  # noqa: BLE001 (a broken link is a dead stage)
            if not self.closed:
                why = peer_lost(e) or one_line(e)
                self.out.put(Failed(spec.rank, spec.stage, spec.tp_rank, f"its link to rank 0 broke: {why}"))

    def send(self, rank: int, msg: Any) -> None:
        if rank == 0:  # rank 0's stage thread broadcasts every message to all ranks
            self.local.put(msg)

    def get(self, timeout: float) -> Any:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            return None

    def dead(self, skip: Collection[int] = ()) -> tuple[int, int | None] | None:
        if 0 not in skip and self.started and not self.closed and not self._threads[0].is_alive():
            return 0, None
        return None

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if self.started:
            if self._threads[0].is_alive():
                self.local.put(Shutdown())
            else:  # rank 0's stage is gone: tell the other ranks directly, unless a dead one blocks it
                t = threading.Thread(
                    target=_broadcast_quietly,
                    args=(Shutdown(), self.ctrl),
                    name="longctx-shutdown",
                    daemon=True,
                )
                t.start()
                t.join(timeout=SHUTDOWN_BROADCAST_S)
            deadline = time.monotonic() + CLOSE_JOIN_S
            for t in self._threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: rank 0 runs the longctx command, every other rank serves its stage."""
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("longctx.stages.launch: run me under torchrun (RANK/WORLD_SIZE are not set)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    results = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    # (no destroy_process_group at the end: with the peers exiting at the same moment it aborted the
    # process now and then, "terminate called without an active exception"; `exit_now` skips teardown)
    if dist.get_rank() == 0:
        stages = TorchrunStages(ctrl, results)
        attached_stages(stages)
        try:
            from longctx.cli import main as cli_main

            return cli_main(argv)
        finally:
            if not stages.started:  # the command never built a runtime: release the ranks
                dist.broadcast_object_list([None], src=0, group=ctrl)
    # torchrun passes a SIGINT / SIGTERM on to every rank (and SIGKILLs them after its grace): as
    # in a local spawn, rank 0's command decides when the stages end (a server drains first), and
    # they end on its Shutdown or when their links to it break, not on the signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    buf: list[Any] = [None]
    dist.broadcast_object_list(buf, src=0, group=ctrl)
    if buf[0] is None:
        return 0
    stage_main(buf[0][dist.get_rank()], _RankTransport(ctrl, results))
    return 0


if __name__ == "__main__":
    try:
        rc: object = main()
    except SystemExit as e:  # (a stage rank ends with sys.exit; the CLI may too)
        rc = e.code
    exit_now(rc)
