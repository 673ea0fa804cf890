"""The HTTP server as users meet it: a real `longctx serve` subprocess on a free port.

These run against the compute-free fake engine (`--fake-engine`) so they are fast and
deterministic; tests/test_server_real.py repeats the core paths on the real engine.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time

import httpx
import openai
import pytest

from .server_helpers import check_disconnect_frees_pages, fake_server, openai_client, stats, wait_for

MAX_CONTEXT = 4096
FAKE = {"step_delay_s": 0.002, "prefill_chunk": 256, "total_pages": 4096}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("fake-model")
    with fake_server(model, "--max-context", str(MAX_CONTEXT), "--served-model-name", "fake", **FAKE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


# ---- the openai client ---------------------------------------------------------------------------


def test_openai_completions(client):
    r = client.completions.create(model="fake", prompt="hello world", max_tokens=5, temperature=0)
    assert r.choices[0].text == "hello"  # the fake engine echoes the prompt greedily
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(
        client.completions.create(
            model="fake",
            prompt="hello world",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_openai_chat(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake", messages=msgs, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    # the fake engine echoes the prompt: [gMASK] <sop> <|system|> are special, skipped in text
    assert r.choices[0].message.content == "\nbe"
    assert r.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="fake",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "\nbe"
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["fake"]
    assert client.models.retrieve("fake").id == "fake"  # (GET /v1/models/{id} was a 404)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.head(server.url + "/health").status_code == 200  # load balancers probe with HEAD
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "longctx_queue_length",
        "longctx_running_requests",
        "longctx_generated_tokens_total",
        "longctx_generation_tokens_per_second",
        "longctx_time_to_first_token_seconds_bucket",
        "longctx_inter_token_latency_seconds_bucket",
        "longctx_kv_pages_used",
        "longctx_prefix_cache_hit_tokens",
        "longctx_host_pool_bytes",
        "longctx_hisparse_hit_rate",
        "longctx_prefix_cache_resets_total",
    ):
        assert name in text, name


def test_stop_strings_and_logprobs(client):
    r = client.completions.create(
        model="fake", prompt="abcdefgh", max_tokens=8, temperature=0, stop=["de", "zz"]
    )
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="fake", prompt="abcdefgh", max_tokens=8, temperature=0, stop="ef", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "abcd"
    # vLLM's include_stop_str_in_output: the text ends after the stop string, streamed or not, chat too
    keep = {"include_stop_str_in_output": True}
    r = client.completions.create(
        model="fake", prompt="abcdefgh", max_tokens=8, temperature=0, stop=["de", "zz"], extra_body=keep
    )
    assert r.choices[0].text == "abcde" and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="fake",
            prompt="abcdefgh",
            max_tokens=8,
            temperature=0,
            stop="ef",
            stream=True,
            extra_body=keep,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "abcdef"
    assert chunks[-1].choices[0].finish_reason == "stop"
    msgs = [{"role": "user", "content": "abcdefgh"}]
    plain = client.chat.completions.create(model="fake", messages=msgs, max_tokens=40, temperature=0)
    text = plain.choices[0].message.content
    stop = text[3:5]
    r = client.chat.completions.create(
        model="fake", messages=msgs, max_tokens=40, temperature=0, stop=[stop], extra_body=keep
    )
    assert r.choices[0].message.content == text[: text.index(stop) + 2]
    r = client.completions.create(model="fake", prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["a", "b", "c"] and len(lp.top_logprobs[0]) == 2 and lp.text_offset == [0, 1, 2]
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 3


def test_top_logprobs_of_tokens_that_read_the_same_keep_the_likeliest(server):
    """Completions' top_logprobs are keyed by token text: tokens that read the same (the byte-level pieces
    of UTF-8 characters all read U+FFFD) share one key, with the likeliest one's logprob (the dict kept the
    last, least likely one). The fake engine's top-3 of token t: t, t + 1, t + 2 at -0.25, -1.25, -2.25."""
    body = {"prompt": [200], "max_tokens": 2, "temperature": 0, "logprobs": 3}
    lp = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"\ufffd": -0.25}] * 2
    body = {"prompt": [97], "max_tokens": 1, "temperature": 0, "logprobs": 3}
    lp = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"a": -0.25, "b": -1.25, "c": -2.25}]


