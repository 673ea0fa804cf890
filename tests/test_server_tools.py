"""Tool calling by name, "required" and "auto": the guide a request's tools make and the calls read back from its
output, whole and streamed, "auto"'s in each `--tool-call-parser` format (GLM's, DeepSeek-V3.1's and V3.2's
DSML); the served format over HTTP on the fake engine (the HTTP route on the real engine:
tests/test_server_real.py)."""

from __future__ import annotations

import json
import random
import re

import pytest

from longctx.engine.guided import guide_regex
from longctx.server import tools

from .server_helpers import fake_server, openai_client, with_chat_template

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


# DeepSeek-V3.1's: the arguments are JSON text, kept as written when an object; a call with no separator is none
V31_TEXT = (
    "Checking. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "unit": "c"}\n<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>now<｜tool▁sep｜><｜tool▁call▁end｜>"
    "<｜tool▁call▁begin｜>no separator<｜tool▁call▁end｜>"
    "<｜tool▁call▁begin｜>later<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>"
    '<｜tool▁call▁begin｜>later<｜tool▁sep｜>{"n": NaN}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
# DeepSeek-V3.2's DSML: string="true" keeps a value as text, "false" reads it as JSON (as text when it is not),
# no attribute types it by the schema; an invoke with no name is no call
V32_TEXT = (
    "Checking. <｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">42</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="false">"c"</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n'
    "<｜DSML｜invoke>\n</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="later">\n'
    '<｜DSML｜parameter name="n" string="false">{"a": [1, 2]}</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="s" string="true">{"a": 1}</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="bad" string="false">not json</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="k">7</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_weather"><｜DSML｜parameter name="city">7</｜DSML｜parameter></｜DSML｜invoke>\n'
    "</｜DSML｜function_calls>"
)
# each format's texts: its calls above, text that ends in a part of where calls begin, a call left open, ...
FORMAT_TEXTS = {
    "glm": [
        AUTO_TEXT,
        "no calls at all <tool_",
        "a <tool_call>get_weather<arg_key>city</arg_key>",
        "<tool",
        "",
    ],
    "deepseek_v31": [
        V31_TEXT,
        "no calls at all <｜tool▁calls▁be",
        "a <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{",
        "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>",  # (outside the calls: text)
        "",
    ],
    "deepseek_v32": [
        V32_TEXT,
        "no calls at all <｜DSML｜func",
        'a <｜DSML｜function_calls><｜DSML｜invoke name="now">',
        '<｜DSML｜invoke name="now"></｜DSML｜invoke>',
        "",
    ],
}


def _auto(text: str, parser: str, parallel: bool = True) -> tuple[dict, str | None]:
    return tools.tool_message("auto", text, "stop", TOOLS, parallel, tools.FORMATS[parser])


def _arguments(msg: dict) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]


def test_auto_reads_deepseek_v31_calls():
    msg, finish = _auto(V31_TEXT, "deepseek_v31")
    assert finish == "tool_calls" and msg["content"] == "Checking. "
    # an object as written; none: {}; not an object, or not JSON (NaN): the text as a JSON string
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'
    assert _arguments(msg) == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("now", {}),
        ("later", "[1, 2]"),
        ("later", '{"n": NaN}'),
    ]
    # with the calls' close or without it, each call is read once it is closed
    unclosed = V31_TEXT[: V31_TEXT.index("<｜tool▁calls▁end｜>")]
    content, calls = tools.parse_calls(unclosed, TOOLS, call_format=tools.DEEPSEEK_V31)
    assert content == "Checking. " and len(calls) == 4
    # GLM's format is text here, as is a call left open or outside the calls
    assert _auto(AUTO_TEXT, "deepseek_v31") == ({"role": "assistant", "content": AUTO_TEXT}, "stop")
    for text in FORMAT_TEXTS["deepseek_v31"][1:]:  # (no whole call after the calls begin: all text)
        assert _auto(text, "deepseek_v31") == ({"role": "assistant", "content": text}, "stop")


