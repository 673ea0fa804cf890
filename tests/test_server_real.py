"""The server end to end on the real engine: the tiny random model on CPU, in a subprocess.

Kept to few, short generations: each decode step of the real engine costs tens of milliseconds
on CPU. tests/test_server.py covers the same surface in depth on the fake engine.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import httpx
import pytest
import torch

from longctx.server.testing import ServerProcess

from . import server_helpers
from .server_helpers import check_disconnect_frees_pages, openai_client


@pytest.fixture(scope="module")
def server(tiny_dir):
    with ServerProcess(
        str(tiny_dir), "--device", "cpu", "--max-context", "2048", "--served-model-name", "tiny"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def stats(server) -> dict:
    return server_helpers.stats(server, timeout=30)


def test_openai_client_real_engine(client):
    kw = dict(model="tiny", prompt="The capital of France is", max_tokens=4, temperature=0, ignore_eos=True)
    r = client.completions.create(
        **{k: v for k, v in kw.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=kw["prompt"],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text  # greedy: same tokens

    msgs = [{"role": "user", "content": "hello"}]
    c = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert c.usage.completion_tokens == 3 and len(c.choices[0].logprobs.content) == 3
    assert all(x.logprob <= 0 for x in c.choices[0].logprobs.content)
    s = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(x.choices[0].delta.content or "" for x in s if x.choices) == c.choices[0].message.content
    assert s[-1].usage.completion_tokens == 3


def test_concurrent_streams_real_engine(server):
    def one(i: int) -> str | None:
        body = {"prompt": f"request number {i}", "max_tokens": 3, "stream": True, "ignore_eos": True}
        reason = None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
        return reason

    with cf.ThreadPoolExecutor(16) as ex:
        assert list(ex.map(one, range(16))) == ["length"] * 16


def test_disconnect_returns_pages_real_engine(server):
    check_disconnect_frees_pages(
        server,
        {"prompt": "abc", "max_tokens": 1500, "stream": True, "ignore_eos": True},
        after_events=2,
        http_timeout=60,
        free_within=10.0,
        idle_within=10.0,
        stats_timeout=30,
        interval=0.05,
    )


def test_document_cached_and_progress_real_engine(server):
    text = "Paris is the capital of France. " * 12  # 384 bytes -> ~390 tokens with the chat head
    doc = httpx.post(server.url + "/v1/documents", json={"text": text}, timeout=120).json()
    covered = doc["tokens"] // 64 * 64
    for _ in range(2):
        a = httpx.post(
            server.url + f"/v1/documents/{doc['id']}/ask",
            json={"question": "What is the capital?", "max_tokens": 2},
            timeout=120,
        ).json()
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= covered, a
    assert stats(server)["prefix_cache_pinned_pages"] >= covered // 64
    pinned = stats(server)["prefix_cache_pinned_pages"]
    assert httpx.delete(server.url + f"/v1/documents/{doc['id']}").status_code == 200
    assert stats(server)["prefix_cache_pinned_pages"] == pinned - covered // 64  # unpinned

    # a prompt longer than one prefill chunk (512 tokens on CPU) reports its progress first
    lines = []
    body = {"prompt": "x" * 600, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    progress = [line for line in lines if line.startswith(": prefill ")]
    assert progress and progress[0] == ": prefill 512/600", lines[:5]
    assert lines[-1] == "data: [DONE]"


def test_reset_prefix_cache_real_engine(server):
    """POST /reset_prefix_cache (vLLM's), then POST /flush_cache (SGLang's): a repeated prompt hits the cache;
    the reset frees its pages (a pinned document's would stay), and the prompt is then prefilled cold, with
    the same text; the second reset frees its pages again."""
    prompt = "".join(f"row {i} of a prompt to flush\n" for i in range(6))  # 162 tokens: 2 full pages
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}

    def complete() -> dict:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    cold, warm = complete(), complete()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    done = r.json()
    st = stats(server)
    assert set(done) == {"freed_pages", "kept_pages"} and done["freed_pages"] >= 2
    assert done["kept_pages"] == st["prefix_cache_cached_pages"] == st["prefix_cache_pinned_pages"]
    assert st["prefix_cache_reset_pages"] >= done["freed_pages"]
    again = complete()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"] == again["choices"][0]["text"]
    r = httpx.post(server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["freed_pages"] >= 2, r.text


def test_penalties_reach_the_real_engine(client, tiny_dir):
    """presence / frequency penalties and vLLM's repetition_penalty change the greedy tokens exactly as
    the engine's own `generate` with them does."""
    from longctx import Engine

    prompt, pen = "The capital of France is", dict(presence_penalty=1.5, frequency_penalty=2.0)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, **pen,
        extra_body={"repetition_penalty": 4.0, "ignore_eos": True},
    )  # fmt: skip
    plain = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    with Engine(str(tiny_dir), device="cpu") as e:
        want = e.generate([prompt], max_new_tokens=8, ignore_eos=True, repetition_penalty=4.0, **pen)[0]
    assert r.choices[0].text == want.text != plain.choices[0].text


