"""Tool calling for chat completions, the model-independent forms (vLLM's named and required function
calling): the output is held by guided decoding (`longctx.engine.guided`) to JSON a client can read as
tool calls, whatever the model's own tool-call format.

  * `tool_choice: {"type": "function", "function": {"name": F}}`: the output is F's arguments, an instance of
    its `parameters` schema; the message carries one call of F (`finish_reason` "stop", as OpenAI's forced
    calls end).
  * `tool_choice: "required"`: the output is a JSON array of one or more `{"name": N, "parameters": {...}}`
    objects, each N a tool and its parameters an instance of N's schema; the message carries those calls
    (`finish_reason` "tool_calls").
  * `"auto"` (OpenAI's default with tools): the model writes text or calls as it chooses, in its own
    tool-call format, which is read back (`parse_calls`). `longctx serve --tool-call-parser` (vLLM's flag)
    names the format, a `ToolFormat` (`FORMATS`):
      - `glm` (the default; GLM-4.5 and later): a call is `<tool_call>NAME` then, per argument,
        `<arg_key>KEY</arg_key>` and `<arg_value>VALUE</arg_value>` (whitespace between them allowed), then
        `</tool_call>`. A value is kept as text where the tool's schema types that argument a string, and
        read as JSON elsewhere (as text when it is not JSON).
      - `deepseek_v31` (DeepSeek-V3.1): `<｜tool▁calls▁begin｜>` opens the calls, each
        `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`, and `<｜tool▁calls▁end｜>` closes
        them. ARGUMENTS is JSON text, kept as written when it is an object (none: `{}`); anything else is
        kept as text (the arguments a JSON string of it), as a GLM value that is not JSON is.
      - `deepseek_v32` (DeepSeek-V3.2's "DSML"): `<｜DSML｜function_calls>` opens the calls, each
        `<｜DSML｜invoke name="NAME">`, per argument
        `<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>`, then `</｜DSML｜invoke>`;
        `</｜DSML｜function_calls>` closes them. A value is text with `string="true"`, read as JSON with
        `"false"` (as text when it is not JSON), and typed by the schema without the attribute, as GLM's.
    (The bars are U+FF5C, the separators U+2581.) A format is where its calls begin (`begins`: the text
    before it is the message's content), one call's open and close markers, and how the body between them
    reads as a name and its arguments' JSON text; one parse and one stream serve them all. A call is read
    once it is closed, whether or not the calls' own close follows; one with no name (or, in DeepSeek-V3.1's,
    no separator) is no call, and text between and after the calls is dropped. With whole calls the finish
    reason is "tool_calls"; an output with none is all content. Streamed, the content goes out as it comes
    (holding back what may be the start of `begins`) and each call once it is closed.
  * `"none"` (or no tools): plain text.

The tools go to the chat template as its `tools` (as transformers passes them), so a template that
describes them does. An output cut short by max_tokens stays text (`finish_reason` "length").
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from longctx.server.reasoning import held_back

MAX_TOOLS = 128

# (a call's name and its arguments' JSON text, read from the call's body; None: not a call)
Reader = Callable[[str, dict[str, dict[str, Any]]], tuple[str, str] | None]


@dataclass(frozen=True)
class ToolFormat:
    """A model's "auto" tool-call format: the marker whose first occurrence ends the content (`begins`), one
    call's `open` and `close` markers, and `read`, which reads the body between them (with the request's
    tools by name, whose schemas may type its arguments)."""

    name: str
    begins: str
    open: str
    close: str
    read: Reader
    call: re.Pattern[str] = field(init=False, repr=False, compare=False)  # one whole call, its body group 1

    def __post_init__(self) -> None:
        pattern = re.escape(self.open) + "(.*?)" + re.escape(self.close)
        object.__setattr__(self, "call", re.compile(pattern, re.S))


def _is_text(schema: Any) -> bool:
    """Whether an argument's schema types it a string (its value is written raw, not as JSON)."""
    t = schema.get("type") if isinstance(schema, dict) else None
    return t == "string" or (isinstance(t, list) and bool(t) and all(x in ("string", "null") for x in t))


