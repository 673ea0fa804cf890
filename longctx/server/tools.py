"""Tool calling for chat completions, the model-independent forms (vLLM's named and required function
calling): the output is held by guided decoding (`longctx.engine.guided`) to JSON a client can read as
tool calls, whatever the model's own tool-call format.

  * `tool_choice: {"type": "function", "function": {"name": F}}`: the output is F's arguments, an instance of
    its `parameters` schema; the message carries one call of F (`finish_reason` "stop", as OpenAI's forced
    calls end).
  * `tool_choice: "required"`: the output is a JSON array of one or more `{"name": N, "parameters": {...}}`
    objects, each N a tool and its parameters an instance of N's schema; the message carries those calls
    (`finish_reason` "tool_calls").
  * `"auto"` (OpenAI's default with tools): the model writes text or calls as it chooses, in GLM's own
    tool-call format, which is read back (`parse_calls`): a call is `<tool_call>NAME` then, per argument,
    `<arg_key>KEY</arg_key>` and `<arg_value>VALUE</arg_value>` (whitespace between them allowed), then
    `</tool_call>`. A value is kept as text where the tool's schema types that argument a string, and read
    as JSON elsewhere (as text when it is not JSON). The text before the first call is the message's
    content; with whole calls the finish reason is "tool_calls". Streamed, the content goes out as it
    comes (holding back what may be the start of `<tool_call>`) and each call once it is closed.
  * `"none"` (or no tools): plain text.

The tools go to the chat template as its `tools` (as transformers passes them), so a template that
describes them does. An output cut short by max_tokens stays text (`finish_reason` "length").
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from longctx.engine.guided import guide_of

MAX_TOOLS = 128


CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + "(.*?)" + re.escape(CALL_CLOSE), re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _is_text(schema: Any) -> bool:
    """Whether an argument's schema types it a string (its value is written raw, not as JSON)."""
    t = schema.get("type") if isinstance(schema, dict) else None
    return t == "string" or (isinstance(t, list) and bool(t) and all(x in ("string", "null") for x in t))


def _arguments(body: str, tool: dict[str, Any] | None) -> str:
    """A call's arguments as a JSON object text, each value typed by the tool's schema."""
    props = parameters_of(tool).get("properties", {}) if tool is not None else {}
    args: dict[str, Any] = {}
    for m in _ARG.finditer(body):
        key, raw = m.group(1).strip(), m.group(2)
        if _is_text(props.get(key) if isinstance(props, dict) else None):
            args[key] = raw
            continue
        try:
            args[key] = json.loads(raw)
        except ValueError:
            args[key] = raw
    return json.dumps(args, ensure_ascii=False)


def parse_calls(
    text: str, tools: list[dict[str, Any]], parallel: bool = True
) -> tuple[str, list[dict[str, Any]]]:
    """GLM's tool calls in a model's text (tool_choice "auto"): (the content before the first call, the whole
    calls; the first alone unless `parallel`). Text with no whole call is all content."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    by_name = _by_name(tools)
    calls = [c for m in _CALL.finditer(text, start) if (c := _read_call(m.group(1), by_name)) is not None]
    calls = calls if parallel else calls[:1]
    return (text[:start], calls) if calls else (text, [])


def _by_name(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t for t in tools}


def _read_call(body: str, by_name: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The call of one `<tool_call>` block's body (its name, then its arguments); None without a name."""
    name = body.split("<arg_key>", 1)[0].strip()
    return _call(name, _arguments(body, by_name.get(name))) if name else None


def _open_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins CALL_OPEN (held back while streaming)."""
    for k in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return k
    return 0


def tool_guide(tools: list[dict[str, Any]], choice: Any, parallel: bool = True) -> tuple[str, ...]:
    """SamplingParams.guided for a request's tools and tool_choice (already validated); () for plain text.
    `parallel` (OpenAI's parallel_tool_calls): "required" may make several calls."""
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
    and each of its calls once closed."""

    def __init__(self, choice: Any, tools: list[dict[str, Any]] | None = None, parallel: bool = True) -> None:
        self.choice = choice
        self.tools = _by_name(tools or [])
        self.parallel = parallel  # ("auto": False sends the first call alone)
        self.id = call_id()
        self.started = False
        self.text = ""
        self.sent = 0  # "auto": the text's characters sent as content, or read as calls
        self.opened = -1  # "auto": where the first call begins (-1: none yet)
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
        """ "auto": the content not sent yet, up to the first call (while streaming, short of what may be
        the start of one), then each call as it closes."""
        delta: dict[str, Any] = {}
        if self.opened < 0:
            start = self.text.find(CALL_OPEN, self.sent)
            if start >= 0:
                self.opened = start
            upto = start if start >= 0 else len(self.text) - (0 if end else _open_prefix(self.text))
            if upto > self.sent:
                delta["content"] = self.text[self.sent : upto]
                self.sent = upto
        calls = []
        while self.opened >= 0 and (m := _CALL.search(self.text, self.sent)) is not None:
            self.sent = m.end()
            call = _read_call(m.group(1), self.tools)
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
) -> tuple[dict[str, Any], str | None]:
    """A whole (not streamed) choice's message and finish reason: its calls, or its text when it holds none."""
    if choice == "auto":
        content, auto = parse_calls(text, tools or [], parallel)
        if not auto:
            return {"role": "assistant", "content": text}, finish
        msg = {"role": "assistant", "content": content or None, "tool_calls": auto}
        return msg, ("tool_calls" if finish == "stop" else finish)
    calls = tool_calls(choice, text) if finish == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason(choice, finish)