def test_sampling_controls_reach_the_real_engine(client, tiny_dir):
    """logit_bias, min_tokens, min_p and stop_token_ids over HTTP give the tokens `Engine.generate` gives
    with them: EOS pushed to the top is held back for min_tokens, then ends the request."""
    from longctx import Engine

    prompt = "The capital of France is"
    with Engine(str(tiny_dir), device="cpu") as e:
        eos = e.cfg.eos_ids()[0]
        want = e.generate(
            [prompt], max_new_tokens=8, temperature=0.8, seed=3, min_tokens=4, min_p=0.1,
            logit_bias={eos: 100.0, 65: 3.0}, stop=[66],
        )[0]  # fmt: skip
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.8, seed=3, logit_bias={str(eos): 100, "65": 3},
        extra_body={"min_tokens": 4, "min_p": 0.1, "stop_token_ids": [66]},
    )  # fmt: skip
    assert len(want.token_ids) == 5 and want.token_ids[-1] == eos and want.finish_reason == "stop"
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5
    # vLLM's allowed_token_ids: only those are drawn, greedy or sampled, as Engine.generate draws them
    allowed = [72, 105, 33]  # "H", "i", "!"
    for temp in (0.0, 1.5):
        with Engine(str(tiny_dir), device="cpu") as e:
            want = e.generate(
                [prompt],
                max_new_tokens=6,
                temperature=temp,
                seed=5,
                allowed_token_ids=allowed,
                ignore_eos=True,
            )[0]
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=temp, seed=5,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
        )  # fmt: skip
        assert set(want.token_ids) <= set(allowed) and len(want.token_ids) == 6
        assert r.choices[0].text == want.text


def test_guided_decoding_reaches_the_real_engine(client, server, tiny_dir):
    """JSON schemas (OpenAI's response_format), JSON mode and vLLM's guides (guided_choice, guided_regex,
    structured_outputs) give the text Engine.generate gives with the same guide, streamed or not."""
    import re

    from longctx import Engine

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    }
    msgs = [{"role": "user", "content": "give me JSON"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=60, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"n", "ok"} and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=200, temperature=0.7, seed=3, response_format={"type": "json_object"}
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length" or isinstance(
        json.loads(r.choices[0].message.content), dict
    )
    prompt = "colour: "
    with Engine(str(tiny_dir), device="cpu") as e:
        want = e.generate(
            [prompt], max_new_tokens=10, temperature=1.0, seed=4, guided_choice=["red", "blue"]
        )[0]
        regex = r"[0-9]{3}-[a-z]{2}"
        want_re = e.generate([prompt], max_new_tokens=10, guided_regex=regex)[0]
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=4, extra_body={"guided_choice": ["red", "blue"]}
    )  # fmt: skip
    assert r.choices[0].text == want.text and want.text in ("red", "blue")
    for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body=body
            )
        )
        text = "".join(c.choices[0].text for c in chunks)
        assert text == want_re.text and re.fullmatch(regex, text)
    # a pattern the engine cannot compile is a 400 naming the field; the server goes on
    bad = httpx.post(
        server.url + "/v1/completions", json={"prompt": "a", "guided_regex": "(?=x)"}, timeout=60
    )
    err = bad.json()["error"]
    assert bad.status_code == 400 and err["param"] == "guided_regex" and "lookarounds" in err["message"], (
        bad.text
    )
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None


