"""Tool calling by name or "required": the guide a request's tools make and the calls read back from its
output, whole and streamed (the HTTP route on the real engine: tests/test_server_real.py)."""

from __future__ import annotations

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
