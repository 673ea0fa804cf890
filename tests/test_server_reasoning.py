"""Reasoning output (`longctx serve --reasoning-parser glm|deepseek_v3`): a chat answer's <think> block split into
`reasoning_content`, whole and streamed alike, with tool calls read from the rest; vLLM's chat_template_kwargs."""

from __future__ import annotations

import random

import httpx
import pytest

from longctx.server.reasoning import ReasoningStream, opens_in_thought, split_reasoning

from .server_helpers import fake_server, openai_client, with_chat_template

CASES = [
    ("<think>weigh it</think>\n\nThe answer.", False, ("weigh it", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("no thinking here", False, (None, "no thinking here")),
    ("<thin", False, (None, "<thin")),
    ("<think>cut before it ends", False, ("cut before it ends", "")),
    ("opened by the prompt</think>\nanswer", True, ("opened by the prompt", "answer")),
    ("</think>", True, ("", "")),
    ("x <think>late</think>", False, (None, "x <think>late</think>")),
    ("<think></think>\n\n\n", False, ("", "")),
]


@pytest.mark.parametrize("text, in_thought, want", CASES)
def test_split_whole_and_streamed_alike(text, in_thought, want):
    assert split_reasoning(text, in_thought) == want
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
        s = ReasoningStream(in_thought)
        parts = [s.delta(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [s.end()]
        thought = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        assert (thought if want[0] is not None else None, content) == want, cuts
    # nothing is sent ahead of a tag that may still come
    s = ReasoningStream()
    assert (
        s.delta("<th") == ("", "") and s.delta("ink>so") == ("so", "") and s.delta(" on</th") == (" on", "")
    )
    assert s.delta("ink>\n") == ("", "") and s.delta("\nOK") == ("", "OK")


def test_a_prompt_left_inside_a_think_block():
    assert opens_in_thought("<|assistant|>\n<think>") and opens_in_thought("<think>\n")
    assert not opens_in_thought("<|assistant|>\n<think></think>") and not opens_in_thought("<|assistant|>")
    # DeepSeek-V3.1 / V3.2's generation prompts, thinking and not
    assert opens_in_thought("<｜User｜>hi<｜Assistant｜><think>")
    assert not opens_in_thought("<｜User｜>hi<｜Assistant｜></think>")


TOOLS = [{"type": "function", "function": {"name": "now"}}]
# with "enable_thinking": false the template closes the think block in the prompt, as GLM's templates do;
# otherwise it leaves one open for the output
TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}"
    "{% if open_think %}{{ '<think>' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module", params=["glm", "deepseek_v3"])
def srv(tmp_path_factory, request):
    d = with_chat_template(tmp_path_factory.mktemp("reasoning"), TEMPLATE)
    with fake_server(
        d, "--reasoning-parser", request.param, "--served-model-name", "fake", step_delay_s=0.001
    ) as s:
        yield s


def test_reasoning_and_auto_tool_calls_over_http(srv):
    """The fake engine's greedy output echoes the prompt: "\\n" + the user's text + "<|assistant|>\\n"... So
    a user text holding a think block and a call comes back split: reasoning, content, the call."""
    # the startup log says how chats are read (--tool-call-parser auto: the fake engine's, GLM's)
    assert (
        f"scheduling=fcfs tool calls=glm reasoning={srv.args[srv.args.index('--reasoning-parser') + 1]}"
        in (srv.log())
    )
    client = openai_client(srv)
    user = "<think>check the clock</think>\n\nLet me look. <tool_call>now</tool_call>"
    body = dict(model="fake", messages=[{"role": "user", "content": user}], tools=TOOLS, temperature=0)
    body["max_tokens"] = len(user.encode()) + 2  # (the echo: <|user|>, a newline, then the user's text)
    r = client.chat.completions.create(**body)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "check the clock" and msg.content == "Let me look. "
    assert [c.function.name for c in msg.tool_calls] == ["now"] and msg.tool_calls[
        0
    ].function.arguments == "{}"
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc.function.name for d in deltas for tc in d.tool_calls or []]
    assert (thought, content, calls) == ("check the clock", "Let me look. ", ["now"])
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # no think block: no reasoning_content, the text as it is
    plain = dict(body, messages=[{"role": "user", "content": "just text"}], max_tokens=11)
    plain.pop("tools")
    msg = client.chat.completions.create(**plain).choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {}) and msg.content == "\njust text"


