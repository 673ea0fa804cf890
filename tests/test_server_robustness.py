"""Server robustness: API key, queue limit (429), fuzzed request bodies, engine death, SIGTERM drain.

Each test starts its own `longctx serve --fake-engine` subprocess (about a second each).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longctx.server.protocol import engine_error

from .server_helpers import fake_server, wait_for

# ---- API key + fuzz (one server) -----------------------------------------------------------------

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with fake_server(
        tmp_path_factory.mktemp("keyed"), "--api-key", KEY, "--max-context", "256", step_delay_s=0.0
    ) as s:
        yield s


def test_api_key(keyed):
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(keyed.url + "/v1/completions", json=body).status_code == 401
    r = httpx.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert httpx.post(keyed.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.post(keyed.url + "/tokenize", json={"prompt": "hi"}, headers=AUTH).json()["count"] == 2
    assert httpx.post(keyed.url + "/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
SAMPLING = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "min_p",
    "logit_bias",
    "stop_token_ids",
    "max_completion_tokens",
    "top_logprobs",
    "echo",
]
small_ints = st.integers(-3, 300)
field_values = {
    "max_tokens": small_ints | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values,
    "stream": st.booleans() | json_values,
    "logprobs": st.integers(-1, 25) | st.booleans() | json_values,
    "stop": st.lists(st.text(max_size=3), max_size=3) | json_values,
    "model": st.sampled_from(["fake", "x"]) | json_values,
    "min_tokens": small_ints | json_values,
    "logit_bias": st.dictionaries(
        st.sampled_from(["5", "-1", "400", "x", " 7"]), st.floats(-150, 150), max_size=3
    )
    | json_values,
    "stop_token_ids": st.lists(st.integers(-2, 400), max_size=3) | json_values,
}


def _fields() -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={k: field_values.get(k, json_values) for k in SAMPLING})


message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bad"]) | json_values,
        "content": st.text(max_size=30) | json_values,
        "name": json_values,
    },
)
completion_body = st.tuples(
    _fields(),
    st.fixed_dictionaries(
        {},
        optional={"prompt": st.text(max_size=40) | st.lists(st.integers(-5, 400), max_size=8) | json_values},
    ),
)
chat_body = st.tuples(
    _fields(), st.fixed_dictionaries({}, optional={"messages": st.lists(message, max_size=3) | json_values})
)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    which=st.sampled_from(["completions", "chat"]),
    comp=completion_body,
    chat=chat_body,
    junk=st.one_of(st.none(), json_values, st.binary(max_size=40)),
)
def test_fuzz_request_schema_never_5xx(keyed, which, comp, chat, junk):
    path = "/v1/completions" if which == "completions" else "/v1/chat/completions"
    fields, extra = comp if which == "completions" else chat
    body: dict | object = {**fields, **extra}
    with httpx.Client(base_url=keyed.url, headers=AUTH, timeout=30) as h:
        if junk is not None and isinstance(junk, bytes):
            r = h.post(path, content=junk)
        elif junk is not None and not isinstance(junk, dict):
            r = h.post(path, content=json.dumps(junk))
        else:  # json.dumps, unlike httpx, writes NaN / Infinity: the server must reject those too
            r = h.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert h.get("/health").status_code == 200


# ---- admission -----------------------------------------------------------------------------------


def test_queue_limit_429(tmp_path):
    # 8 pages of 64 tokens: a request for ~400 tokens takes 7, so the next ones wait for pages
    with fake_server(
        tmp_path, "--max-queue", "2", "--max-context", "512", total_pages=8, step_delay_s=0.003
    ) as s:
        body = {"prompt": "abc", "max_tokens": 400}
        results: list[int] = []

        def post():
            results.append(httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=post) for _ in range(3)]
        threads[0].start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 1)
        threads[1].start()
        threads[2].start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["in_flight"] == 3)
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        # every refusal says when to retry: plain, streamed (before its first event), a document upload
        assert r.headers["retry-after"] == "1"
        chat = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 400, "stream": True}
        for path, refused in [
            ("/v1/completions", {**body, "stream": True}),
            ("/v1/chat/completions", chat),
            ("/v1/documents", {"text": "a document"}),
        ]:
            r = httpx.post(s.url + path, json=refused)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", (path, r.text)
            assert r.headers["retry-after"] == "1", path
        for t in threads:
            t.join(60)
        assert results == [200, 200, 200]
        # a request's n choices are n engine requests: 3 of them never fit a queue of 2 (a 400, not a 429)
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["in_flight"] == 0)
        r = httpx.post(s.url + "/v1/completions", json={**body, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "retry-after" not in r.headers
        assert (
            httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 4, "n": 2}).status_code == 200
        )
        # so are several prompts' choices: 2 prompts x n=2 never fit either
        r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "2 prompts x n=2" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": ["a", "b"], "max_tokens": 4})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_the_engines_own_full_queue_is_a_429_with_retry_after():
    """The scheduler's queue limit (an error event, not the frontend's check) is retried the same way."""
    r = engine_error("the engine's queue is full", "queue_full").response()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    bad = engine_error("token 9 is outside the vocabulary", "invalid_value", "logit_bias").response()
    assert bad.status_code == 400 and "retry-after" not in bad.headers


def test_engine_death_fails_fast_with_503(tmp_path):
    with fake_server(tmp_path, step_delay_s=0.01) as s:
        health = httpx.get(s.url + "/health").json()
        got: list[httpx.Response] = []

        def long_request():
            got.append(
                httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100000}, timeout=30)
            )

        t = threading.Thread(target=long_request)
        t.start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 1)
        t0 = time.monotonic()
        os.kill(health["engine_pid"], signal.SIGKILL)
        t.join(15)
        assert (
            got and got[0].status_code == 503 and time.monotonic() - t0 < 5
        )  # seconds, on a loaded 2-core CI box
        assert "engine" in got[0].json()["error"]["message"]
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "unhealthy"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r_doc = httpx.post(s.url + "/v1/documents", json={"text": "a document"})
        assert r_doc.status_code == 503
        # a restarted server may take them: each 503 says when to try again
        assert [x.headers.get("retry-after") for x in (got[0], h, r, r_doc)] == ["1"] * 4
        rc = s.stop()
        assert rc == 0, s.log()[-4000:]


def test_an_upload_whose_client_hangs_up_is_counted(tmp_path):
    """A document upload is counted in longctx_requests_total{endpoint="documents"} like a generation: one
    whose client hung up as a 499 (it was counted nowhere), one that went through as a 200."""

    def count(status: str) -> float:
        for line in httpx.get(s.url + "/metrics").text.splitlines():
            if line.startswith(f'longctx_requests_total{{endpoint="documents",status="{status}"}}'):
                return float(line.split()[-1])
        return 0.0

    with fake_server(tmp_path, step_delay_s=0.0, prefill_s_per_token=0.001) as s:  # (the fake pins in one go)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/documents", json={"text": "x" * 3000}, timeout=0.5)
        assert wait_for(lambda: count("499") == 1)
        assert httpx.post(s.url + "/v1/documents", json={"text": "short"}, timeout=30).status_code == 200
        assert count("200") == 1 and count("499") == 1


def test_max_tokens_defaults_to_what_the_kv_pool_holds(tmp_path):
    """A KV pool smaller than --max-context (8 pages of 64 tokens against 1M): a request without
    max_tokens generates up to what the pool holds (it used to ask for the whole 1M context and get a
    400 from the pool check, so the default chat call failed), max_model_len says so, and a prompt
    past it is a 400 context_length_exceeded naming `prompt`."""
    with fake_server(tmp_path, step_delay_s=0.0, total_pages=8, eos_token_id=None) as s:
        models = httpx.get(s.url + "/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 512
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == 512
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1] * 600, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
        assert "what the KV pool holds; --max-context 1048576" in s.log()
        # vLLM's truncate_prompt_tokens: the prompt's last k tokens instead (-1: the context limit's)
        body = {"prompt": [i % 300 + 1 for i in range(600)], "max_tokens": 1, "truncate_prompt_tokens": 100}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 100
        body = {"prompt": "xy" * 400 + "END", "max_tokens": 0, "truncate_prompt_tokens": 5, "echo": True}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xyEND", r.text
        r = httpx.post(
            s.url + "/v1/completions",
            json={"prompt": [1] * 600, "max_tokens": 0, "truncate_prompt_tokens": -1},
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 512, r.text
        msgs = [{"role": "user", "content": "z" * 2000}]
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={"messages": msgs, "max_tokens": 1, "truncate_prompt_tokens": 50},
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text


def test_tokenising_a_long_prompt_does_not_freeze_the_server(tmp_path):
    """A prompt of megabytes is tokenised off the event loop and /health answers meanwhile (the
    single-text tokenizer call held the GIL: 10 s frozen for 10 MB); one that cannot fit the context
    whatever its tokens is refused before it is tokenised."""
    with fake_server(tmp_path, "--max-context", str(1 << 24), step_delay_s=0.0, total_pages=1 << 18) as s:
        lat: list[float] = []
        done = threading.Event()

        def health() -> None:
            while not done.is_set():
                t0 = time.monotonic()
                httpx.get(s.url + "/health", timeout=30)
                lat.append(time.monotonic() - t0)
                time.sleep(0.02)

        t = threading.Thread(target=health)
        t.start()
        t0 = time.monotonic()
        r = httpx.post(
            s.url + "/v1/completions", json={"prompt": "a " * (3 << 19), "max_tokens": 1}, timeout=120
        )
        took = time.monotonic() - t0
        done.set()
        t.join()
        assert r.status_code == 200, r.text
        assert max(lat) < max(0.5 * took, 0.25), (max(lat), took)
    with fake_server(tmp_path, step_delay_s=0.0, total_pages=64) as s:
        t0 = time.monotonic()
        r = httpx.post(
            s.url + "/v1/completions", json={"prompt": "a " * (8 << 20), "max_tokens": 1}, timeout=120
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "at least" in r.json()["error"]["message"] and time.monotonic() - t0 < 5


def test_a_failed_step_fails_its_requests_and_the_waiting_ones_go_on(tmp_path):
    """A step that raises fails the requests it held (500 for each) and only those: a request still
    waiting for pages when it failed is served afterwards (before, every request the engine had
    accepted failed with it)."""
    # two pages: the poisoned request holds one, the waiting one needs two
    with fake_server(tmp_path, step_delay_s=0.01, total_pages=2, poison_token=99, poison_after=30) as s:
        got: dict[str, httpx.Response] = {}

        def post(name: str, body: dict) -> None:
            got[name] = httpx.post(s.url + "/v1/completions", json=body, timeout=30)

        poisoned = threading.Thread(
            target=post, args=("poisoned", {"prompt": [1, 2, 99], "max_tokens": 60, "temperature": 0})
        )
        poisoned.start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 1)
        waiting = threading.Thread(
            target=post, args=("waiting", {"prompt": [5] * 40, "max_tokens": 60, "temperature": 0})
        )
        waiting.start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["waiting"] == 1)
        poisoned.join(30)
        waiting.join(30)
        assert got["poisoned"].status_code == 500, got["poisoned"].text
        assert "poisoned batch" in got["poisoned"].json()["error"]["message"]
        assert got["waiting"].status_code == 200, got["waiting"].text
        assert got["waiting"].json()["usage"]["completion_tokens"] == 60
        assert httpx.get(s.url + "/health").json()["status"] == "ok"


def test_killed_server_leaves_no_socket_dir(tmp_path):
    """SIGKILL of the frontend: its engine process exits by itself and removes the frontend's private
    ipc:// socket dir, which nobody else would."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = fake_server(tmp_path, step_delay_s=0.01)
    s.env["TMPDIR"] = str(tmp)  # where the frontend makes its socket dir
    s.start()
    try:
        engine = psutil.Process(httpx.get(s.url + "/health").json()["engine_pid"])
        assert [p.name for p in tmp.iterdir()] and all(p.name.startswith("longctx-") for p in tmp.iterdir())
        s.proc.kill()
        s.proc.wait(10)
        assert wait_for(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, 10)
        assert list(tmp.iterdir()) == []
    finally:
        s.stop()


