"""Drive stages whose backend lives in another process: `longctx serve` under torchrun.

Under torchrun the world (and stage 0's thread, `longctx.stages.launch.TorchrunStages`) lives in
global rank 0's main process, which for `serve` is the HTTP frontend; the engine that drives the
stages is a process the frontend spawns. `StageRelay` runs in the frontend beside the real backend,
and hands the engine process a `RelayStages`: the same interface `StageRuntime` drives
(`rendezvous`, `start`, `send`, `get`, `dead`, `close`), each call a message over two
multiprocessing queues. Without it the engine process would spawn a second set of stages on rank
0's node and leave the torchrun ranks idle.

Two threads in the frontend: one applies the engine's calls in order, one forwards everything the
stages send (and a dead rank 0 stage) back. If the engine process dies without closing the stages,
`StageRelay.close` closes them, so the other ranks end and torchrun exits.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Collection
from typing import Any

from longctx.stages.messages import Failed, StageSpec

log = logging.getLogger("longctx.stages")
POLL_S = 0.1
# how long the engine process waits for the frontend to close the stages (TorchrunStages joins its
# two threads for up to 30 s each)
CLOSE_WAIT_S = 70.0


class RelayStages:
    """The engine process's side: forwards each call to the `StageRelay` in the frontend."""

    def __init__(self, world_size: int, cmds: Any, results: Any) -> None:
        self.world_size = world_size
        self.cmds, self.results = cmds, results
        self.closed = False
        self._dead: tuple[int, int | None] | None = None

    def rendezvous(self) -> tuple[str, int]:
        return "", 0  # the torchrun process group exists already

    def start(self, specs: list[StageSpec]) -> None:
        self.cmds.put(("start", specs))

    def send(self, rank: int, msg: Any) -> None:
        self.cmds.put(("send", rank, msg))

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, item = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if kind == "msg":
                return item
            if kind == "dead":
                self._dead = item

    def dead(self, skip: Collection[int] = ()) -> tuple[int, int | None] | None:
        if self._dead is not None and self._dead[0] not in skip:
            return self._dead
        return None

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.cmds.put(("close", graceful))
            # a graceful close waits for the stages to end; a failed one (the driver is dying) leaves
            # it to the relay, so the requests in flight fail now
            deadline = time.monotonic() + (CLOSE_WAIT_S if graceful else 0.0)
            while time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    if self.results.get(timeout=max(0.0, deadline - time.monotonic()))[0] == "closed":
                        break
        for q in (self.cmds, self.results):
            q.cancel_join_thread()
            q.close()


class StageRelay:
    """The frontend's side: applies a `RelayStages`' calls to `stages` (the real backend)."""

    def __init__(self, stages: Any, ctx: Any) -> None:
        self.stages = stages
        self.cmds, self.results = ctx.Queue(), ctx.Queue()
        self.proxy = RelayStages(stages.world_size, self.cmds, self.results)
        self._done = threading.Event()
        self._started = False
        self._threads = [
            threading.Thread(target=self._apply, name="longctx-relay-calls", daemon=True),
            threading.Thread(target=self._forward, name="longctx-relay-results", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _apply(self) -> None:
        while not self._done.is_set():
            try:
                cmd = self.cmds.get(timeout=POLL_S)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            op = cmd[0]
            try:
                if op == "start":
                    self.stages.start(cmd[1])
                    self._started = True
                elif op == "send":
                    self.stages.send(cmd[1], cmd[2])
                elif op == "close":
                    try:
                        self._close_stages(cmd[1])
                    finally:
                        self.results.put(("closed", None))
                    return
            except Exception as e:  # noqa: BLE001 (the engine process hears of it as a failed stage)
                self.results.put(("msg", Failed(0, 0, 0, f"the stage relay failed to {op}: {e}")))

    def _forward(self) -> None:
        reported = False
        while not self._done.is_set():
            msg = self.stages.get(POLL_S)
            if msg is not None:
                self.results.put(("msg", msg))
            elif self._started and not reported and (gone := self.stages.dead()) is not None:
                self.results.put(("dead", gone))
                reported = True

    def _close_stages(self, graceful: bool) -> None:
        if not getattr(self.stages, "closed", False):
            self.stages.close(graceful)

    def close(self) -> None:
        """After the engine process is gone: close the stages if it did not, stop both threads."""
        self._done.set()
        for t in self._threads:
            t.join(timeout=5.0)
        if self._started:
            self._close_stages(graceful=False)
        for q in (self.cmds, self.results):
            q.cancel_join_thread()
            q.close()
