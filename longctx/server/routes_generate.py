"""`/v1/completions` and `/v1/chat/completions`, plus the serving core the document routes reuse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from longctx.server import messages as m
from longctx.server import openai_format as fmt
from longctx.server.generation import Delta, Done, Generation, Keepalive, Progress, new_rid
from longctx.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    error_body,
)
from longctx.server.state import ServerState, get_state, read_json

router = APIRouter()


@dataclass(frozen=True)
class Shape:
    """How to format one generation: a completion or a chat completion, with which logprobs."""

    chat: bool
    logprobs: int | None  # None: no logprobs; N: top-N alternatives
    include_usage: bool


def sampling(
    st: ServerState,
    req: _SamplingFields,
    prompt_len: int,
    limit: int | None,
    logprobs: int | None,
) -> m.WireSamplingParams:
    """Request fields -> engine sampling params; rejects prompts that do not fit the context."""
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    max_ctx = st.max_context
    if prompt_len > max_ctx:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens, more than the maximum context of {max_ctx}",
            param="messages",
            code="context_length_exceeded",
        )
    room = max_ctx - prompt_len
    max_new = room if limit is None else min(limit, room)
    return m.WireSamplingParams(
        max_new_tokens=max_new,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=max(0, req.top_k or 0),
        seed=req.seed,
        stop=tuple(req.stop_list()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
    )


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def serve(request: Request, st: ServerState, gen: Generation, shape: Shape, stream: bool) -> Response:
    """Run `gen` and answer as JSON, or as SSE with prefill-progress comments before the first token."""
    model = st.settings.served_model_name
    rid = gen.rid
    try:
        if not stream:
            task = asyncio.create_task(gen.collect())
            disc = asyncio.create_task(_wait_disconnect(request))
            await asyncio.wait({task, disc}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client hung up: cancelling aborts the engine request
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                st.metrics.requests.labels(_endpoint(shape), "499").inc()
                return Response(status_code=499)
            disc.cancel()
            done = task.result()
            st.metrics.requests.labels(_endpoint(shape), "200").inc()
            return JSONResponse(_final(st, rid, model, done, shape))
        events = gen.events(keepalive=True)
        try:
            first = await events.__anext__()  # errors the engine reports at once become real statuses
        except BaseException:
            await events.aclose()
            raise
        return fmt.SSEResponse(_stream(st, rid, model, shape, first, events))
    except ApiError as e:
        st.metrics.requests.labels(_endpoint(shape), str(e.status)).inc()
        raise


def _endpoint(shape: Shape) -> str:
    return "chat" if shape.chat else "completions"


def _final(st: ServerState, rid: str, model: str, done: Done, shape: Shape) -> dict[str, Any]:
    if shape.chat:
        lp = (
            fmt.chat_logprobs(st.codec, done.logprobs, shape.logprobs or 0)
            if shape.logprobs is not None
            else None
        )
        return fmt.chat_completion(rid, model, done.text, done.finish_reason, done.usage(), lp)
    lp = fmt.completion_logprobs(st.codec, done.logprobs) if shape.logprobs is not None else None
    return fmt.completion(rid, model, done.text, done.finish_reason, done.usage(), lp)


async def _stream(
    st: ServerState, rid: str, model: str, shape: Shape, first: Any, events: AsyncGenerator[Any, None]
) -> AsyncIterator[str]:
    sent_role = False
    status = "200"
    text_pos = 0

    async def all_events() -> AsyncIterator[Any]:
        yield first
        async for ev in events:
            yield ev

    try:
        async for ev in all_events():
            if isinstance(ev, Progress):
                yield fmt.sse_comment(f"prefill {ev.done}/{ev.total}")
                continue
            if isinstance(ev, Keepalive):
                yield fmt.sse_comment("keepalive")
                continue
            if shape.chat and not sent_role:
                sent_role = True
                yield fmt.sse(fmt.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            if isinstance(ev, Delta):
                if not ev.text and shape.logprobs is None:
                    continue
                if shape.chat:
                    lp = (
                        fmt.chat_logprobs(st.codec, ev.logprobs, shape.logprobs or 0)
                        if shape.logprobs is not None
                        else None
                    )
                    yield fmt.sse(fmt.chat_chunk(rid, model, {"content": ev.text}, None, lp))
                else:
                    lp = (
                        fmt.completion_logprobs(st.codec, ev.logprobs, text_pos)
                        if shape.logprobs is not None
                        else None
                    )
                    yield fmt.sse(fmt.completion_chunk(rid, model, ev.text, None, lp))
                text_pos += len(ev.text)
            elif isinstance(ev, Done):
                if shape.chat:
                    yield fmt.sse(fmt.chat_chunk(rid, model, {}, ev.finish_reason))
                    if shape.include_usage:
                        yield fmt.sse(fmt.chat_chunk(rid, model, {}, None, usage=ev.usage(), empty=True))
                else:
                    yield fmt.sse(fmt.completion_chunk(rid, model, "", ev.finish_reason))
                    if shape.include_usage:
                        yield fmt.sse(
                            fmt.completion_chunk(rid, model, "", None, usage=ev.usage(), empty=True)
                        )
        yield fmt.SSE_DONE
    except ApiError as e:
        status = str(e.status)
        yield fmt.sse(error_body(e.message, e.type, e.param, e.code))
        yield fmt.SSE_DONE
    except (asyncio.CancelledError, GeneratorExit):
        status = "499"
        raise
    finally:
        await events.aclose()  # aborts the engine request if it has not finished
        st.metrics.requests.labels(_endpoint(shape), status).inc()


# ---- routes -------------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st = get_state(request)
    req = await read_json(request, CompletionRequest)
    st.check_model(req.model)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        ids = await st.encode(prompt, add_special_tokens=True)
    else:
        vocab = st.ready.vocab_size
        if vocab and any(not (0 <= t < vocab) for t in prompt):
            raise ApiError(
                400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value"
            )
        ids = list(prompt)
    params = sampling(st, req, len(ids), req.max_tokens, req.logprobs)
    st.check_admission()
    gen = Generation(st.client, st.codec, st.metrics, new_rid("cmpl"), ids, params, req.stop_list())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await serve(request, st, gen, Shape(False, req.logprobs, include_usage), req.stream)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = get_state(request)
    req = await read_json(request, ChatCompletionRequest)
    st.check_model(req.model)
    # OpenAI's "developer" role is its newer name for "system"
    msgs = [
        {"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
        | ({"name": msg.name} if msg.name else {})
        for msg in req.messages
    ]
    try:
        text = st.codec.render_chat(msgs, add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    ids = await prompt_ids_with_documents(st, text)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling(st, req, len(ids), req.limit(), logprobs)
    st.check_admission()
    gen = Generation(st.client, st.codec, st.metrics, new_rid("chatcmpl"), ids, params, req.stop_list())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await serve(request, st, gen, Shape(True, logprobs, include_usage), req.stream)


async def prompt_ids_with_documents(st: ServerState, text: str) -> list[int]:
    """Tokenise a rendered prompt; one that starts with a pinned document reuses its exact tokens.

    Tokenising the whole text could merge tokens across the document's end, so the prompt would
    diverge from the cached pages a few tokens early; splitting at the document keeps every page.
    """
    matches = [d for d in st.documents.values() if text.startswith(d.prefix_text)]
    best = max(matches, key=lambda d: len(d.prefix_text), default=None)
    if best is None:
        return await st.encode(text)
    return best.ids + await st.encode(text[len(best.prefix_text) :])