def test_auto_reads_deepseek_v32_calls():
    msg, finish = _auto(V32_TEXT, "deepseek_v32")
    assert finish == "tool_calls" and msg["content"] == "Checking. "
    assert _arguments(msg) == [
        ("get_weather", {"city": "42", "unit": "c"}),
        ("now", {}),
        ("later", {"n": {"a": [1, 2]}, "s": '{"a": 1}', "bad": "not json", "k": 7}),
        ("get_weather", {"city": "7"}),  # (no string attribute: the schema types city a string)
    ]
    assert len({c["id"] for c in msg["tool_calls"]}) == 4
    assert _auto(AUTO_TEXT, "deepseek_v32") == ({"role": "assistant", "content": AUTO_TEXT}, "stop")
    for text in FORMAT_TEXTS["deepseek_v32"][1:]:
        assert _auto(text, "deepseek_v32") == ({"role": "assistant", "content": text}, "stop")
    msg, _ = _auto(V32_TEXT, "deepseek_v32", parallel=False)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def _stream(
    text: str, cuts: list[int], finish: str, parser: str = "glm", parallel: bool = True
) -> tuple[str, list[dict], str | None]:
    s = tools.ToolStream("auto", TOOLS, parallel, tools.FORMATS[parser])
    deltas = [s.delta(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
    last, fin = s.end(finish)
    deltas.append(last)
    content = "".join(d.get("content", "") for d in deltas if d)
    calls = [c for d in deltas if d for c in d.get("tool_calls", [])]
    return content, calls, fin


@pytest.mark.parametrize("parser", list(FORMAT_TEXTS))
def test_auto_streamed_equals_whole_for_any_chunking(parser):
    """Streamed, "auto" sends content as it comes, holding back what may begin the calls, and each call when
    it closes: in each format, for any cut of the text into chunks, what arrives equals the whole message."""
    assert set(FORMAT_TEXTS) == set(tools.FORMATS)
    rng = random.Random(parser)
    for text in FORMAT_TEXTS[parser]:
        for finish, parallel in (("stop", True), ("length", True), ("stop", False)):
            msg, want_finish = tools.tool_message(
                "auto", text, finish, TOOLS, parallel, tools.FORMATS[parser]
            )
            for _ in range(30):
                cuts = (
                    sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
                    if len(text) > 1
                    else []
                )
                content, calls, fin = _stream(text, cuts, finish, parser, parallel)
                assert fin == want_finish and content == (msg["content"] or ""), (text, cuts)
                want = [c["function"] for c in msg.get("tool_calls", [])]
                assert [c["function"] for c in calls] == want and [c["index"] for c in calls] == list(
                    range(len(want))
                )
    # content is never sent ahead of a possible start of the calls
    begins = tools.FORMATS[parser].begins
    s = tools.ToolStream("auto", TOOLS, call_format=tools.FORMATS[parser])
    assert s.delta("Hi " + begins[:5]) == {"content": "Hi "} and s.delta(begins[5:]) is None


def test_glm_calls_stream_each_once_closed():
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


# the fake engine's greedy output echoes the prompt: with this template, "\n" and the user's text
ECHO_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def deepseek_v32_server(tmp_path_factory):
    d = with_chat_template(tmp_path_factory.mktemp("tool-formats"), ECHO_TEMPLATE)
    args = ("--tool-call-parser", "deepseek_v32", "--served-model-name", "fake")
    with fake_server(d, *args, step_delay_s=0.001) as s:
        yield s


def test_auto_reads_the_served_format_over_http(deepseek_v32_server):
    """`serve --tool-call-parser deepseek_v32`: a chat's output (the fake engine echoes the user's text) is read
    for DSML calls, whole and streamed alike; GLM's format in it is content."""
    client = openai_client(deepseek_v32_server)
    user = "Let me look. <tool_call>now</tool_call>" + V32_TEXT[len("Checking. ") :] + "\nEND"
    body = dict(model="fake", messages=[{"role": "user", "content": user}], tools=TOOLS, temperature=0)
    body |= {"stop": ["\nEND"], "max_tokens": len(user.encode()) + 2}  # (the echo ends at the stop string)
    want, _ = _auto(V32_TEXT, "deepseek_v32")
    r = client.chat.completions.create(**body)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "\nLet me look. <tool_call>now</tool_call>"
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == _arguments(want)
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    calls = [
        (tc.function.name, json.loads(tc.function.arguments)) for d in deltas for tc in d.tool_calls or []
    ]
    assert (content, calls) == (msg.content, got) and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_call_parser_auto_takes_the_model_types_own_format():
    """`--tool-call-parser auto` (the default): DeepSeek-V3.2's DSML for a deepseek_v32 checkpoint, GLM's for
    glm_moe_dsa and where there is no config (the fake engine); a named format is kept as named."""
    assert tools.tool_call_parser("auto", "deepseek_v32") == "deepseek_v32"
    assert tools.tool_call_parser("auto", "glm_moe_dsa") == "glm"
    assert tools.tool_call_parser("auto", None) == "glm"
    assert tools.tool_call_parser("deepseek_v31", "glm_moe_dsa") == "deepseek_v31"
    assert set(tools.FORMAT_OF_MODEL_TYPE.values()) <= set(tools.FORMATS)
    from longctx.config import SUPPORTED_MODEL_TYPES

    assert set(tools.FORMAT_OF_MODEL_TYPE) == set(SUPPORTED_MODEL_TYPES)
