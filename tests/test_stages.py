"""Pipeline stages and TP groups as real processes (gloo on CPU) against the single-process engine."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from longctx import Engine
from longctx.engine.plan import BatchPlan, RowPlan
from longctx.errors import EngineDeadError

PAGES = 16
CHUNK = 29  # several prefill chunks per prompt
PROMPT = [(i * 37 + 11) % 256 for i in range(70)]
GEN_PROMPTS = [PROMPT[:23], PROMPT[30:61]]
NEW = 6


def _engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, device="cpu", kv_pages=PAGES, chunk_size=CHUNK, **kw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    with _engine(tiny_dir) as e:
        logits = e.score(PROMPT)
        tokens = [c.token_ids for c in e.generate(GEN_PROMPTS, max_new_tokens=NEW, ignore_eos=True)]
    return logits, tokens


@pytest.fixture(scope="module")
def pp2tp2(tiny_dir):
    with _engine(tiny_dir, pp=2, tp=2) as e:
        yield e


def _check_parity(eng: Engine, reference) -> None:
    logits, tokens = reference
    assert _rel(eng.score(PROMPT), logits) <= 1e-5
    got = [c.token_ids for c in eng.generate(GEN_PROMPTS, max_new_tokens=NEW, ignore_eos=True)]
    assert got == tokens


@pytest.mark.parametrize("pp,tp", [(2, 1), (3, 1), (1, 2)])
def test_parity(tiny_dir, reference, pp, tp):
    with _engine(tiny_dir, pp=pp, tp=tp) as eng:
        _check_parity(eng, reference)
        stages = eng.stats()["stages"]
    assert len(stages) == pp
    # the stages cover the layers in order, each with its own KV only
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == eng.config.num_hidden_layers
    assert all(a["layers"][1] == b["layers"][0] for a, b in zip(stages, stages[1:], strict=False))
    assert all(s["tp"] == tp and s["steps"] > 0 and s["busy_s"] > 0 for s in stages)
    assert all(s["kv_bytes_device"] > 0 and s["host_pool_bytes"] > 0 for s in stages)


def test_parity_pp2_tp2(pp2tp2, reference):
    _check_parity(pp2tp2, reference)


def test_tp_ranks_share_one_host_pool_file(pp2tp2):
    pp2tp2.generate([[3, 1, 4, 1, 5]], max_new_tokens=2)  # some rows to back up, whatever ran before
    stages = pp2tp2.stats()["stages"]
    names = [s["host_pool_name"] for s in stages]
    assert len(set(names)) == len(stages)
    for s in stages:
        assert len(s["pids"]) == 2
        for pid in s["pids"]:
            with open(f"/proc/{pid}/maps") as f:
                lines = [ln for ln in f if "longctx-" in ln]
            # exactly this stage's file (shown as "(deleted)": it was unlinked after every rank attached)
            assert lines and all(s["host_pool_name"] in ln for ln in lines), (pid, lines)
            assert all(ln.rstrip().endswith("(deleted)") for ln in lines)
        assert not os.path.exists(os.path.join("/dev/shm", s["host_pool_name"]))
        assert s["host_backup_bytes"] > 0  # TP rank 0 backed up the new rows


def _plan(step: int, rid: str, tokens: list[int], start: int, page: int) -> BatchPlan:
    return BatchPlan(step, (RowPlan(rid, tuple(tokens), start, (page,), logits="all"),))


def test_plans_in_flight_match_sequential(pp2tp2):
    rt = pp2tp2.runner
    a, b = PROMPT[:40], PROMPT[25:60]

    def plans(p0: int) -> list[BatchPlan]:
        # a's second chunk is in flight with its first: stages run plans in order, so its KV is there
        return [
            _plan(0, "a", a[:20], 0, p0),
            _plan(1, "b", b[:17], 0, p0 + 1),
            _plan(2, "a", a[20:], 20, p0),
            _plan(3, "b", b[17:], 17, p0 + 1),
        ]

    seq = [rt.run(p) for p in plans(0)]
    for p in plans(2):
        rt.submit(p)
    assert rt.in_flight == 4
    par = [rt.collect() for _ in range(4)]
    assert rt.in_flight == 0
    for x, y in zip(seq, par, strict=True):
        assert x.step_id == y.step_id
        assert torch.equal(x.rows[0].logits, y.rows[0].logits)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie no longer holds anything
        return f.read().split(")")[-1].split()[0] == "Z"


def test_killed_stage_fails_fast_and_leaves_nothing(tiny_dir, caplog):
    # a fresh pool file of a creator this pid namespace cannot see (a pid above pid_max): another
    # container's engine, starting up, on a shared /dev/shm; our close must leave it alone
    with open("/proc/sys/kernel/pid_max") as f:
        foreign = os.path.join("/dev/shm", f"longctx-s0-{int(f.read()) + 1}-{os.urandom(8).hex()}")
    open(foreign, "wb").close()
    eng = _engine(tiny_dir, pp=2)
    stages = eng.stats()["stages"]
    pids = [p for s in stages for p in s["pids"]]
    spawned = eng.runner._p
    sems = [
        "sem." + lock._semlock.name.lstrip("/")
        for q in [*spawned.inboxes, spawned.outbox]
        for lock in (q._rlock, q._wlock, q._sem)
    ]
    assert sems and all(os.path.exists(os.path.join("/dev/shm", n)) for n in sems)
    victim = stages[1]["pids"][0]
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(0.5, kill)
    timer.start()
    try:
        with pytest.raises(EngineDeadError, match="stage 1"):
            eng.generate([PROMPT[:10]], max_new_tokens=1000, ignore_eos=True)
        assert killed_at and time.monotonic() - killed_at[0] < 5.0
        with pytest.raises(EngineDeadError):  # the engine stays dead
            eng.score(PROMPT[:5])
        # the failed calls' cleanup says nothing of its own (it used to log a traceback per request)
        assert "could not abort" not in caplog.text
    finally:
        timer.cancel()
        eng.close()
        foreign_kept = os.path.exists(foreign)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(foreign)
    eng.close()  # idempotent
    assert foreign_kept
    gc.collect()
    assert not [n for n in sems if os.path.exists(os.path.join("/dev/shm", n))]  # the queues' semaphores
    assert all(_gone(p) for p in pids)
    for s in stages:
        assert not os.path.exists(os.path.join("/dev/shm", s["host_pool_name"]))
    assert not [f for f in os.listdir("/dev/shm") if any(f"-{p}-" in f for p in pids)]


def test_hisparse_swaps_in_from_the_shared_host_pool(tiny_dir, reference):
    """pp=2 x tp=2 with a device cap below the context: misses come from the stage's one host pool."""
    with _engine(tiny_dir, pp=2, tp=2, hisparse_device_tokens=40) as eng:
        _check_parity(eng, reference)
        s = eng.stats()
    assert s["hisparse"]["misses"] > 0 and s["hisparse"]["device_tokens_max"] <= 40
    assert all(st["hisparse"]["requests"] == 0 for st in s["stages"])  # released when finished