def test_tool_calls_on_the_real_engine(client, server):
    """Tool calls by name or "required" (tests/test_server_tools.py: their guides and reading), whole and
    streamed; "auto" reads GLM-format calls; a tool schema outside the guide subset is a 400 naming the tools."""
    from .test_server_tools import NAMED, TOOLS

    msgs = [{"role": "user", "content": "weather in Paris?"}]
    named = dict(model="tiny", messages=msgs, tools=TOOLS, tool_choice=NAMED, max_tokens=300, temperature=0)
    r = client.chat.completions.create(**named)  # (greedy: the same call streamed below)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert (
        call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    r = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0.8,
        seed=1,
    )
    if r.choices[0].finish_reason != "length":
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
        for c in r.choices[0].message.tool_calls:
            assert c.function.name in ("get_weather", "now") and isinstance(
                json.loads(c.function.arguments), dict
            )
    # streamed: the named call's arguments as they come, joined they are the whole call's
    chunks = list(client.chat.completions.create(**named, stream=True))
    deltas = [d for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id
    text = "".join(d.tool_calls[0].function.arguments for d in deltas)
    assert text == call.function.arguments and chunks[-1].choices[0].finish_reason == "stop"
    # "auto" (the default with tools): the model's text, read for GLM-format calls. Held to one by a regex
    # guide here (the tiny model writes none of its own), whole and streamed alike
    call = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>[a-z]{1,8}</arg_value>"
        "<arg_key>unit</arg_key><arg_value>[cf]</arg_value></tool_call>"
    )
    auto = dict(model="tiny", messages=msgs, tools=TOOLS, max_tokens=200, temperature=0)
    r = client.chat.completions.create(**auto, extra_body={"guided_regex": call})
    (c,) = r.choices[0].message.tool_calls
    args = json.loads(c.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None, r
    assert c.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    chunks = list(client.chat.completions.create(**auto, extra_body={"guided_regex": call}, stream=True))
    streamed = [
        tc
        for ch in chunks
        if ch.choices and ch.choices[0].delta.tool_calls
        for tc in ch.choices[0].delta.tool_calls
    ]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (c.function.name, c.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(**auto, extra_body={"guided_regex": "[a-z ]{3,12}"})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    # a schema outside longctx's subset (for a guide: "auto" does not compile it) and a name twice are 400s
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 0}}}]
    twice = [{"type": "function", "function": {"name": "f"}}] * 2  # (a name given twice: "auto" too)
    for body in ({"tools": bad, "tool_choice": "required"}, {"tools": twice}):
        r2 = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, **body}, timeout=60)
        err = r2.json()["error"]
        assert r2.status_code == 400 and err["param"] == "tools", r2.text
    assert (
        "'minimum' is not supported"
        in httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": msgs, "tools": bad, "tool_choice": "required"},
            timeout=60,
        ).json()["error"]["message"]
    )


def test_echo_logprobs_score_the_prompt_like_engine_score(client, server, tiny_dir):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) on the real engine: the prompt's token
    logprobs are `Engine.score`'s, even for a prompt whose pages the prefix cache holds."""
    from longctx import Engine

    text = "".join(f"row {i} of a context to score\n" for i in range(8))  # > 2 pages
    client.completions.create(model="tiny", prompt=text, max_tokens=1)  # (its pages now cached)
    r = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and lp.token_logprobs[0] is None and r.usage.completion_tokens == 0
    with Engine(str(tiny_dir), device="cpu") as e:
        ids = e.encode(text)
        ref = torch.log_softmax(e.score(ids), dim=-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert len(lp.token_logprobs) == len(ids)
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])  # (a dict by text: two ids may decode alike)
    # vLLM's prompt_logprobs: the same logprobs, by token id, with each token's rank among the model's
    body = {"model": "tiny", "prompt": text, "max_tokens": 0, "prompt_logprobs": 1}
    plp = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0][
        "prompt_logprobs"
    ]
    assert plp[0] is None and len(plp) == len(ids)
    for i, (tok, entry) in enumerate(zip(ids[1:], plp[1:])):
        mine = entry[str(tok)]
        assert abs(mine["logprob"] - float(want[i])) <= 1e-4 and isinstance(mine["decoded_token"], str)
        assert (
            1 + int((ref[i] > want[i] + 1e-4).sum())
            <= mine["rank"]
            <= 1 + int((ref[i] > want[i] - 1e-4).sum())
        )
    # n = 2: choice 0 computes the prompt's logprobs for both; choice 1 takes the prompt from the cache
    before = stats(server)["prefix_cache_hit_tokens"]
    r = client.completions.create(model="tiny", prompt=text, max_tokens=2, echo=True, logprobs=1, n=2)
    for c in r.choices:
        assert c.text.startswith(text) and torch.allclose(
            torch.tensor(c.logprobs.token_logprobs[1 : len(ids)]), want, atol=1e-4
        )
    assert stats(server)["prefix_cache_hit_tokens"] > before


