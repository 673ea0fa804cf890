"""The torchrun launch (`longctx.stages.launch`) on one node, two ranks over gloo: the path several
nodes take, with every stage a torchrun rank rather than a process the engine spawns."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from longctx.server.testing import ServerProcess
from tests.server_helpers import wait_for

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")
PROMPT = "the quick brown fox"


def _launcher() -> list[str]:
    assert TORCHRUN is not None
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "longctx.stages.launch"]


def _env(tmp_path) -> dict[str, str]:
    # torchrun leaves torchelastic_* dirs in the temp dir: keep them in the test's
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _generate(cmd: list[str], model, env: dict[str, str], *extra: str) -> dict:
    args = ["generate", "--model", str(model), *extra, "--max-new-tokens", "6", "--temperature", "0"]
    r = subprocess.run([*cmd, *args, "--json", PROMPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("split", [["--pp", "2"], ["--tp", "2"]])
def test_generate_under_torchrun_matches_one_process(tiny_dir, tmp_path, split):
    env = _env(tmp_path)
    one = _generate([sys.executable, "-m", "longctx.cli"], tiny_dir, env)
    assert _generate(_launcher(), tiny_dir, env, *split)["token_ids"] == one["token_ids"]


def test_a_command_without_stages_under_torchrun_releases_the_other_rank(tiny_dir, tmp_path):
    """pp = tp = 1 in a world of two: rank 0 runs the command alone and the idle rank exits with it."""
    env = _env(tmp_path)
    one = _generate([sys.executable, "-m", "longctx.cli"], tiny_dir, env)
    assert _generate(_launcher(), tiny_dir, env)["token_ids"] == one["token_ids"]


def test_serve_under_torchrun_drives_the_ranks_and_drains(tiny_dir, tmp_path):
    """`serve --pp 2` under torchrun: the engine process drives the two torchrun ranks (it spawns no
    stages of its own, as it did before `longctx.stages.relay`), answers as one process does, and a
    SIGINT to torchrun (Ctrl-C) drains the running request before everything exits."""
    env = _env(tmp_path)
    one = _generate([sys.executable, "-m", "longctx.cli"], tiny_dir, env)
    s = ServerProcess(str(tiny_dir), "--pp", "2", env=env, launcher=_launcher())
    s.start()
    try:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        engine = psutil.Process(httpx.get(s.url + "/health").json()["engine_pid"])
        stage_children = [
            c for c in engine.children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())
        ]
        assert stage_children == [], [c.cmdline() for c in stage_children]
        ranks = psutil.Process(s.pid).children()
        assert len(ranks) == 2
        assert r.json()["choices"][0]["text"] == one["text"]  # as one process answers

        t, got = _running_request(s, max_tokens=200)
        s.proc.send_signal(signal.SIGINT)
        t.join(60)
        assert got and got[0].status_code == 200, got[0].text if got else s.log()[-3000:]
        assert got[0].json()["choices"][0]["finish_reason"] == "length"
        s.proc.wait(60)
        assert wait_for(
            lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), 30
        )
        assert "lost a peer rank" not in s.log(), s.log()[-3000:]
    finally:
        s.stop()


def _running_request(s: ServerProcess, max_tokens: int) -> tuple[threading.Thread, list[httpx.Response]]:
    """A greedy completion of max_tokens posted from a thread, returned once the engine runs it."""
    got: list[httpx.Response] = []
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t = threading.Thread(
        target=lambda: got.append(httpx.post(s.url + "/v1/completions", json=body, timeout=60))
    )
    t.start()
    assert wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 1, 20)
    return t, got


def test_a_rank_killed_under_torchrun_serve_fails_the_request_in_flight(tiny_dir, tmp_path):
    """SIGKILL of the stage rank that holds no frontend: the request in flight ends at once with 503
    engine_dead naming the rank (rank 0 heard of it only by a receive from any rank, which waits
    forever), and torchrun takes the job down."""
    s = ServerProcess(str(tiny_dir), "--pp", "2", env=_env(tmp_path), launcher=_launcher())
    s.start()
    try:
        t, got = _running_request(s, max_tokens=100000)
        front = psutil.Process(httpx.get(s.url + "/health").json()["engine_pid"]).parent()
        other = [p for p in psutil.Process(s.pid).children() if p.pid != front.pid]
        assert len(other) == 1
        t0 = time.monotonic()
        other[0].kill()
        t.join(30)
        assert got and got[0].status_code == 503, got[0].text if got else s.log()[-3000:]
        assert time.monotonic() - t0 < 15
        err = got[0].json()["error"]
        assert err["code"] == "engine_dead" and "stage 1" in err["message"], err
        assert "link to rank 0 broke" in err["message"], err
        s.proc.wait(90)
    finally:
        s.stop()