def test_a_temp_dir_too_deep_for_socket_paths_falls_back_to_a_short_one(tmp_path):
    """A $TMPDIR so deep that a unix socket path under it would pass sun_path's 107 bytes: the server
    puts its socket dir in $XDG_RUNTIME_DIR instead, serves, and removes the dir when it stops."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    s = fake_server(tmp_path, step_delay_s=0.0)
    s.env["TMPDIR"] = str(deep)
    s.env["XDG_RUNTIME_DIR"] = str(run)
    s.start()
    try:
        assert [p.name[:8] for p in run.iterdir()] == ["longctx-"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert s.stop() == 0, s.log()[-3000:]
        assert list(run.iterdir()) == [] and list(deep.iterdir()) == []
        assert "too deep for unix socket paths" in s.log()
    finally:
        s.stop()


def test_no_temp_dir_short_enough_for_socket_paths_says_what_to_set(tmp_path, monkeypatch):
    from longctx.server import engine_client

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(deep)])
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with pytest.raises(RuntimeError, match="set TMPDIR to a shorter directory"):
        engine_client.socket_base_dir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert engine_client.socket_base_dir() == str(tmp_path)


@pytest.mark.parametrize(
    "sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGTERM, True)]
)
def test_a_signal_drains_and_exits_cleanly(tmp_path, sig, group):
    """SIGTERM to the server drains: the running request ends normally, then everything exits 0. So
    does a signal to the whole process group at once, the engine process too: Ctrl-C in a terminal
    (SIGINT), systemd's or `timeout`'s stop (SIGTERM); the engine keeps serving until the frontend
    shuts it down. Nothing prints a traceback and no process is left."""
    s = fake_server(tmp_path, step_delay_s=0.01, new_session=True).start()
    try:
        children = psutil.Process(s.pid).children(recursive=True)
        assert children  # the engine process (and multiprocessing's resource tracker)
        lines: list[str] = []

        def stream():
            body = {"prompt": "abc", "max_tokens": 60, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=stream)
        t.start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 1)
        if group:
            os.killpg(s.pid, sig)
        else:
            s.proc.send_signal(sig)
        t.join(30)
        assert s.proc.wait(30) == 0, s.log()[-3000:]
        # the running request finished normally during the drain
        assert lines[-1] == "data: [DONE]"
        finals = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines if x.startswith("data: {")]
        assert finals[-1] == "length", s.log()[-3000:]
        assert wait_for(
            lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        )
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=2)
        assert "Traceback" not in s.log(), s.log()[-3000:]
    finally:
        s.stop()


def test_sigterm_past_the_drain_timeout_ends_requests_with_503(tmp_path):
    """Requests still running (or queued) when --drain-timeout runs out end with a 503 saying so (a
    stream: an error event, then [DONE]), not with uvicorn's bare 500 and a traceback each."""
    s = fake_server(tmp_path, "--drain-timeout", "1", step_delay_s=0.01).start()
    try:
        got: dict[str, object] = {}

        def plain():
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100000}, timeout=30)
            got["plain"] = (r.status_code, r.text, r.headers.get("retry-after"))

        def stream():
            body = {"prompt": "a", "max_tokens": 100000, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                got["stream"] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 2)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert s.proc.wait(30) == 0
        status, text, retry_after = got["plain"]
        assert status == 503 and "drain" in json.loads(text)["error"]["message"], text
        assert retry_after == "1"
        lines = got["stream"]
        assert lines[-1] == "data: [DONE]" and "drain" in json.loads(lines[-2][6:])["error"]["message"]
        assert "Traceback" not in s.log()
    finally:
        s.stop()


