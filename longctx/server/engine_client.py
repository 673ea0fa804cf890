"""Frontend side of the engine process: spawn it, route its outputs to waiting requests.

One `EngineClient` per server. It binds two ipc:// sockets in a fresh private temp dir, spawns
`engine_proc.main` with multiprocessing 'spawn', and runs two asyncio tasks: a receiver that
dispatches `OutputBatch` entries to per-request queues and `RpcReply` to futures, and a watchdog
that notices the process dying. A dead engine fails every pending request and RPC at once with
`EngineDeadError`, and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from longctx.errors import EngineDeadError
from longctx.server import engine_proc
from longctx.server import messages as m

log = logging.getLogger("longctx.server")
SOCKET_DIR_PREFIX = "longctx-"
STALE_SOCKET_DIR_AGE_S = 60.0
# a unix socket address holds at most this many bytes of path (sockaddr_un.sun_path less its NUL)
IPC_PATH_MAX = int(getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107)
# the longest socket path under a base dir: "/" + prefix + mkdtemp's 8 random characters + "/out"
_SOCKET_PATH_TAIL = 1 + len(SOCKET_DIR_PREFIX) + 8 + len("/out")


def socket_base_dir() -> str:
    """The dir that holds the private socket dir: the temp dir, unless a socket path under it would be
    longer than a unix socket address allows (a deep $TMPDIR); then the first of $XDG_RUNTIME_DIR and
    the system's temp dirs whose path is short enough and that this user can write. None fits: a
    one-line error that says what to set."""
    first = tempfile.gettempdir()
    candidates = [first, os.environ.get("XDG_RUNTIME_DIR", "")]
    # the dirs tempfile itself tries ($TMPDIR, $TEMP, $TMP, then the platform's own); private, so guarded
    candidates += getattr(tempfile, "_candidate_tempdir_list", list)()
    for d in candidates:
        if not d:
            continue
        d = os.path.abspath(d)
        if len(os.fsencode(d)) + _SOCKET_PATH_TAIL <= IPC_PATH_MAX and _writable_dir(d):
            if d != first:
                log.info(
                    "the temp dir %r is too deep for unix socket paths; the engine's sockets go in %r",
                    first,
                    d,
                )
            return d
    raise RuntimeError(
        f"the temp dir {first!r} is too long a path for the engine's unix sockets "
        f"(at most {IPC_PATH_MAX - _SOCKET_PATH_TAIL} characters) and no shorter temp dir is writable: "
        "set TMPDIR to a shorter directory"
    )


def _writable_dir(d: str) -> bool:
    return os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)


def sweep_stale_socket_dirs(
    directory: str | None = None, min_age_s: float = STALE_SOCKET_DIR_AGE_S
) -> list[str]:
    """Remove socket dirs that servers killed together with their engine left behind; returns them.

    A dir counts as stale when this user owns it, it is older than `min_age_s` (a server binds its
    sockets just after making the dir) and nothing listens on its sockets any more: a connect is
    refused. Liveness is asked of the sockets, not of a pid, so a live server in another pid
    namespace sharing the temp dir keeps its dir.
    """
    now = time.time()
    removed: list[str] = []
    for path in glob.glob(os.path.join(glob.escape(directory or socket_base_dir()), SOCKET_DIR_PREFIX + "*")):
        try:
            st = os.lstat(path)
            names = os.listdir(path) if stat.S_ISDIR(st.st_mode) else None
        except OSError:
            continue
        if (
            names is None  # (a symlink or a file)
            or st.st_uid != os.getuid()
            or now - st.st_mtime < min_age_s
            or not names  # (an empty dir of another longctx- name is not ours to judge)
            or not set(names) <= {"in", "out"}
            or any(_listening(os.path.join(path, n)) for n in names)
        ):
            continue
        engine_proc.remove_socket_dir(path, names)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (anything else: False)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # e.g. a full backlog or a permission error: not ours to judge stale
        return True


class RequestHandle:
    """Outputs of one request, in order. `get()` raises EngineDeadError if the engine dies."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.queue: asyncio.Queue[m.TokenOutput | BaseException] = asyncio.Queue()
        self.started = False  # the engine reported progress: no longer waiting for admission
        self.finished = False

    async def get(self, timeout: float | None = None) -> m.TokenOutput | None:
        """The next output, or None after `timeout` seconds without one."""
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
        except asyncio.TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class EngineClient:
    """Owns the engine process and the two sockets to it."""

    def __init__(self, spec: engine_proc.EngineSpec, log_level: int = logging.INFO) -> None:
        self.spec = spec
        self.log_level = log_level
        self.proc: Any = None
        self.ready: m.EngineReady | None = None
        self.dead_reason: str | None = None
        self.closing = False
        self.num_waiting = 0
        self.num_running = 0
        self.stats: dict[str, Any] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._tmpdir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._push: Any = None
        self._pull: Any = None
        self._ready_fut: asyncio.Future[m.EngineReady] | None = None
        self._relay: Any = None  # a longctx.stages.relay.StageRelay under torchrun

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> m.EngineReady:
        base = socket_base_dir()
        swept = sweep_stale_socket_dirs(base)
        if swept:
            log.info("removed %d stale socket dir(s) of killed servers", len(swept))
        self._tmpdir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=base)
        to_engine = f"ipc://{os.path.join(self._tmpdir, 'in')}"
        from_engine = f"ipc://{os.path.join(self._tmpdir, 'out')}"
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(to_engine)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(from_engine)
        self._ready_fut = asyncio.get_running_loop().create_future()
        ctx = mp.get_context("spawn")
        # under torchrun (`longctx.stages.launch serve`) this process holds the ranks: the engine
        # process drives them through a relay instead of spawning stages of its own
        # (only `longctx.stages.launch` attaches stages, and it has imported the runtime: the frontend
        # of a plain `serve` does not load torch)
        runtime = sys.modules.get("longctx.stages.runtime")
        attached = runtime.take_attached_stages() if runtime is not None else None
        if attached is not None:
            from longctx.stages.relay import StageRelay

            self._relay = StageRelay(attached, ctx)
        self.proc = ctx.Process(
            target=engine_proc.main,
            args=(
                self.spec,
                to_engine,
                from_engine,
                os.getpid(),
                self.log_level,
                self._relay.proxy if self._relay is not None else None,
            ),
            name="longctx-engine",
            # not daemonic: the engine spawns its own stage processes (pp/tp > 1); it exits by
            # itself when this process goes away (engine_proc watches its parent pid)
            daemon=False,
        )
        self.proc.start()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._ready_fut), timeout)
        except asyncio.TimeoutError:
            self._mark_dead(f"engine did not start within {timeout:.0f} s")
        if self.ready is None:
            await self.close()
            raise EngineDeadError(self.dead_reason or "engine failed to start")
        return self.ready

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the engine process to exit, then make sure it has (terminate, kill)."""
        self.closing = True
        if self.proc is not None and self.proc.is_alive() and self._push is not None:
            with contextlib.suppress(asyncio.TimeoutError, zmq.ZMQError):
                await asyncio.wait_for(self._push.send(m.encode(m.Shutdown())), 1.0)
            deadline = time.monotonic() + timeout
            while self.proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.is_alive():
                log.warning("engine process did not exit; terminating it")
                self.proc.terminate()
                await asyncio.to_thread(self.proc.join, 5.0)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5.0)
        self._mark_dead("server is shutting down")
        if self._relay is not None:
            await asyncio.to_thread(self._relay.close)
            self._relay = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        for s in (self._push, self._pull):
            if s is not None:
                s.close(0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    def end_all(self, reason: str) -> None:
        """Fail every pending request and call now with EngineDeadError(reason); no new ones are taken
        (a shutdown whose drain ran out of time)."""
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            if not self.closing and self.ready is not None:  # (a failed start is the caller's to report)
                log.error("engine is down: %s", reason)
        err = EngineDeadError(self.dead_reason)
        for h in self._handles.values():
            h.finished = True
            h.queue.put_nowait(err)
        self._handles.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(err)
            self._ready_fut.exception()  # retrieved here so asyncio does not warn

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self.proc is not None and not self.proc.is_alive():
                if not self.closing:
                    self._mark_dead(f"engine process exited unexpectedly (exit code {self.proc.exitcode})")
                return

    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            raw = await self._pull.recv()
            try:
                msg = m.decode(raw)
            except ValueError as e:
                log.error("%s", e)
                continue
            if isinstance(msg, m.OutputBatch):
                self.num_waiting, self.num_running = msg.num_waiting, msg.num_running
                if msg.stats is not None:
                    self.stats = dict(msg.stats)
                for out in msg.outputs:
                    h = self._handles.get(out.rid)
                    if h is None:
                        continue
                    h.started = True
                    if out.finished:
                        h.finished = True
                        del self._handles[out.rid]
                    h.queue.put_nowait(out)
            elif isinstance(msg, m.RpcReply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, m.EngineReady):
                if self._ready_fut is not None and not self._ready_fut.done():
                    self._ready_fut.set_result(msg)
            elif isinstance(msg, m.EngineFailed):
                self._mark_dead(f"engine failed: {msg.error}")

    # ---- requests -------------------------------------------------------------------------------
    def _check(self) -> None:
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")

    def num_queued(self) -> int:
        """Requests sent to the engine that it has not started on (in flight or in its queue)."""
        return sum(1 for h in self._handles.values() if not h.started)

    def num_in_flight(self) -> int:
        return len(self._handles)

    async def submit(
        self, rid: str, prompt_ids: list[int], params: m.WireSamplingParams, pin_prefix: bool = False
    ) -> RequestHandle:
        self._check()
        h = RequestHandle(rid)
        self._handles[rid] = h
        await self._push.send(m.encode(m.AddRequest(rid, tuple(prompt_ids), params, pin_prefix)))
        return h

    async def abort(self, rid: str) -> None:
        """Cancel a request; its pages come back as soon as the engine reads this."""
        h = self._handles.pop(rid, None)
        if h is None or not self.healthy:
            return
        h.finished = True
        with contextlib.suppress(zmq.ZMQError):
            await self._push.send(m.encode(m.AbortRequest(rid)))

    async def call(self, make: Any, timeout: float | None = None, cancel: Any = None) -> Any:
        """Send `make(call_id)` and wait for its RpcReply; raises EngineDeadError / RuntimeError.
        `cancel(call_id)`: the message that withdraws the call, sent if the wait is cancelled."""
        self._check()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        await self._push.send(m.encode(make(call_id)))
        try:
            reply: m.RpcReply = await asyncio.wait_for(fut, timeout)
        except asyncio.CancelledError:
            if cancel is not None and self._push is not None:
                with contextlib.suppress(zmq.ZMQError):
                    await self._push.send(m.encode(cancel(call_id)))
            raise
        finally:
            self._calls.pop(call_id, None)
        if not reply.ok:
            raise RpcError(reply.error or "engine call failed", reply.error_code)
        return reply.result


class RpcError(RuntimeError):
    """The engine answered an RPC with an error (its one-line message; `code`: a request error's, see
    `messages.TokenOutput.error_code`)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