def _properties(tool: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's argument schemas by name ({} for a tool not in the request)."""
    props = parameters_of(tool).get("properties", {}) if tool is not None else {}
    return props if isinstance(props, dict) else {}


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # (json.loads takes NaN and Infinity; JSON has none)


def _json(raw: str) -> Any:
    """`raw` read as JSON (ValueError when it is not)."""
    return json.loads(raw, parse_constant=_not_json)


def _value(raw: str, text: bool) -> Any:
    """An argument's value: `raw` itself where it is `text`, else read as JSON (`raw` when it is not JSON)."""
    if text:
        return raw
    try:
        return _json(raw)
    except ValueError:
        return raw


def _dumps(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False)


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _read_glm(body: str, by_name: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """`NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`: each value typed by the tool's schema."""
    name = body.split("<arg_key>", 1)[0].strip()
    if not name:
        return None
    props = _properties(by_name.get(name))
    args = {m.group(1).strip(): m.group(2) for m in _ARG.finditer(body)}
    return name, _dumps({k: _value(v, _is_text(props.get(k))) for k, v in args.items()})


V31_SEP = "<｜tool▁sep｜>"


def _read_v31(body: str, by_name: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """`NAME<｜tool▁sep｜>ARGUMENTS`: the JSON object text as written ({} for none); anything else as text."""
    name, sep, raw = body.partition(V31_SEP)
    name, raw = name.strip(), raw.strip()
    if not (name and sep):
        return None
    if not raw:
        return name, "{}"
    try:
        is_object = isinstance(_json(raw), dict)
    except ValueError:
        is_object = False
    return name, raw if is_object else _dumps(raw)


_INVOKE = re.compile(r'\s+name="([^"]*)"\s*>(.*)', re.S)
_PARAMETER = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</｜DSML｜parameter>', re.S
)


def _read_v32(body: str, by_name: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """` name="NAME">` then `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`s: a value
    is text for string="true", JSON for "false" (text when it is not), typed by the schema without it."""
    m = _INVOKE.match(body)
    if m is None or not m.group(1):
        return None
    name = m.group(1)
    props = _properties(by_name.get(name))
    args = {
        key: _value(raw, string == "true" if string else _is_text(props.get(key)))
        for key, string, raw in _PARAMETER.findall(m.group(2))
    }
    return name, _dumps(args)


GLM = ToolFormat("glm", "<tool_call>", "<tool_call>", "</tool_call>", _read_glm)
DEEPSEEK_V31 = ToolFormat(
    "deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _read_v31
)
DEEPSEEK_V32 = ToolFormat(
    "deepseek_v32", "<｜DSML｜function_calls>", "<｜DSML｜invoke", "</｜DSML｜invoke>", _read_v32
)
FORMATS = {f.name: f for f in (GLM, DEEPSEEK_V31, DEEPSEEK_V32)}  # `--tool-call-parser`'s choices
# `--tool-call-parser auto`: each model type's own format (config.json's model_type)
FORMAT_OF_MODEL_TYPE = {"glm_moe_dsa": "glm", "deepseek_v32": "deepseek_v32"}


def tool_call_parser(choice: str, model_type: str | None) -> str:
    """The format `--tool-call-parser CHOICE` reads "auto" tool calls in: CHOICE, or for "auto" the model
    type's own (GLM's where the type is unknown: the fake engine has no config)."""
    if choice != "auto":
        return choice
    return FORMAT_OF_MODEL_TYPE.get(model_type or "", "glm")


def parse_calls(
    text: str, tools: list[dict[str, Any]], parallel: bool = True, call_format: ToolFormat = GLM
) -> tuple[str, list[dict[str, Any]]]:
    """The tool calls in a model's text (tool_choice "auto") in `call_format`: (the content before the calls,
    the whole calls; the first alone unless `parallel`). Text with no whole call is all content."""
    start = text.find(call_format.begins)
    if start < 0:
        return text, []
    by_name = _by_name(tools)
    found = (_read_call(call_format, m.group(1), by_name) for m in call_format.call.finditer(text, start))
    calls = [c for c in found if c is not None]
    calls = calls if parallel else calls[:1]
    return (text[:start], calls) if calls else (text, [])


def _by_name(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t for t in tools}


def _read_call(
    call_format: ToolFormat, body: str, by_name: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """The call of one call's body (between `open` and `close`); None where it is no call."""
    read = call_format.read(body, by_name)
    return _call(*read) if read is not None else None


def tool_guide(tools: list[dict[str, Any]], choice: Any, parallel: bool = True) -> tuple[str, ...]:
    """SamplingParams.guided for a request's tools and tool_choice (already validated); () for plain text.
    `parallel` (OpenAI's parallel_tool_calls): "required" may make several calls."""
    from longctx.engine.guided import guide_of  # (numpy's import: not for `longctx serve`'s flags)

    if not tools or choice in (None, "none", "auto"):
        return ()
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters_of(t)},
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}} | (
            {} if parallel else {"maxItems": 1}
        )
        return guide_of(json_schema=schema)
    return guide_of(json_schema=parameters_of(named_tool(tools, choice)))


def named_tool(tools: list[dict[str, Any]], choice: dict[str, Any]) -> dict[str, Any]:
    name = choice["function"]["name"]
    return next(t for t in tools if t["function"]["name"] == name)


def parameters_of(tool: dict[str, Any]) -> Any:
    """A tool's parameters schema (none given: an empty object)."""
    p = tool["function"].get("parameters")
    return {"type": "object", "properties": {}} if p is None else p


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calls(choice: Any, text: str) -> list[dict[str, Any]] | None:
    """The calls a guided output holds (`choice` a named tool_choice or "required"); None when it is not whole
    (cut by max_tokens)."""
    if isinstance(choice, dict):
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(choice["function"]["name"], text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(calls, list) and calls and all(isinstance(c, dict) and "name" in c for c in calls)):
        return None
    return [_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]


def finish_reason(choice: Any, finish: str | None) -> str | None:
    """OpenAI's: "tool_calls" for the calls of tool_choice "required", "stop" for a named one's."""
    return "tool_calls" if choice == "required" and finish == "stop" else finish


class ToolStream:
    """One streamed choice's tool calls: a named call's arguments as they come (its id, type and name with
    the first), "required"'s calls all at the end (their JSON is read whole), "auto"'s content as it comes
    and each of its calls once closed (in `call_format`)."""

    def __init__(
        self,
        choice: Any,
        tools: list[dict[str, Any]] | None = None,
        parallel: bool = True,
        call_format: ToolFormat = GLM,
    ) -> None:
        self.choice = choice
        self.tools = _by_name(tools or [])
        self.parallel = parallel  # ("auto": False sends the first call alone)
        self.call_format = call_format
        self.id = call_id()
        self.started = False
        self.text = ""
        self.sent = 0  # "auto": the text's characters sent as content, or read as calls
        self.opened = -1  # "auto": where the calls begin (-1: not yet)
        self.calls = 0  # "auto": calls sent

    def delta(self, text: str) -> dict[str, Any] | None:
        """The chunk delta of `text` (None: held back)."""
        self.text += text
        if self.choice == "auto":
            return self._auto() if text else None
        if not isinstance(self.choice, dict) or not text:
            return None
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not self.started:
            self.started = True
            name = self.choice["function"]["name"]
            call = {
                "index": 0,
                "id": self.id,
                "type": "function",
                "function": {"name": name, "arguments": text},
            }
        return {"tool_calls": [call]}

    def _auto(self, end: bool = False) -> dict[str, Any] | None:
        """ "auto": the content not sent yet, up to where the calls begin (while streaming, short of what may
        be the start of that), then each call as it closes."""
        delta: dict[str, Any] = {}
        form = self.call_format
        if self.opened < 0:
            start = self.text.find(form.begins, self.sent)
            if start >= 0:
                self.opened = start
            upto = start if start >= 0 else len(self.text) - (0 if end else held_back(self.text, form.begins))
            if upto > self.sent:
                delta["content"] = self.text[self.sent : upto]
                self.sent = upto
        calls = []
        while self.opened >= 0 and (m := form.call.search(self.text, self.sent)) is not None:
            self.sent = m.end()
            call = _read_call(form, m.group(1), self.tools)
            if call is not None and (self.parallel or not self.calls):
                calls.append({"index": self.calls, **call})
                self.calls += 1
        if calls:
            delta["tool_calls"] = calls
        return delta or None

    def end(self, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(the delta the end sends, None for none; the finish reason): "required"'s calls, or the text held
        back when it is not whole calls (cut by max_tokens); "auto"'s content held back, its last calls, and
        "tool_calls" when it made whole calls."""
        if self.choice == "auto":
            delta = self._auto(end=True) or {}
            if (
                self.opened >= 0 and not self.calls
            ):  # no whole call: the rest is content, as `tool_message` has it
                delta["content"] = delta.get("content", "") + self.text[self.opened :]
            return delta or None, ("tool_calls" if self.calls and finish == "stop" else finish)
        if isinstance(self.choice, dict):
            return None, finish
        msg, finish = tool_message(self.choice, self.text, finish)
        if "tool_calls" in msg:
            return {"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]}, finish
        return ({"content": self.text} if self.text else None), finish


def tool_message(
    choice: Any,
    text: str,
    finish: str | None,
    tools: list[dict[str, Any]] | None = None,
    parallel: bool = True,
    call_format: ToolFormat = GLM,
) -> tuple[dict[str, Any], str | None]:
    """A whole (not streamed) choice's message and finish reason: its calls ("auto"'s read in `call_format`),
    or its text when it holds none."""
    if choice == "auto":
        content, auto = parse_calls(text, tools or [], parallel, call_format)
        if not auto:
            return {"role": "assistant", "content": text}, finish
        msg = {"role": "assistant", "content": content or None, "tool_calls": auto}
        return msg, ("tool_calls" if finish == "stop" else finish)
    calls = tool_calls(choice, text) if finish == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason(choice, finish)