def test_min_tokens_holds_back_stop_strings_over_http(client):
    """No stop string ends within the first min_tokens tokens' text, streamed or not (the fake engine echoes
    the prompt greedily); stop_token_ids and min_p pass through."""
    kw = dict(model="fake", prompt="abcabcabc", max_tokens=9, temperature=0, stop=["b"])
    assert client.completions.create(**kw).choices[0].text == "a"
    r = client.completions.create(**kw, extra_body={"min_tokens": 3})
    assert r.choices[0].text == "abca" and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"min_tokens": 5}))
    assert "".join(c.choices[0].text for c in chunks) == "abcabca"
    r = client.completions.create(
        **{**kw, "stop": ["ab"]}, extra_body={"min_tokens": 1}
    )  # ends after: counts
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        **kw, extra_body={"min_tokens": 2, "min_p": 0.5, "stop_token_ids": [7], "logit_bias": {"7": -5}}
    )
    assert r.choices[0].text == "abca"


def test_n_choices(client, server):
    """n > 1: n choices indexed 0..n-1, each a request of its own (seeded: choice i draws with seed + i,
    so they differ and repeat), usage counting the prompt once; streamed, every choice's chunks
    carry its index and end with its own finish; chat and documents too."""
    kw = dict(model="fake", prompt="abc", max_tokens=8, temperature=1.0, seed=7)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    assert r.choices[2].text == client.completions.create(**{**kw, "seed": 9}).choices[0].text
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 24 and r.usage.total_tokens == 27
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts = {
        i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2] and chunks[-1].usage.completion_tokens == 24
    msgs = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model="fake", messages=msgs, max_tokens=4, temperature=0, n=2)
    assert len(c.choices) == 2 and c.choices[0].message.content == c.choices[1].message.content  # greedy
    s = list(
        client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=4, temperature=0, n=2, stream=True
        )
    )
    roles = [x.choices[0].index for x in s if x.choices and x.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    doc = httpx.post(server.url + "/v1/documents", json={"text": "some document text"}).json()
    a = httpx.post(
        server.url + f"/v1/documents/{doc['id']}/ask", json={"question": "?", "max_tokens": 3, "n": 2}
    )
    assert a.status_code == 200 and [x["index"] for x in a.json()["choices"]] == [0, 1]
    httpx.delete(server.url + f"/v1/documents/{doc['id']}")


def test_several_prompts_in_one_completions_request(client, server):
    """A list of prompts (strings or token-id lists) is a batch: prompt p's choice j at index p * n + j,
    each as its single request; usage counts every prompt once; streamed, every index ends with its own
    finish and each prompt's prefill is reported; too many prompts x n for the queue is a 400."""
    kw = dict(model="fake", max_tokens=6, temperature=0)
    r = client.completions.create(prompt=["abc", "wxyz"], **kw)
    singles = [client.completions.create(prompt=p, **kw) for p in ("abc", "wxyz")]
    assert [c.text for c in r.choices] == [x.choices[0].text for x in singles] == ["abcabc", "wxyzwx"]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == sum(x.usage.prompt_tokens for x in singles)
    assert r.usage.completion_tokens == 12
    seeded = dict(model="fake", max_tokens=5, temperature=1.0, seed=3)
    r = client.completions.create(prompt=[[97, 98], [120, 121, 122]], n=2, **seeded)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    one = client.completions.create(prompt=[120, 121, 122], n=2, **seeded)
    assert [c.text for c in r.choices[2:]] == [c.text for c in one.choices]  # (seed + j per prompt)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 20
    chunks = list(
        client.completions.create(
            prompt=["ab", "xyz"], n=2, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    texts = {
        i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(4)
    }
    assert texts == {0: "ababab", 1: "ababab", 2: "xyzxyz", 3: "xyzxyz"}
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3] and chunks[-1].usage.prompt_tokens == 5
    body = {"prompt": ["p" * 1500, "q" * 1400], "max_tokens": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as s:
        lines = [x for x in s.iter_lines() if x.startswith(": prefill ")]
    assert any(x.endswith("/1500 (prompt 0)") for x in lines) and any(
        x.endswith("/1400 (prompt 1)") for x in lines
    )


def test_echo_repeats_the_prompt_with_its_logprobs(client, server):
    """echo: each choice's text starts with its prompt; with logprobs, the prompt's tokens come first (the
    first with null), then the completion's, offsets running on; max_tokens 0 scores the prompt alone
    (lm-eval's loglikelihood request); streamed, each choice's first chunk is its prompt."""
    r = client.completions.create(model="fake", prompt="abc", max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text == "abcab" and r.choices[0].logprobs is None
    r = client.completions.create(
        model="fake", prompt="abc", max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "abcab" and lp.tokens == ["a", "b", "c", "a", "b"]
    assert lp.token_logprobs == [None, -0.25, -0.25, -0.25, -0.25] and lp.top_logprobs[0] is None
    assert lp.text_offset == [0, 1, 2, 3, 4] and len(lp.top_logprobs[1]) == 1
    body = {"prompt": ["xyz", "ab"], "max_tokens": 0, "echo": True, "logprobs": 0}
    j = httpx.post(server.url + "/v1/completions", json=body).json()
    assert [c["text"] for c in j["choices"]] == ["xyz", "ab"] and j["usage"]["completion_tokens"] == 0
    assert [c["logprobs"]["token_logprobs"] for c in j["choices"]] == [[None, -0.25, -0.25], [None, -0.25]]
    chunks = list(
        client.completions.create(
            model="fake", prompt="abc", max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True, n=2
        )
    )
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].text == "abc" and mine[0].logprobs.token_logprobs == [None, -0.25, -0.25]
        assert "".join(c.text for c in mine) == "abcabc"
        assert [o for c in mine if c.logprobs for o in c.logprobs.text_offset] == [0, 1, 2, 3, 4, 5]


def test_prompt_logprobs_in_every_choice(server):
    """vLLM's prompt_logprobs: each choice carries its prompt's logprobs (None for the first token, then the
    prompt token and its top-N alternatives by token id, each with logprob, rank and decoded_token), in
    completions (n choices, several prompts) and chat; with echo + logprobs the echoed prompt keeps its own
    top-N; streamed it is refused, naming the field."""
    body = {"prompt": ["abc", "xy"], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    j = httpx.post(server.url + "/v1/completions", json=body).json()
    assert len(j["choices"]) == 4
    for c in j["choices"]:
        plp = c["prompt_logprobs"]
        assert plp[0] is None and len(plp) == (3 if c["index"] < 2 else 2)
        for tok, entry in zip(("bc" if c["index"] < 2 else "y"), plp[1:]):
            mine = entry[str(ord(tok))]  # (the fake codec: one byte a token)
            assert mine == {"logprob": -0.25, "rank": 1, "decoded_token": tok}
            assert sorted(v["rank"] for v in entry.values()) == [1, 2]  # (itself first, then one more)
    assert (
        "prompt_logprobs"
        not in httpx.post(server.url + "/v1/completions", json={"prompt": "ab"}).json()["choices"][0]
    )
    body = {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 3}
    c = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    assert [len(t) for t in c["logprobs"]["top_logprobs"][1:]] == [1, 1] and len(c["prompt_logprobs"][1]) == 3
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    c = httpx.post(server.url + "/v1/chat/completions", json=chat).json()["choices"][0]
    assert c["prompt_logprobs"][0] is None and all(len(e) == 1 for e in c["prompt_logprobs"][1:])
    for route, b in (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", chat)):
        r = httpx.post(server.url + route, json={**b, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_tokenize_and_detokenize(client, server):
    """/tokenize gives the ids a completions or chat request sends the engine (their count is its usage's
    prompt_tokens) and the context limit; /detokenize turns ids back into text; bad bodies are 400s."""
    url = server.url
    t = httpx.post(url + "/tokenize", json={"prompt": "hello there"}).json()
    r = client.completions.create(model="fake", prompt="hello there", max_tokens=1)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] == MAX_CONTEXT
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    t = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
    c = client.chat.completions.create(model="fake", messages=msgs, max_tokens=1)
    assert t["count"] == c.usage.prompt_tokens
    d = httpx.post(url + "/detokenize", json={"tokens": [104, 105, 33]}).json()
    assert d == {"prompt": "hi!"}
    for path, body in (
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "x", "messages": msgs}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {"prompt": "x", "model": "other"}),
        ("/detokenize", {"tokens": [10**6]}),
        ("/detokenize", {"tokens": "abc"}),
    ):
        got = httpx.post(url + path, json=body)
        assert got.status_code in (400, 404) and got.json()["error"]["message"], (path, body)


def test_continuous_usage_stats(client):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries its choice's usage so far; without
    it only the last chunk has usage."""
    so = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model="fake", prompt="abcd", max_tokens=5, temperature=0, stream=True, n=2)
    chunks = list(client.completions.create(stream_options=so, **kw))
    for i in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        counts = [c.usage.completion_tokens for c in mine]
        assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens == 4 for c in mine)
        assert all(c.usage.total_tokens == 4 + c.usage.completion_tokens for c in mine)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10
    plain = list(client.completions.create(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage.completion_tokens == 10
    msgs = [{"role": "user", "content": "hi"}]
    chat = list(
        client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=3, stream=True, stream_options=so
        )
    )
    assert all(c.usage is not None for c in chat) and chat[-2].usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(client):
    kw = dict(
        model="fake", prompt="abc", max_tokens=12, temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 5}
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_seed_minus_one_is_no_seed_and_other_negative_seeds_are_refused(client):
    """seed -1 draws afresh each time, as vLLM reads it (it was a seed like any other); any other negative
    seed is a 400 naming `seed` (the engine took it modulo 2**63: -2 drew what 2**63 - 2 does)."""
    kw = dict(model="fake", prompt="abc", max_tokens=12, temperature=1.0)
    assert len({client.completions.create(**kw, seed=-1).choices[0].text for _ in range(3)}) == 3
    for seed in (-2, -(2**63)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw, seed=seed)
        assert e.value.body["param"] == "seed" and e.value.body["code"] == "invalid_value"
    assert len({client.completions.create(**kw, seed=2**63 - 1).choices[0].text for _ in range(2)}) == 1


def test_prefill_progress_comments(server):
    body = {"prompt": "p" * 1500, "max_tokens": 2, "stream": True}
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append(line)
    progress = [line for line in lines if line.startswith(": prefill ")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert len(progress) >= 4 and all(lines.index(p) < first_data for p in progress)
    done = [int(p.split()[2].split("/")[0]) for p in progress]
    assert done == sorted(done) and all(p.endswith("/1500") for p in progress)
    assert lines[-1] == "data: [DONE]"


def test_concurrent_streaming_clients(server):
    def one(i: int) -> tuple[str, str]:
        body = {"prompt": f"client {i:02d} says hi", "max_tokens": 24, "temperature": 0, "stream": True}
        text, reason = "", None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    text += ch["text"]
                    reason = ch["finish_reason"] or reason
        return text, reason

    with cf.ThreadPoolExecutor(20) as ex:
        results = list(ex.map(one, range(20)))
    for i, (text, reason) in enumerate(results):
        assert reason == "length"
        assert text == (f"client {i:02d} says hi" * 2)[:24]


def test_disconnect_aborts_and_frees_pages(server):
    # closing the connection aborts the request: its pages come back long before 3000 tokens
    check_disconnect_frees_pages(
        server,
        {"prompt": "abc", "max_tokens": 3000, "stream": True},
        after_events=3,
        http_timeout=30,
        free_within=3.0,
    )


def test_disconnect_aborts_every_choice(server):
    check_disconnect_frees_pages(
        server,
        {"prompt": "abc", "max_tokens": 3000, "stream": True, "n": 3},
        after_events=4,
        http_timeout=30,
        free_within=3.0,
    )


@pytest.mark.parametrize("n", [1, 3])
def test_non_streaming_disconnect_aborts(server, n):
    base = stats(server)["pages_used"]
    with pytest.raises(httpx.ReadTimeout):
        body = {"prompt": "abc", "max_tokens": 3000, "n": n}
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: stats(server)["pages_used"] == base and stats(server)["num_running"] == 0, 3.0)


# ---- long documents ------------------------------------------------------------------------------

DOC = "The quick brown fox jumps over the lazy dog. " * 30  # 1350 characters (bytes: 1 token each)


def test_document_qa(server, client):
    r = httpx.post(server.url + "/v1/documents", json={"text": DOC}, timeout=30)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["tokens"] > len(DOC) and doc["id"].startswith("doc-")
    covered = doc["tokens"] // 64 * 64  # prefix caching works in whole 64-token pages
    for _ in range(2):
        a = httpx.post(
            server.url + f"/v1/documents/{doc['id']}/ask",
            json={"question": "What does the fox do?", "max_tokens": 4},
            timeout=30,
        ).json()
        assert a["object"] == "chat.completion"
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= covered
        assert a["usage"]["prompt_tokens"] > doc["tokens"]
    # an ordinary chat request that starts with the document reuses it too
    r = client.chat.completions.create(
        model="fake", max_tokens=2, messages=[{"role": "user", "content": DOC + "\n\nSummarise."}]
    )
    assert r.usage.prompt_tokens_details.cached_tokens >= covered
    # streaming ask
    with httpx.stream(
        "POST",
        server.url + f"/v1/documents/{doc['id']}/ask",
        json={"question": "Who?", "max_tokens": 3, "stream": True},
        timeout=30,
    ) as s:
        data = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert (
        data[0]["object"] == "chat.completion.chunk" and data[-1]["choices"][0]["finish_reason"] == "length"
    )

    assert doc["id"] in [d["id"] for d in httpx.get(server.url + "/v1/documents").json()["data"]]
    assert httpx.get(server.url + f"/v1/documents/{doc['id']}").json()["tokens"] == doc["tokens"]
    pages = stats(server)["pages_used"]
    assert httpx.delete(server.url + f"/v1/documents/{doc['id']}").json()["deleted"] is True
    assert stats(server)["pages_used"] < pages
    assert httpx.get(server.url + f"/v1/documents/{doc['id']}").status_code == 404
    assert (
        httpx.post(server.url + f"/v1/documents/{doc['id']}/ask", json={"question": "?"}).status_code == 404
    )


def test_reset_prefix_cache_and_flush_cache(server):
    """vLLM's POST /reset_prefix_cache and SGLang's POST /flush_cache, one handler: the two counts, a pinned
    document's pages kept (the fake engine caches nothing else), each reset counted in /metrics."""

    def resets() -> float:
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return float(next(s for s in lines if s.startswith("longctx_prefix_cache_resets_total ")).split()[1])

    doc = httpx.post(server.url + "/v1/documents", json={"text": DOC}, timeout=30).json()
    n = resets()
    for path in ("/reset_prefix_cache", "/flush_cache"):
        r = httpx.post(server.url + path, timeout=30)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"freed_pages", "kept_pages"} and r.json()["freed_pages"] == 0
        assert r.json()["kept_pages"] >= doc["tokens"] // 64
    assert resets() == n + 2
    assert httpx.get(server.url + "/flush_cache").status_code == 405
    assert httpx.delete(server.url + f"/v1/documents/{doc['id']}").status_code == 200


def test_document_multipart_upload(server):
    r = httpx.post(server.url + "/v1/documents", files={"file": ("notes.txt", DOC.encode(), "text/plain")})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["name"] == "notes.txt" and doc["characters"] == len(DOC)
    a = httpx.post(
        server.url + f"/v1/documents/{doc['id']}/ask", json={"question": "?", "max_tokens": 2}
    ).json()
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= doc["tokens"] // 64 * 64
    httpx.delete(server.url + f"/v1/documents/{doc['id']}")


@pytest.mark.parametrize(
    "disposition, name",
    [
        ('filename="résumé 中.txt"'.encode(), "résumé 中.txt"),  # UTF-8 as is (browsers, curl, httpx)
        (b"filename*=UTF-8''r%C3%A9sum%C3%A9%20%E4%B8%AD.txt", "résumé 中.txt"),  # RFC 5987 alone
        (b"filename*=iso-8859-1'en'caf%E9.txt", "café.txt"),
        # .NET's: an RFC 2047 filename and the RFC 5987 one, which RFC 6266 prefers
        (b"filename=\"=?utf-8?B?csOpc3Vtw6kudHh0?=\"; filename*=utf-8''r%C3%A9sum%C3%A9.txt", "résumé.txt"),
        # a filename* that does not decode leaves the plain one
        (b"filename=\"plain.txt\"; filename*=nosuchcharset''x.txt", "plain.txt"),
    ],
)
def test_document_upload_filenames(server, disposition, name):
    """A multipart file's name, in UTF-8 or in an RFC 5987 `filename*` (python-multipart ignores that one:
    the name was null, or the RFC 2047 text .NET puts in `filename`)."""
    head = b'--xx\r\nContent-Disposition: form-data; name="file"; ' + disposition
    body = head + b"\r\nContent-Type: text/plain\r\n\r\nsome document\r\n--xx--\r\n"
    r = httpx.post(
        server.url + "/v1/documents",
        content=body,
        headers={"content-type": "multipart/form-data; boundary=xx"},
    )
    assert r.status_code == 200 and r.json()["name"] == name, r.text
    httpx.delete(server.url + f"/v1/documents/{r.json()['id']}")


# ---- bad input -----------------------------------------------------------------------------------

C, CH, D = "/v1/completions", "/v1/chat/completions", "/v1/documents"
U = {"role": "user", "content": "hi"}
BAD = [
    # (method, path, body (dict -> JSON, bytes -> raw), status)
    ("POST", C, b'{"prompt": "x", ', 400),
    ("POST", C, {"prompt": "x", "max_tokens": 2, "best_of": 3}, 400),  # (was ignored: one choice came back)
    ("POST", C, b"[1, 2]", 400),
    ("POST", C, b'{"prompt": "\xff\xfe"}', 400),
    # unpaired surrogate escapes: valid JSON, not valid Unicode (no tokenizer or UTF-8 response takes them)
    ("POST", C, b'{"prompt": "\\udc80", "max_tokens": 2}', 400),
    ("POST", C, b'{"prompt": "x", "model": "\\ud800"}', 400),
    ("POST", C, b'{"prompt": "x", "stop": "\\ud800"}', 400),
    ("POST", CH, b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400),
    ("POST", "/tokenize", b'{"prompt": "\\ud83d"}', 400),
    ("POST", D, b'{"text": "doc", "name": "\\ud800"}', 400),
    ("POST", C, b"", 400),
    ("POST", C, b'{"prompt": "x", "temperature": NaN}', 400),
    ("POST", C, {"prompt": 5}, 400),
    ("POST", C, {}, 400),
    ("POST", C, {"prompt": "x", "max_tokens": "5"}, 400),
    ("POST", C, {"prompt": "x", "max_tokens": -1}, 400),
    ("POST", C, {"prompt": "x", "max_tokens": 1.5}, 400),
    ("POST", C, {"prompt": "x", "max_tokens": 10**30}, 400),
    ("POST", C, {"prompt": "x", "temperature": -0.5}, 400),
    ("POST", C, {"prompt": "x", "temperature": "hot"}, 400),
    ("POST", C, {"prompt": "x", "top_p": 0}, 400),
    ("POST", C, {"prompt": "x", "top_p": 1.5}, 400),
    ("POST", C, {"prompt": "x", "top_k": -5}, 400),
    ("POST", C, {"prompt": "x", "presence_penalty": 2.5}, 400),
    ("POST", C, {"prompt": "x", "frequency_penalty": "high"}, 400),
    ("POST", C, {"prompt": "x", "repetition_penalty": 0}, 400),
    ("POST", CH, {"messages": [U], "repetition_penalty": -1.0}, 400),
    ("POST", C, {"prompt": "x", "n": 17}, 400),
    ("POST", C, {"prompt": "x", "min_tokens": -1}, 400),
    ("POST", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400),
    ("POST", C, {"prompt": "x", "min_p": 1.5}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400),  # (str.isdigit, not a token id)
    ("POST", C, {"prompt": "x", "logit_bias": {"\u0661\u0662": 1}}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": {"5": 101}}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": {"5": "1"}}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": {"100000": 1}}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": {"9" * 30: 1}}, 400),
    ("POST", C, {"prompt": "x", "logit_bias": [5, 1]}, 400),
    ("POST", CH, {"messages": [U], "logit_bias": {str(i): 1 for i in range(1025)}}, 400),
    ("POST", C, {"prompt": "x", "stop_token_ids": [-1]}, 400),
    ("POST", C, {"prompt": "x", "stop_token_ids": [100000]}, 400),
    ("POST", C, {"prompt": "x", "stop_token_ids": "7"}, 400),
    ("POST", C, {"prompt": "x", "n": 0}, 400),
    ("POST", C, {"prompt": "x", "logprobs": 50}, 400),
    ("POST", C, {"prompt": "x", "stop": [""]}, 400),
    ("POST", C, {"prompt": "x", "stop": 5}, 400),
    ("POST", C, {"prompt": "x", "seed": "s"}, 400),
    ("POST", C, {"prompt": "x", "stream": "yes"}, 400),
    ("POST", C, {"prompt": ["a"] * 65}, 400),
    ("POST", C, {"prompt": ["a", [1, 2]]}, 400),
    ("POST", C, {"prompt": ["a", ""]}, 400),
    ("POST", C, {"prompt": ""}, 400),
    ("POST", C, {"prompt": [10**6]}, 400),
    ("POST", C, {"prompt": "x" * (MAX_CONTEXT + 1)}, 400),
    ("POST", C, {"prompt": "x", "model": "gpt-4"}, 404),
    ("POST", CH, {"messages": []}, 400),
    ("POST", CH, {"model": "fake"}, 400),
    ("POST", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("POST", CH, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("POST", CH, {"messages": [{"content": "hi"}]}, 400),
    ("POST", CH, {"messages": ["hi"]}, 400),
    ("POST", CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400),
    ("POST", CH, {"messages": [U], "top_logprobs": 2}, 400),
    ("POST", CH, {"messages": [U], "max_tokens": -3}, 400),
    ("POST", CH, {"messages": [U], "n": 99}, 400),
    ("POST", CH, {"messages": [U], "model": "nope"}, 404),
    ("POST", CH, {"messages": [{"role": "user", "content": "y" * (MAX_CONTEXT + 10)}]}, 400),
    ("POST", D, {"text": ""}, 400),
    ("POST", D, {"text": 7}, 400),
    ("POST", D, {"text": "z" * (MAX_CONTEXT + 10)}, 400),
    ("POST", D + "/doc-missing/ask", {"question": "?"}, 404),
    ("GET", D + "/doc-missing", None, 404),
    ("DELETE", D + "/doc-missing", None, 404),
    ("GET", "/v1/nothing-here", None, 404),
    ("GET", C, None, 405),
]


def test_errors_the_engine_finds_name_their_code_and_field(server):
    """The engine checks token ids against the vocabulary (the frontend does not repeat that check): its
    400s carry a code and the field at fault as the frontend's own do (both were null)."""
    for body, param in (
        ({"stop_token_ids": [100000]}, "stop_token_ids"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}, "stream": True}, "logit_bias"),
    ):
        r = httpx.post(server.url + C, json={"prompt": "x", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_value")
        assert "outside the vocabulary" in err["message"]


def test_bad_inputs_get_4xx_and_server_stays_healthy(server):
    with httpx.Client(base_url=server.url, timeout=30) as h:
        for method, path, body, status in BAD:
            kw = (
                {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
            )
            r = h.request(method, path, **kw)
            assert r.status_code == status, (
                method,
                path,
                body if not isinstance(body, dict) else str(body)[:80],
                r.status_code,
                r.text[:200],
            )
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        # malformed multipart uploads
        r = h.post(D, files={"other": ("a.txt", b"abc")})
        assert r.status_code == 400, r.text
        r = h.post(D, files={"file": ("a.txt", b"\xff\xfe\xfd")})
        assert r.status_code == 400, r.text
        r = h.post(D, content=b"--xx\r\nbroken", headers={"content-type": "multipart/form-data; boundary=xx"})
        assert r.status_code == 400, r.text
        # a text field that is not UTF-8 is refused, not decoded as latin-1 into mojibake
        mp = {"content-type": "multipart/form-data; boundary=xx"}
        body = b'--xx\r\nContent-Disposition: form-data; name="text"\r\n\r\ncaf\xe9 \xff\r\n--xx--\r\n'
        r = h.post(D, content=body, headers=mp)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_utf8", r.text
        assert "'text'" in r.json()["error"]["message"]
        # a text field past starlette's 1 MB part default gets as far as the context check
        r = h.post(D, data={"text": "x" * (1 << 20) + "y"}, files={"none": ("", b"")})
        assert r.status_code == 400 and r.json()["error"]["code"] != "invalid_multipart", r.text
        assert "context" in r.json()["error"]["message"], r.text
        # a multipart body declared larger than a document may be is a 413 before it is read
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sk:
            sk.sendall(
                f"POST {D} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=xx\r\n"
                f"Content-Length: {1 << 30}\r\n\r\n--xx\r\n".encode()
            )
            assert sk.recv(200).startswith(b"HTTP/1.1 413")
        assert h.get("/health").status_code == 200
        assert h.post(C, json={"prompt": "ok", "max_tokens": 2}).status_code == 200
        # an escaped surrogate pair is one character, and fine; nothing bad was stored (the list renders)
        r = h.post(C, content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
        assert r.status_code == 200, r.text
        assert h.get(D).status_code == 200
        # a client that hangs up halfway through its body is no server error (it logged a traceback)
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        for path in (C, D):
            with socket.create_connection((host, int(port))) as sk:
                head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                sk.sendall(head.encode() + b'Content-Length: 1000\r\n\r\n{"prompt": "ab')
                time.sleep(0.1)
        for _ in range(3):
            assert h.post(C, json={"prompt": "ok", "max_tokens": 2}).status_code == 200
        time.sleep(0.3)
    assert "Traceback" not in server.log() and "ClientDisconnect" not in server.log()


def test_a_wrong_method_says_which_are_allowed(server):
    """A 405 from the framework keeps its Allow header (its OpenAI-shaped body was built without it)."""
    r = httpx.get(server.url + C)
    assert r.status_code == 405 and r.json()["error"]["code"] == "405", r.text
    assert r.headers["allow"] == "POST"
    r = httpx.post(server.url + "/v1/documents/no-such-id")  # two routes of one path: GET and DELETE
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers


def test_every_route_is_served_with_one_trailing_slash(server):
    """`POST /v1/documents/` was Starlette's 307 redirect to `/v1/documents`, which many HTTP clients do not
    follow for a POST: every route answers with or without one trailing slash, as it does without; a path of
    no route stays the 404 every other unknown path gets, and a wrong method the 405 naming the right ones."""
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as h:
        asked: set[tuple[str, str]] = set()

        def call(method: str, path: str, route: str, **kw) -> httpx.Response:
            asked.add((method, route))
            r = h.request(method, path + "/", **kw)
            assert r.status_code == 200, (method, path, r.status_code, r.text[:200])
            return r

        call("POST", C, C, json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        call("POST", CH, CH, json=chat)
        assert call("POST", "/tokenize", "/tokenize", json={"prompt": "ab"}).json()["tokens"] == [97, 98]
        call("POST", "/detokenize", "/detokenize", json={"tokens": [97, 98]})
        doc = call("POST", D, D, json={"text": "a short document"}).json()["id"]
        assert doc in [d["id"] for d in call("GET", D, D).json()["data"]]
        one = D + "/{doc_id}"
        assert call("GET", f"{D}/{doc}", one).json()["id"] == doc
        call("POST", f"{D}/{doc}/ask", one + "/ask", json={"question": "?", "max_tokens": 2})
        assert call("DELETE", f"{D}/{doc}", one).json()["deleted"] is True
        assert call("GET", "/v1/models", "/v1/models").json()["data"][0]["id"] == "fake"
        assert call("GET", "/v1/models/fake", "/v1/models/{model_id:path}").json()["id"] == "fake"
        assert call("GET", "/version", "/version").json()["version"]
        assert call("GET", "/health", "/health").json()["status"] == "ok"
        call("HEAD", "/health", "/health")
        call("GET", "/metrics", "/metrics")
        call("GET", "/v1/stats", "/v1/stats")
        call("POST", "/reset_prefix_cache", "/reset_prefix_cache")
        call("POST", "/flush_cache", "/flush_cache")

        from longctx.server.app import create_app, route_leaves
        from longctx.server.engine_proc import EngineSpec
        from longctx.server.state import ServerSettings

        settings = ServerSettings(spec=EngineSpec(model_dir="x", fake={}), served_model_name="fake")
        routes = {(m, r.path) for r in route_leaves(create_app(settings).routes) for m in r.methods}
        assert routes == asked  # (a route added later is asked here too)

        unknown = h.get("/v1/nothing-here")
        assert unknown.status_code == 404
        for path in ("/v1/nothing-here/", C + "//", D + "/x/ask/more/", "/"):
            r = h.post(path) if path != "/" else h.get(path)
            assert (r.status_code, r.json()) == (404, unknown.json()), (path, r.text)
        r = h.get(C + "/")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