def test_chat_template_kwargs_reach_the_template(srv):
    """vLLM's chat_template_kwargs: enable_thinking false closes the think block in the prompt (so the output
    is content: reasoning read from an open block only); the template's own variables are refused."""
    msgs = [{"role": "user", "content": "hi"}]
    tok = [
        httpx.post(srv.url + "/tokenize", json={"messages": msgs, **kw}, timeout=30).json()["count"]
        for kw in ({}, {"chat_template_kwargs": {"enable_thinking": False}})
    ]
    assert tok[1] == tok[0] + len("<think></think>")
    # the prompt leaves no block open and the echo holds none at its start: all content
    body = {"model": "fake", "messages": msgs, "max_tokens": 4, "temperature": 0}
    off = httpx.post(
        srv.url + "/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=30,
    ).json()
    assert (
        off["choices"][0]["message"]["content"] == "\nhi"
        and "reasoning_content" not in off["choices"][0]["message"]
    )
    # a prompt that leaves <think> open: the output is reasoning until </think> (here cut before it)
    opened = httpx.post(
        srv.url + "/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"open_think": True}},
        timeout=30,
    ).json()["choices"][0]["message"]
    assert opened["reasoning_content"] == "\nhi" and opened["content"] == ""
    for bad in ({"messages": []}, {"add_generation_prompt": False}, {"tools": []}):
        r = httpx.post(
            srv.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": bad}, timeout=30
        )
        err = r.json()["error"]
        assert (
            r.status_code == 400
            and err["param"] == "chat_template_kwargs"
            and "set by the request" in err["message"]
        )


def test_chat_template_flag_and_version(tmp_path):
    """`serve --chat-template` (a file, or the template inline) replaces the model directory's; /version is
    vLLM's. A value that is neither, or a template jinja cannot parse, is one line."""
    from longctx import __version__
    from longctx.cli import CLIError
    from longctx.server.cli import read_chat_template

    tpl = "{% for m in messages %}{{ '[' + m['content'] + ']' }}{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(tpl)
    assert read_chat_template(str(f)) == tpl == read_chat_template(tpl) and read_chat_template(None) is None
    for bad, words in (("no-such-file", "neither a file nor"), ("{% for %}", "chat_template: line 1")):
        with pytest.raises(CLIError, match=words):
            read_chat_template(bad)
    with fake_server(tmp_path, "--served-model-name", "fake", "--chat-template", str(f)) as s:
        body = {"messages": [{"role": "user", "content": "abc"}]}
        assert httpx.post(s.url + "/tokenize", json=body, timeout=30).json()["tokens"] == list(b"[abc]")
        assert httpx.get(s.url + "/version", timeout=30).json() == {"version": __version__}


def test_the_fake_engine_holds_guided_requests_to_their_guides(srv):
    """The fake engine (load benches, server tests) keeps a guide as the real engine does: a regex's match,
    "required" tool calls that parse, greedy and sampled alike."""
    import re

    client = openai_client(srv)
    msgs = [{"role": "user", "content": "anything"}]
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=40, temperature=temperature, seed=2,
            extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"},
        )  # fmt: skip
        assert (
            re.fullmatch("[0-9]{3}-[a-c]{2}", r.choices[0].message.content)
            and r.choices[0].finish_reason == "stop"
        )
        tools = [{"type": "function", "function": {"name": "now"}}]
        r = client.chat.completions.create(
            model="fake", messages=msgs, max_tokens=200, temperature=temperature, seed=3, tools=tools,
            tool_choice="required",
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls", r
        assert {c.function.name for c in r.choices[0].message.tool_calls} == {"now"}