@pytest.mark.parametrize(
    "extra",
    [
        ["--index-topk", "0"],
        ["--index-local-window", "-1"],
        ["--index-topk-long", "-1"],
        ["--index-topk-long-from", "-5"],
        ["--kv-fp8-skip-layers", "4,four"],
        ["--hisparse-device-tokens", "-1"],
        ["--pp", "0"],
        ["--max-context", "0"],
        ["--port", "99999"],
        ["--port", "-1"],
        ["--drain-timeout", "nan"],
        ["--api-key", "k\u00e9y"],
    ],
)
def test_serve_bad_args_exit_2_with_one_line(extra, capsys):
    """`longctx serve` refuses bad engine flags before it loads anything or binds a port."""
    from longctx.cli import main

    model = Path(__file__).resolve().parents[1] / "models-shipped" / "retrieval-wip"
    assert main(["serve", "--model", str(model), "--port", "0", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("longctx serve: error:") and extra[0] in err


@pytest.mark.parametrize("stages", [[], ["--pp", "2"]])
def test_serve_engine_that_cannot_start_exits_2_with_one_line(tmp_path, stages):
    """An engine failing at startup (weights that do not load: only the engine reads them; flags the
    model's config rules out are refused before the port is bound) ends `longctx serve` with exit 2 and
    one error line, no traceback, no child process left behind; also when a stage process (pp=2, the
    stage holding lm_head) is the one that fails."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(Path(__file__).resolve().parents[1] / "models-shipped" / "retrieval-wip", model)
    weights = load_file(model / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    argv = ["serve", "--model", str(model), "--device", "cpu", "--port", "0", "--log-level", "warning"]
    p = subprocess.run(
        [sys.executable, "-m", "longctx.cli", *argv, *stages],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert err[0].startswith("longctx serve: error: the engine did not start: ")
    assert "CheckpointError: checkpoint is missing lm_head.weight" in err[0]
    left = [q for q in psutil.process_iter(["cwd"]) if q.info["cwd"] == str(tmp_path)]  # its engine process
    assert not left, left


def test_stale_socket_dirs_of_killed_servers_are_swept(tmp_path):
    """A server killed together with its engine leaves its socket dir; the next server's start removes
    it. Dirs whose sockets still accept connections, young dirs and dirs holding anything else stay."""
    import socket as socketlib

    from longctx.server.engine_client import sweep_stale_socket_dirs

    def make(name: str, *, listen: bool, age_s: float, extra: str | None = None):
        d = tmp_path / name
        d.mkdir()
        socks = []
        for n in ("in", "out"):
            s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            s.bind(str(d / n))
            if listen:
                s.listen(4)
                socks.append(s)
            else:
                s.close()  # the file stays, nobody listens: what a SIGKILLed process leaves
        if extra:
            (d / extra).write_text("x")
        t = time.time() - age_s
        os.utime(d, (t, t))
        return d, socks

    dead, _ = make("longctx-dead", listen=False, age_s=600)
    live, held = make("longctx-live", listen=True, age_s=600)
    young, _ = make("longctx-young", listen=False, age_s=0)
    other, _ = make("longctx-other", listen=False, age_s=600, extra="notes.txt")
    unrelated, _ = make("someone-else", listen=False, age_s=600)
    try:
        assert sweep_stale_socket_dirs(str(tmp_path)) == [str(dead)]
        assert not dead.exists()
        assert all(p.is_dir() for p in (live, young, other, unrelated))
        assert sorted(p.name for p in live.iterdir()) == ["in", "out"]
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize(
    "which, body, param, says",
    [
        ("comp", {"prompt": 5}, "prompt", "expected one of str, list[int], list[str], list[list[int]]"),
        ("comp", {"prompt": ["a", 3]}, "prompt.1", "valid string"),
        ("comp", {"prompt": [[1, "a"]]}, "prompt.0.1", "valid integer"),
        # the first bad item (not the last), and what the members wanted there when none got further
        ("comp", {"prompt": ["a", 3, 4]}, "prompt.1", "valid string"),
        ("comp", {"prompt": [True, False]}, "prompt.0", "prompt.0: expected one of int, str, list[int]"),
        ("comp", {"prompt": [[1], True]}, "prompt.1", "valid list"),  # (list[list[int]] got past item 0)
        ("comp", {"prompt": "a", "stop": 4}, "stop", "expected one of str, list[str]"),
        ("comp", {"prompt": "a", "stop": ["x", 4]}, "stop.1", "valid string"),
        ("comp", {"prompt": "a", "temperature": "x"}, "temperature", "valid number"),
        ("comp", {"prompt": "a", "logit_bias": {"int": "x"}}, "logit_bias.int", "valid number"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "expected one of str"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages.0.content.0.text",
            "valid string",
        ),
    ],
)
def test_a_union_fields_error_names_the_member_that_got_furthest(which, body, param, says):
    """A union field (prompt, stop, content) fails once per member; the 400 names the first error of the
    member that got furthest into the value, or what the members that got as far wanted there (all of
    them when none got past the value itself), not the first member's or the last item's complaint."""
    from pydantic import ValidationError

    from longctx.server.protocol import ChatCompletionRequest, CompletionRequest, validation_error

    model = CompletionRequest if which == "comp" else ChatCompletionRequest
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    err = validation_error(e.value)
    assert err.status == 400 and err.param == param and says in str(err), (err.param, str(err))