def test_n_choices_real_engine(client, server):
    """n = 2 on the real engine: seeded choice i is the single request seeded seed + i."""
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    r = client.completions.create(n=2, seed=11, **kw)
    singles = [client.completions.create(seed=s, **kw).choices[0].text for s in (11, 12)]
    assert [c.text for c in r.choices] == singles and r.usage.completion_tokens == 10
    # choice 1 starts once choice 0's prompt is prefilled: it takes the prompt's full pages from the cache
    before = stats(server)["prefix_cache_hit_tokens"]
    long = "".join(f"line {i} of a prompt nobody sent before\n" for i in range(12))  # > 256 bytes
    r = client.completions.create(**{**kw, "prompt": long}, n=2)
    assert len(r.choices) == 2
    assert stats(server)["prefix_cache_hit_tokens"] - before >= len(long.encode()) // 64 * 64
    # several prompts in one request: each prompt's choices are its single request's
    prompts = ["Once upon a time", "The capital of France is"]
    r = client.completions.create(**{**kw, "prompt": prompts}, n=2, seed=11)
    want = [
        c.text
        for p in prompts
        for c in client.completions.create(**{**kw, "prompt": p}, n=2, seed=11).choices
    ]
    assert [c.text for c in r.choices] == want and [c.index for c in r.choices] == [0, 1, 2, 3]


def test_serve_logs_its_kv_cache_and_answers_with_layer_4_kept(tmp_path):
    """The shipped retrieval model served with an fp8 KV cache keeps its config's layer 4 in the model dtype
    (`kv_fp8_skip_layers`), says so when it is ready, and still finds a needle over HTTP."""
    wip = Path(__file__).resolve().parents[1] / "models-shipped" / "retrieval-wip"
    hay = "The grass is green. The sky is blue. The sun is yellow. " * 12
    prompt = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
        f"quiz you about the numbers afterwards.\n{hay}One of the special magic numbers for tall-river is: "
        f"4812753.\n{hay}\nWhat is the special magic number for tall-river mentioned in the provided text? "
        "The special magic number for tall-river mentioned in the provided text is"
    )
    with ServerProcess(str(wip), "--device", "cpu", "--kv-dtype", "fp8_e4m3", "--max-context", "4096") as s:
        r = httpx.post(
            s.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 10, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200 and "4812753" in r.json()["choices"][0]["text"]
        assert "kv=fp8 (layers 4 in the model dtype)" in s.log()


def test_an_upload_whose_client_hangs_up_is_aborted_and_pins_nothing(tiny_dir):
    """A document upload is a long prefill: a client that gives up mid-way cancels it (the engine
    aborts the prefill), so no pages stay pinned for a document nobody was told the id of (they
    were, and the upload ran on for minutes)."""
    with ServerProcess(str(tiny_dir), "--device", "cpu", "--max-context", "65536") as s:
        text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 800  # ~46K tokens
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/documents", json={"text": text}, timeout=1.0)
        assert server_helpers.wait_for(lambda: httpx.get(s.url + "/health").json()["running"] == 0, 10)
        st = server_helpers.stats(s, timeout=30)
        assert (
            st.get("prefix_cache", {}).get("pinned_pages", 0) == 0
            and st.get("prefix_cache_pinned_pages", 0) == 0
        ), st
        assert httpx.get(s.url + "/v1/documents").json()["data"] == []
        # the server goes on: a small upload works
        r = httpx.post(s.url + "/v1/documents", json={"text": "short"}, timeout=60)
        assert r.status_code == 200, r.text
