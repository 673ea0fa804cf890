"""Run `longctx serve` as a real subprocess on a free port (tests and bench/serve_load.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import httpx

_URL = re.compile(r"longctx serving .* at (http://\S+) ")


class ServerProcess:
    """`longctx serve --port 0 ...` in a child process; `url` is read from its log once it is up.

    Use as a context manager; `stop()` sends SIGTERM (a drain) and waits, killing on timeout.
    """

    def __init__(
        self,
        model: str,
        *args: str,
        startup_timeout: float = 180.0,
        env: dict | None = None,
        new_session: bool = False,
        launcher: list[str] | None = None,
    ) -> None:
        """`new_session`: the server leads its own process group (signal it all with `os.killpg(pid)`,
        as a terminal's Ctrl-C or systemd's stop would). `launcher`: what runs the `serve ...`
        arguments (default `python -m longctx.cli`; e.g. torchrun ... -m longctx.stages.launch)."""
        self.model = model
        self.new_session = new_session
        self.args = list(args)
        self.launcher = launcher or [sys.executable, "-m", "longctx.cli"]
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        fd, path = tempfile.mkstemp(prefix="longctx-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        # the log outlives `stop()` (callers read it after) and goes with this object or at exit
        self._remove_log = weakref.finalize(self, self.log_path.unlink, missing_ok=True)

    def start(self) -> ServerProcess:
        cmd = [*self.launcher, "serve", "--model", self.model, "--port", "0", *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=self.new_session
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            m = _URL.search(self.log())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        else:
            self.stop(timeout=5)
            raise RuntimeError(f"server did not start in {self.startup_timeout} s:\n{self.log()[-3000:]}")
        # the log line comes from the lifespan; wait until requests are actually served
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server never became healthy:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._remove_log()
