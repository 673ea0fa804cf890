"""Tool calling by name, "required" and "auto": the guide a request's tools make and the calls read back from its
output, whole and streamed (the HTTP route on the real engine: tests/test_server_real.py)."""

from __future__ import annotations

import json
import random
import re

from longctx.engine.guided import guide_regex
from longctx.server import tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather somewhere",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # (no parameters: an empty object)
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_the_guides_match_exactly_the_calls_a_client_can_read():
    named = re.compile(guide_regex(*tools.tool_guide(TOOLS, NAMED)))
    assert named.fullmatch('{"city": "Paris", "unit": "c"}')
    assert not named.fullmatch('{"city": "Paris"}') and not named.fullmatch('{"unit": "c", "city": "x"}')
    required = re.compile(guide_regex(*tools.tool_guide(TOOLS, "required")))
    assert required.fullmatch('[{"name": "now", "parameters": {}}]')
    assert required.fullmatch(
        '[{"name":"get_weather","parameters":{"city":"Oslo","unit":"f"}}, {"name":"now","parameters":{}}]'
    )
    assert not required.fullmatch("[]") and not required.fullmatch('[{"name": "later", "parameters": {}}]')
    assert (
        tools.tool_guide(TOOLS, "none")
        == tools.tool_guide(TOOLS, "auto")
        == tools.tool_guide([], "required")
        == ()
    )


def test_calls_are_read_from_whole_outputs_only():
    (call,) = tools.tool_calls(NAMED, '{"city": "Paris", "unit": "c"}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    calls = tools.tool_calls(
        "required",
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "é"}}]',
    )
    assert [c["function"] for c in calls] == [
        {"name": "now", "arguments": "{}"},
        {"name": "get_weather", "arguments": '{"city": "é"}'},
    ]
    assert len({c["id"] for c in calls}) == 2
    assert tools.tool_calls(NAMED, '{"city": "Pa') is None and tools.tool_calls("required", "[{") is None
    msg, finish = tools.tool_message("required", '[{"name": "now", "parameters": {}}]', "stop")
    assert (
        msg["content"] is None
        and msg["tool_calls"][0]["function"]["name"] == "now"
        and finish == "tool_calls"
    )
    msg, finish = tools.tool_message(NAMED, '{"city": "Paris", "unit": "c"}', "stop")
    assert (
        msg["tool_calls"][0]["function"]["name"] == "get_weather" and finish == "stop"
    )  # (OpenAI's forced call)
    assert tools.tool_message(NAMED, '{"ci', "length") == ({"role": "assistant", "content": '{"ci'}, "length")


def test_streamed_calls():
    s = tools.ToolStream(NAMED)
    first, second = s.delta('{"city": '), s.delta('"Rome", "unit": "c"}')
    assert first == {"tool_calls": [{"index": 0, "id": s.id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": '}}]}  # fmt: skip
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome", "unit": "c"}'}}]}
    assert s.end("stop") == (None, "stop")
    r = tools.ToolStream("required")
    assert (
        r.delta('[{"name": "now", ') is None and r.delta('"parameters": {}}]') is None
    )  # (held: read whole)
    delta, finish = r.end("stop")
    assert finish == "tool_calls" and delta["tool_calls"][0]["index"] == 0
    assert delta["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    cut = tools.ToolStream("required")
    cut.delta('[{"name": "no')
    assert cut.end("length") == ({"content": '[{"name": "no'}, "length")


AUTO_TEXT = (
    "Checking. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>unit</arg_key><arg_value>c</arg_value>\n</tool_call>\n"
    '<tool_call>now</tool_call><tool_call>later<arg_key>n</arg_key><arg_value>{"a": [1, 2]}</arg_value></tool_call>'
)


def test_auto_reads_glm_calls_typed_by_their_schemas():
    content, calls = tools.parse_calls(AUTO_TEXT, TOOLS)
    assert content == "Checking. " and [c["function"]["name"] for c in calls] == [
        "get_weather",
        "now",
        "later",
    ]
    # city is a string in the schema: kept as text; an unknown tool's argument read as JSON
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "42", "unit": "c"}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert json.loads(calls[2]["function"]["arguments"]) == {"n": {"a": [1, 2]}}
    assert len({c["id"] for c in calls}) == 3
    msg, finish = tools.tool_message("auto", AUTO_TEXT, "stop", TOOLS)
    assert finish == "tool_calls" and msg["content"] == "Checking. " and len(msg["tool_calls"]) == 3
    # no whole call: all text, whatever the finish
    for text in ("plain answer", "half <tool_call>get_weather<arg_key>ci"):
        assert tools.tool_message("auto", text, "stop", TOOLS) == (
            {"role": "assistant", "content": text},
            "stop",
        )
    assert tools.tool_message("auto", "<tool_call>now</tool_call>", "stop", TOOLS)[0]["content"] is None


def _stream(text: str, cuts: list[int], finish: str) -> tuple[str, list[dict], str | None]:
    s = tools.ToolStream("auto", TOOLS)
    deltas = [s.delta(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
    last, fin = s.end(finish)
    deltas.append(last)
    content = "".join(d.get("content", "") for d in deltas if d)
    calls = [c for d in deltas if d for c in d.get("tool_calls", [])]
    return content, calls, fin


def test_auto_streamed_equals_whole_for_any_chunking():
    """Streamed, "auto" sends content as it comes, holding back what may begin <tool_call>, and each call
    when it closes: for any cut of the text into chunks, what arrives equals the whole message."""
    rng = random.Random(0)
    texts = [
        AUTO_TEXT,
        "no calls at all <tool_",
        "a <tool_call>get_weather<arg_key>city</arg_key>",
        "<tool",
        "",
    ]
    for text in texts:
        for finish in ("stop", "length"):
            msg, want_finish = tools.tool_message("auto", text, finish, TOOLS)
            for _ in range(30):
                cuts = (
                    sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
                    if len(text) > 1
                    else []
                )
                content, calls, fin = _stream(text, cuts, finish)
                assert fin == want_finish and content == (msg["content"] or ""), (text, cuts)
                want = [c["function"] for c in msg.get("tool_calls", [])]
                assert [c["function"] for c in calls] == want and [c["index"] for c in calls] == list(
                    range(len(want))
                )
    # content is never sent ahead of a possible call start
    s = tools.ToolStream("auto", TOOLS)
    assert s.delta("Hi <tool_") == {"content": "Hi "} and s.delta("call>now") is None
    assert s.delta("</tool_call>")["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_parallel_tool_calls_false_allows_one_call():
    """OpenAI's parallel_tool_calls: false holds "required" to one call and keeps "auto"'s first, whole and
    streamed alike."""
    one = re.compile(guide_regex(*tools.tool_guide(TOOLS, "required", parallel=False)))
    assert one.fullmatch('[{"name": "now", "parameters": {}}]')
    assert not one.fullmatch('[{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]')
    msg, finish = tools.tool_message("auto", AUTO_TEXT, "stop", TOOLS, parallel=False)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] and finish == "tool_calls"
    s = tools.ToolStream("auto", TOOLS, parallel=False)
    deltas = [s.delta(AUTO_TEXT[i : i + 7]) for i in range(0, len(AUTO_TEXT), 7)] + [s.end("stop")[0]]
    calls = [c["function"] for d in deltas if d for c in d.get("tool_calls", [])]
    assert calls == [c["function"] for c in msg["tool_calls"]]