def test_stage_processes_end_with_the_interpreter(tiny_dir):
    """An engine never closed: its stage processes still go when the driver exits."""
    code = (
        "import sys; from longctx import Engine\n"
        f"e = Engine({str(tiny_dir)!r}, device='cpu', kv_pages=4, pp=2)\n"
        "print(' '.join(str(p) for s in e.stats()['stages'] for p in s['pids']), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def test_stages_of_a_driver_killed_while_they_start_exit_too(tiny_dir):
    """The driver SIGKILLed right after spawning its stages: they would wait for its store (up to
    STORE_TIMEOUT) before their loop could notice; they and the resource tracker go within seconds."""
    code = (
        "import os, signal, psutil\n"
        "from longctx.stages import runtime\n"
        "start = runtime.SpawnedStages.start\n"
        "def start_then_die(self, specs):\n"
        "    start(self, specs)\n"
        "    print(' '.join(str(c.pid) for c in psutil.Process().children()), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "runtime.SpawnedStages.start = start_then_die\n"
        "from longctx import Engine\n"
        f"Engine({str(tiny_dir)!r}, device='cpu', kv_pages=4, pp=2)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) >= 2  # the stages (and multiprocessing's resource tracker)
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def test_a_stage_that_cannot_be_started_is_the_error(tiny_dir, monkeypatch):
    """Process.start failing for the second stage (fork/exec out of memory or processes): the caller
    gets that error (not close()'s complaint about joining a process never started), and the first
    stage, already running, is stopped."""
    import multiprocessing.context

    real_start = multiprocessing.context.SpawnProcess.start
    started: list[int] = []

    def start(self):
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        real_start(self)
        started.append(self.pid)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        _engine(tiny_dir, pp=2)
    assert started and _gone(started[0])


class _DriverGone:
    def driver_alive(self) -> bool:
        return False


def _own_pool_then_lose_the_driver(q) -> None:  # runs in a spawned process
    from longctx.kvstore.host_pool import HostPool
    from longctx.stages.process import exit_with_driver

    pool, _ = HostPool.create(4096, "watch")  # created, not unlinked yet (no peer attached)
    q.put(pool.path)
    q.close()
    q.join_thread()  # flushed before the watchdog's os._exit (under load the feeder thread lost it)
    exit_with_driver(_DriverGone(), poll_s=0.01)


def test_watchdog_unlinks_the_pool_it_owns_when_the_driver_is_gone():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_own_pool_then_lose_the_driver, args=(q,))
    p.start()
    path = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 1 and not os.path.exists(path)


def test_a_peer_that_died_silently_is_blamed_before_the_stage_that_reported():
    """A stage killed without a report (SIGKILL, OOM) breaks its peers' connection; whichever
    report reaches the driver first, the dead silent stage is named as the cause. A stage that
    failed and reported is named itself, also when its peers then fail and exit."""
    from longctx.stages.messages import Failed
    from longctx.stages.runtime import StageRuntime

    class Procs:
        def __init__(self, queued, gone):
            self.queued, self.gone = list(queued), gone  # gone: rank -> exit code

        def get(self, timeout):
            return self.queued.pop(0) if self.queued else None

        def dead(self, skip=()):
            return next(((r, c) for r, c in sorted(self.gone.items()) if r not in skip), None)

    rt = object.__new__(StageRuntime)
    rt.tp, rt.layers = 1, [range(0, 3), range(3, 6)]
    lost = Failed(0, 0, 0, "RuntimeError: Connection closed by peer")
    rt._p = Procs([], {1: -9})  # stage 1 was killed; stage 0 reports the broken link
    why = rt._cause(lost)
    assert why.startswith("stage 1 (layers [3, 4, 5], tp rank 0) exited with code -9") and "stage 0" in why
    own = Failed(0, 0, 0, "ValueError: bad plan")  # stage 0 failed itself, exited, and stage 1 then did too
    rt._p = Procs([Failed(1, 1, 0, "RuntimeError: Connection closed by peer")], {0: 1, 1: 1})
    assert rt._cause(own) == "stage 0 (layers [0, 1, 2], tp rank 0) failed: ValueError: bad plan"


def test_a_collective_broken_by_a_dead_peer_is_one_line():
    """gloo and NCCL errors that only say a peer went away are reported in a few words (the driver
    names the dead rank as the cause); other errors keep their message and traceback."""
    from longctx.stages.process import peer_lost

    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:20367. This is typically caused by a remote worker crashing."
    )
    assert peer_lost(RuntimeError(gloo)) == "Connection closed by peer"
    reset = "[pair.cc:537] Read error [127.0.0.1]:31656: Connection reset by peer. This is typically ..."
    assert peer_lost(RuntimeError(reset)) == "Connection reset by peer"
    nccl = type("DistBackendError", (RuntimeError,), {})(
        "NCCL error: remote process exited or there was a network error"
    )
    assert peer_lost(nccl) == "remote process exited"
    assert peer_lost(RuntimeError("shape mismatch: [2, 3] vs [3, 2]")) is None
    assert peer_lost(OSError("Connection reset by peer")) is None  # not a collective's error


