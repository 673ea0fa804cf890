"""OpenAI response objects (completion, chat completion, their stream chunks) and SSE framing."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import StreamingResponse

from longctx.server import messages as m
from longctx.server.text import TextCodec


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_comment(text: str) -> str:
    return f": {text}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its generator.

    Starlette stops iterating when the client goes away but leaves closing the async generator to
    the garbage collector; closing it here runs the generator's `finally` at once, which is where
    the engine request is aborted and its KV pages freed.
    """

    def __init__(self, content: Any, **kw: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers, **kw)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def completion_logprobs(codec: TextCodec, lps: list[m.WireLogprob], offset0: int = 0) -> dict[str, Any]:
    tokens = [codec.decode([lp.token_id]) for lp in lps]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [_top_by_text(codec, lp.top) for lp in lps],
        "text_offset": offsets,
    }


def _top_by_text(codec: TextCodec, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """Completions' top alternatives as token text -> logprob. Tokens that read the same (pieces of UTF-8
    characters all read U+FFFD, special tokens "") share their key, which keeps the likeliest one's."""
    out: dict[str, float] = {}
    for t, p in top:
        text = codec.decode([t])
        out[text] = max(p, out.get(text, p))
    return out


def chat_logprobs(codec: TextCodec, lps: list[m.WireLogprob], top_n: int) -> dict[str, Any]:
    def entry(tid: int, p: float) -> dict[str, Any]:
        return {"token": codec.decode([tid]), "logprob": p, "bytes": list(codec.token_bytes(tid))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top[:top_n]]}
            for lp in lps
        ]
    }


def prompt_logprobs(codec: TextCodec, lps: list[m.WireLogprob], top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per token a map of token id
    (as a string) -> {"logprob", "rank", "decoded_token"} holding the prompt's token (its rank: 1 + the
    tokens likelier than it) and its top_n alternatives (ranks 1..top_n)."""

    def entry(tid: int, p: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": p, "rank": rank, "decoded_token": codec.decode([tid])}

    out: list[dict[str, Any] | None] = [None]  # (a prompt has at least one token: empty ones are refused)
    for lp in lps:
        d = {str(t): entry(t, p, j + 1) for j, (t, p) in enumerate(lp.top[:top_n])}
        d[str(lp.token_id)] = entry(lp.token_id, lp.logprob, lp.rank)
        out.append(d)
    return out


Choice = tuple[str, "str | None", Any]  # (text, finish reason, logprobs) of one of a request's n choices


def completion(rid: str, model: str, choices: list[Choice], usage: dict | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            for i, (text, finish, lp) in enumerate(choices)
        ],
        "usage": usage,
    }


def chat_completion(rid: str, model: str, choices: list[Choice], usage: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": finish,
            }
            for i, (text, finish, lp) in enumerate(choices)
        ],
        "usage": usage,
    }


def _chunk(rid: str, model: str, obj: str, choice: dict, usage: dict | None, empty: bool) -> dict:
    """One streamed chunk: `choice` as the only choice, or no choices (the usage-only last chunk)."""
    out: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [] if empty else [choice],
    }
    if usage is not None or empty:
        out["usage"] = usage
    return out


def chat_chunk(
    rid: str,
    model: str,
    delta: dict,
    finish: str | None,
    logprobs: Any = None,
    usage: dict | None = None,
    empty: bool = False,
    index: int = 0,
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return _chunk(rid, model, "chat.completion.chunk", choice, usage, empty)


def completion_chunk(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    logprobs: Any = None,
    usage: dict | None = None,
    empty: bool = False,
    index: int = 0,
) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return _chunk(rid, model, "text_completion", choice, usage, empty)
