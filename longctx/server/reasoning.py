"""Reasoning output for chat completions (`longctx serve --reasoning-parser glm|deepseek_v3`, vLLM's
`--reasoning-parser` and names): a thinking model's `<think>...</think>` block goes to the message's
`reasoning_content`, the rest to `content`.

GLM-4.5 and later think before they answer: the output opens with `<think>`, or the prompt does (a chat
template may end its generation prompt with it, and writes `<think></think>` there to turn thinking off), and
`</think>` closes the thinking. DeepSeek-V3.1 and V3.2 in thinking mode do the same (their templates end the
generation prompt with `<think>`, or with `</think>` for no thinking), so one reader serves both names. So an
output is read as:
  * reasoning from its start when the prompt ends inside an open `<think>` (`opens_in_thought`), else from an
    opening `<think>` (leading whitespace allowed), else not at all: all content;
  * reasoning until `</think>`; an output cut before it is all reasoning;
  * content after it, its leading newlines dropped.
Streamed (`ReasoningStream`), each piece goes out as soon as it is known which side it is on: text that may be
the start of `<think>` / `</think>` is held back until the next delta tells.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("none", "glm", "deepseek_v3")


def opens_in_thought(prompt: str) -> bool:
    """Whether a prompt leaves a `<think>` block open (the output starts inside it)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def split_reasoning(text: str, in_thought: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output (see the module docstring)."""
    if not in_thought:
        body = text.lstrip()
        if not body.startswith(THINK_OPEN):
            return None, text
        text = body[len(THINK_OPEN) :]
    end = text.find(THINK_CLOSE)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(THINK_CLOSE) :].lstrip("\n")


def held_back(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back while streaming: the reasoning's
    close tag here, a tool-call format's opening marker in `tools.ToolStream`)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One streamed choice's text split into reasoning and content deltas, as `split_reasoning` splits it
    whole: what `delta` and `end` return, joined, is `split_reasoning(all the text)`."""

    def __init__(self, in_thought: bool = False) -> None:
        self.state = "thought" if in_thought else "start"  # start -> thought -> answer (or start -> answer)
        self.buf = ""  # text not sent yet
        self.opened = in_thought
        self.lead = True  # (answer: its leading newlines are dropped)

    def delta(self, text: str, end: bool = False) -> tuple[str, str]:
        """(reasoning, content) to send for `text` (either may be ""); `end`: nothing more comes."""
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            body = self.buf.lstrip()
            if body.startswith(THINK_OPEN):
                self.state, self.buf, self.opened = "thought", body[len(THINK_OPEN) :], True
            elif end or not THINK_OPEN.startswith(body):
                self.state, self.lead = "answer", False  # (no thinking: the text as it is)
            else:
                return "", ""  # (may still open a <think>)
        if self.state == "thought":
            close = self.buf.find(THINK_CLOSE)
            if close >= 0:
                reasoning, self.buf = self.buf[:close], self.buf[close + len(THINK_CLOSE) :]
                self.state = "answer"
            else:
                keep = 0 if end else held_back(self.buf, THINK_CLOSE)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        if self.state == "answer":
            if self.lead:
                self.buf = self.buf.lstrip("\n")
                self.lead = not self.buf
            content, self.buf = self.buf, ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        return self.delta("", end=True)