def test_a_lost_peer_report_gives_way_to_the_one_naming_the_cause() -> None:
    """`StageRuntime._cause`: when the first report is a consequence (a rank that saw its peer vanish on
    a collective) and the report naming the cause (under torchrun: rank 0's receiver thread of the
    vanished rank) comes after it, within the settle time, the cause is what is reported; a cause seen
    first stays; a consequence alone is reported once the longer settle time passes."""
    import types

    from longctx.stages.messages import Failed
    from longctx.stages.runtime import StageRuntime

    def cause(first: Failed, later: list[Failed], after: float) -> tuple[str, float]:
        t0 = time.monotonic()

        def get(timeout: float):  # type: ignore[no-untyped-def]
            return later.pop(0) if later and time.monotonic() - t0 >= after else None

        fake = types.SimpleNamespace(
            _p=types.SimpleNamespace(get=get, dead=lambda skip=(): None), _where=lambda r: f"rank {r}"
        )
        why = StageRuntime._cause(fake, first)  # type: ignore[arg-type]
        return why, time.monotonic() - t0

    lost = Failed(0, 0, 0, "lost a peer rank: Connection reset by peer", consequence=True)
    broke = Failed(1, 1, 0, "its link to rank 0 broke: Connection closed by peer")
    why, _ = cause(lost, [broke], after=0.5)  # (later than the plain settle time)
    assert why == "rank 1 failed: its link to rank 0 broke: Connection closed by peer"
    why, _ = cause(broke, [lost], after=0.0)
    assert why.startswith("rank 1 failed: its link")
    why, took = cause(lost, [], after=0.0)
    assert why == "rank 0 failed: lost a peer rank: Connection reset by peer" and took < 10
