"""Helpers shared by the server tests (test_server, test_server_real, test_server_robustness):
starting a fake-engine server, an OpenAI client on a server, /v1/stats, polling, and the
client-disconnect check that both engines must pass."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from longctx.server.testing import ServerProcess


def fake_server(model_dir: Any, *args: str, new_session: bool = False, **opts: Any) -> ServerProcess:
    """`longctx serve --fake-engine <opts as JSON> *args` on model_dir (not started)."""
    return ServerProcess(str(model_dir), "--fake-engine", json.dumps(opts), *args, new_session=new_session)


def with_chat_template(model_dir: Path, template: str) -> Path:
    """model_dir with a tokenizer_config.json holding only `template` as its chat template (the fake
    engine's byte-level tokenizer reads it)."""
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return model_dir


def openai_client(server: ServerProcess) -> openai.OpenAI:
    """The openai client on server's /v1, without retries (a failure must show as one)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def stats(server: ServerProcess, timeout: float = 10) -> dict:
    return httpx.get(server.url + "/v1/stats", timeout=timeout).json()


def wait_for(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Polls pred every `interval` seconds until it holds (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


def check_disconnect_frees_pages(
    server: ServerProcess,
    body: dict,
    *,
    after_events: int,
    http_timeout: float,
    free_within: float,
    idle_within: float = 5.0,
    stats_timeout: float = 10,
    interval: float = 0.02,
) -> None:
    """Waits (up to idle_within s) for nothing to run, streams `body`, closes the connection after
    `after_events` data events (the request holds pages by then), and asserts that closing it
    aborted the request: within free_within s its pages are back and nothing is running. Pages the
    prefix cache keeps (a prefilled prompt's, evictable once no request holds them) are not held."""

    def st() -> dict:
        return stats(server, stats_timeout)

    def held(s: dict) -> int:
        return s["pages_used"] - s.get("prefix_cache_cached_pages", 0)

    assert wait_for(lambda: st()["num_running"] == 0, idle_within, interval)
    base = held(st())
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=http_timeout) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: {")
            if n == after_events:
                assert held(st()) > base  # the request holds its pages
                break
    assert wait_for(lambda: held(s := st()) == base and s["num_running"] == 0, free_within, interval)
