"""Tool calling for chat completions, the model-independent forms (vLLM's named and required function
calling): the output is held by guided decoding (`longctx.engine.guided`) to JSON a client can read as
tool calls, whatever the model's own tool-call format.

  * `tool_choice: {"type": "function", "function": {"name": F}}`: the output is F's arguments, an instance of
    its `parameters` schema; the message carries one call of F (`finish_reason` "stop", as OpenAI's forced
    calls end).
  * `tool_choice: "required"`: the output is a JSON array of one or more `{"name": N, "parameters": {...}}`
    objects, each N a tool and its parameters an instance of N's schema; the message carries those calls
    (`finish_reason` "tool_calls").
  * `"none"` (or no tools): plain text. `"auto"` (OpenAI's default with tools) needs a parser of the model's
    own tool-call format, which longctx does not have: a 400 that says to send one of the others.

The tools go to the chat template as its `tools` (as transformers passes them), so a template that
describes them does. An output cut short by max_tokens stays text (`finish_reason` "length").
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from longctx.engine.guided import guide_of

MAX_TOOLS = 128


def tool_guide(tools: list[dict[str, Any]], choice: Any) -> tuple[str, ...]:
    """SamplingParams.guided for a request's tools and tool_choice (already validated); () for plain text."""
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
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
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
    the first), "required"'s calls all at the end (their JSON is read whole)."""

    def __init__(self, choice: Any) -> None:
        self.choice = choice
        self.id = call_id()
        self.started = False
        self.text = ""

    def delta(self, text: str) -> dict[str, Any] | None:
        """The chunk delta of `text` (None: held back)."""
        self.text += text
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

    def end(self, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(the delta the end sends, None for none; the finish reason): "required"'s calls, or the text held
        back when it is not whole calls (cut by max_tokens)."""
        if isinstance(self.choice, dict):
            return None, finish
        msg, finish = tool_message(self.choice, self.text, finish)
        if "tool_calls" in msg:
            return {"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]}, finish
        return ({"content": self.text} if self.text else None), finish


def tool_message(choice: Any, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole (not streamed) choice's message and finish reason: its calls, or its text when it holds none."""
    calls = tool_calls(choice, text) if finish == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, finish_reason(choice, finish)
