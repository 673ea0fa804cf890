"""`/v1/completions` and `/v1/chat/completions`, plus the serving core the document routes reuse."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from longctx.server import messages as m
from longctx.server import openai_format as fmt
from longctx.server import tools
from longctx.server.generation import Delta, Done, Generation, Keepalive, Progress, new_rid
from longctx.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingFields,
    error_body,
)
from longctx.server.reasoning import ReasoningStream, opens_in_thought, split_reasoning
from longctx.server.state import ServerState, get_state, read_json
from longctx.server.tools import GLM as GLM_CALLS
from longctx.server.tools import ToolFormat

router = APIRouter()


@dataclass(frozen=True)
class Shape:
    """How to format one generation: a completion or a chat completion, with which logprobs."""

    chat: bool
    logprobs: int | None  # None: no logprobs; N: top-N alternatives
    include_usage: bool
    n: int = 1  # choices per prompt (generation i is prompt i // n's choice i % n)
    echo: bool = False  # completions: each choice starts with its prompt (and its logprobs, when asked)
    continuous_usage: bool = False  # vLLM's: every streamed chunk carries its choice's usage so far
    prompt_logprobs: int | None = None  # vLLM's: each choice carries its prompt's logprobs, top-N
    # chat: a named tool_choice, "required" or "auto" (the output read for calls), else None; with "auto" the
    # request's tools (their schemas type its arguments) and the format its calls are read in
    # (--tool-call-parser)
    tool_choice: Any = None
    tools: Any = None
    tool_format: ToolFormat = GLM_CALLS  # (`tools` here is the field above, not the module)
    parallel_tool_calls: bool = True  # ("auto": False keeps the first call)
    # chat with a --reasoning-parser and no guide: <think> blocks to reasoning_content ("start"; "thought":
    # the prompt leaves a <think> open, so the output starts inside it); None: not read
    reasoning: str | None = None

    @classmethod
    def of(cls, req: _SamplingFields, chat: bool, logprobs: int | None, echo: bool = False) -> Shape:
        so = req.stream_options
        usage = bool(so and so.include_usage)
        return cls(
            chat,
            logprobs,
            usage,
            req.n,
            echo,
            usage and bool(so and so.continuous_usage_stats),
            getattr(req, "prompt_logprobs", None),
        )


def with_prompt_logprobs(params: m.WireSamplingParams, *wants: int | None) -> m.WireSamplingParams:
    """params asking the engine for the prompt's logprobs with the widest top-N of `wants` (echo's
    logprobs, vLLM's prompt_logprobs; None: not asked), or params as they are when none asks."""
    asked = [w for w in wants if w is not None]
    return dataclasses.replace(params, prompt_logprobs=max(asked)) if asked else params


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
            param="messages" if hasattr(req, "messages") else "prompt",
            code="context_length_exceeded",
        )
    room = max_ctx - prompt_len
    dflt = st.sampling_defaults  # (generation_config.json's, for the fields the request leaves out)
    if limit is None:
        limit = dflt.get("max_new_tokens")
    max_new = room if limit is None else min(limit, room)
    if req.min_tokens > max_new:
        raise ApiError(
            400,
            f"min_tokens ({req.min_tokens}) is more than the tokens this request may generate ({max_new})",
            param="min_tokens",
        )
    return m.WireSamplingParams(
        max_new_tokens=max_new,
        temperature=float(dflt.get("temperature", 1.0) if req.temperature is None else req.temperature),
        top_p=float(dflt.get("top_p", 1.0) if req.top_p is None else req.top_p),
        top_k=max(0, dflt.get("top_k", 0) if req.top_k is None else req.top_k),
        seed=None if req.seed == -1 else req.seed,  # (-1: no seed)
        stop=tuple(req.stop_list()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(
            dflt.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty
        ),
        min_tokens=req.min_tokens,
        min_p=float(dflt.get("min_p", 0.0) if req.min_p is None else req.min_p),
        logit_bias=req.bias_pairs(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        allowed_token_ids=tuple(req.allowed_token_ids or ()),
        bad_words=tuple(req.bad_words or ()),
        guided=req.guided(),
        priority=req.priority,
    )


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, aw: Any) -> tuple[bool, Any]:
    """(True, its result) of awaiting `aw`; (False, None) if the client hung up first, after
    cancelling it (which aborts its engine requests)."""
    task = asyncio.ensure_future(aw)
    disc = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({task, disc}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disc.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False, None
    return True, task.result()


def generations(
    st: ServerState,
    rid: str,
    prompts: list[tuple[list[int], m.WireSamplingParams]],
    stop: list[str],
    n: int,
) -> list[Generation]:
    """A request's prompts' `n` choices each as engine requests, prompt p's choice j at index p * n + j
    (`rid`-index when there are several; a seeded request's choice j draws with seed + j, so the choices
    differ and each is reproducible), after the admission check. Choices 1..n-1 of a prompt start once
    its choice 0 is prefilled, so they take its pages from the prefix cache instead of prefilling it n
    times."""
    total = len(prompts) * n
    if total > st.settings.max_queue:  # (it would never fit: not a 429 to retry)
        what = f"n={n}" if len(prompts) == 1 else f"{len(prompts)} prompts x n={n}"
        raise ApiError(
            400,
            f"{what} is more than this server's queue limit ({st.settings.max_queue})",
            param="n" if len(prompts) == 1 else "prompt",
        )
    st.check_admission(total)
    gens: list[Generation] = []
    for ids, params in prompts:
        first = len(gens)
        for j in range(n):
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            if j:  # (choice 0 computes the prompt's logprobs for all of them)
                seeded = dataclasses.replace(seeded, prompt_logprobs=None)
            name = rid if total == 1 else f"{rid}-{len(gens)}"
            gens.append(Generation(st.client, st.codec, st.metrics, name, ids, seeded, stop))
            if j:
                gens[-1].after = gens[first].prefilled
                gens[-1].prompt_logprobs = gens[first].prompt_logprobs  # (the same list, filled by choice 0)
    return gens


async def serve(
    request: Request, st: ServerState, rid: str, gens: list[Generation], shape: Shape, stream: bool
) -> Response:
    """Run the request's generations (its n choices) and answer as JSON, or as SSE with
    prefill-progress comments before the first token."""
    model = st.settings.served_model_name
    try:
        if not stream:
            finished, dones = await unless_disconnected(request, _collect(gens))
            if not finished:
                st.metrics.requests.labels(_endpoint(shape), "499").inc()
                return Response(status_code=499)
            st.metrics.requests.labels(_endpoint(shape), "200").inc()
            return JSONResponse(_final(st, rid, model, gens, dones, shape))
        events = _events(gens)
        try:
            first = await events.__anext__()  # errors the engine reports at once become real statuses
        except BaseException:
            await events.aclose()
            raise
        return fmt.SSEResponse(_stream(st, rid, model, shape, first, events, gens))
    except ApiError as e:
        st.metrics.requests.labels(_endpoint(shape), str(e.status)).inc()
        raise


async def _collect(gens: list[Generation]) -> list[Done]:
    """Every choice run to completion; one failing (or this being cancelled) cancels the others,
    which aborts their engine requests."""
    if len(gens) == 1:
        return [await gens[0].collect()]
    tasks = [asyncio.create_task(g.collect()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


async def _events(gens: list[Generation]) -> AsyncGenerator[tuple[int, Any], None]:
    """(choice index, event) of every generation as they come; closing this closes them all (which
    aborts the unfinished engine requests). An error in any one ends the whole stream with it."""
    if len(gens) == 1:
        one = gens[0].events(keepalive=True)
        try:
            async for ev in one:
                yield 0, ev
        finally:
            await one.aclose()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    streams = [g.events(keepalive=True) for g in gens]

    async def pump(i: int, s: AsyncGenerator[Any, None]) -> None:
        try:
            async for ev in s:
                queue.put_nowait((i, ev))
            queue.put_nowait((i, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # (an ApiError of this choice: the stream ends with it)
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(gens)
    try:
        while live:
            i, ev = await queue.get()
            if ev is _END:
                live -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


def _endpoint(shape: Shape) -> str:
    return "chat" if shape.chat else "completions"


def _usage(dones: list[Done], n: int) -> dict[str, Any]:
    """Each prompt once (its first choice's prompt and cached tokens), every choice's completion tokens."""
    firsts = dones[::n]
    u = _usage_counts(sum(d.prompt_tokens for d in firsts), sum(d.completion_tokens for d in dones))
    return {**u, "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)}}


def _usage_counts(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _final(
    st: ServerState, rid: str, model: str, gens: list[Generation], dones: list[Done], shape: Shape
) -> dict[str, Any]:
    choices: list[fmt.Choice] = []
    for g, d in zip(gens, dones):
        if shape.echo:
            lp = None if shape.logprobs is None else _echo_logprobs(st, g, d.logprobs, shape.logprobs)
            choices.append((g.echo_text + d.text, d.finish_reason, lp))
        else:
            choices.append((d.text, d.finish_reason, _logprobs(st, shape, d.logprobs)))
    out = (fmt.chat_completion if shape.chat else fmt.completion)(rid, model, choices, _usage(dones, shape.n))
    for choice, d in zip(out["choices"], dones) if shape.chat else ():
        thought, text = (None, d.text)
        if shape.reasoning:
            thought, text = split_reasoning(d.text, shape.reasoning == "thought")
        if shape.tool_choice is not None:  # the output read as tool calls
            choice["message"], choice["finish_reason"] = tools.tool_message(
                shape.tool_choice,
                text,
                d.finish_reason,
                shape.tools,
                shape.parallel_tool_calls,
                shape.tool_format,
            )
        else:
            choice["message"]["content"] = text
        if thought is not None:
            choice["message"]["reasoning_content"] = thought
    if shape.prompt_logprobs is not None:
        for choice, g in zip(out["choices"], gens):
            choice["prompt_logprobs"] = fmt.prompt_logprobs(
                st.codec, g.prompt_logprobs, shape.prompt_logprobs
            )
    return out


def _echo_logprobs(st: ServerState, g: Generation, lps: list[m.WireLogprob], top_n: int) -> dict[str, Any]:
    """Completions logprobs of the prompt (its first token has none: null) followed by `lps`; the prompt's
    alternatives cut to `top_n` (the engine computed as many as the widest of echo's and prompt_logprobs')."""
    first = m.WireLogprob(g.prompt_ids[0], 0.0)
    prompt = [
        lp if len(lp.top) <= top_n else dataclasses.replace(lp, top=lp.top[:top_n])
        for lp in g.prompt_logprobs
    ]
    out = fmt.completion_logprobs(st.codec, [first, *prompt, *lps])
    out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def _logprobs(st: ServerState, shape: Shape, lps: list[m.WireLogprob], text_pos: int = 0) -> Any:
    """A choice's logprobs in its endpoint's shape (completions: offsets from `text_pos`), or None
    when the request asked for none."""
    if shape.logprobs is None:
        return None
    if shape.chat:
        return fmt.chat_logprobs(st.codec, lps, shape.logprobs)
    return fmt.completion_logprobs(st.codec, lps, text_pos)


async def _stream(
    st: ServerState,
    rid: str,
    model: str,
    shape: Shape,
    first: tuple[int, Any],
    events: AsyncGenerator[tuple[int, Any], None],
    gens: list[Generation],
) -> AsyncIterator[str]:
    n = len(gens)
    sent_role = [False] * n
    echoed = [not shape.echo] * n
    ntok = [0] * n  # each choice's tokens so far (continuous usage)
    text_pos = [0] * n
    dones: list[Done | None] = [None] * n
    calls = (
        None
        if shape.tool_choice is None
        else [
            tools.ToolStream(shape.tool_choice, shape.tools, shape.parallel_tool_calls, shape.tool_format)
            for _ in gens
        ]
    )
    thinking = (
        None if shape.reasoning is None else [ReasoningStream(shape.reasoning == "thought") for _ in gens]
    )
    status = "200"

    async def all_events() -> AsyncIterator[tuple[int, Any]]:
        yield first
        async for ev in events:
            yield ev

    try:
        async for i, ev in all_events():
            if isinstance(ev, Progress):
                if i % shape.n == 0:  # (a prompt's choices prefill it once)
                    which = f" (prompt {i // shape.n})" if n > shape.n else ""
                    yield fmt.sse_comment(f"prefill {ev.done}/{ev.total}{which}")
                continue
            if isinstance(ev, Keepalive):
                yield fmt.sse_comment("keepalive")
                continue
            if isinstance(ev, Delta):
                ntok[i] += len(ev.token_ids)
            u = _usage_counts(len(gens[i].prompt_ids), ntok[i]) if shape.continuous_usage else None
            if shape.chat and not sent_role[i]:
                sent_role[i] = True
                role = {"role": "assistant", "content": ""}
                yield fmt.sse(fmt.chat_chunk(rid, model, role, None, usage=u, index=i))
            if not echoed[i]:  # (the prompt's logprobs are all in by its first token, or its end)
                echoed[i] = True
                g = gens[i]
                lp = None if shape.logprobs is None else _echo_logprobs(st, g, [], shape.logprobs)
                yield fmt.sse(fmt.completion_chunk(rid, model, g.echo_text, None, lp, usage=u, index=i))
                text_pos[i] = len(g.echo_text)
            if isinstance(ev, Delta):
                if not ev.text and shape.logprobs is None:
                    continue
                lp = _logprobs(st, shape, ev.logprobs, text_pos[i])
                if shape.chat:  # (its reasoning, then its content or the tool calls read from it)
                    delta = _chat_delta(
                        ev.text, calls[i] if calls else None, thinking[i] if thinking else None
                    )
                    if delta or lp is not None:  # (a token with no text of its own yet: its logprobs)
                        delta = delta or ({} if calls else {"content": ""})
                        yield fmt.sse(fmt.chat_chunk(rid, model, delta, None, lp, usage=u, index=i))
                else:
                    yield fmt.sse(fmt.completion_chunk(rid, model, ev.text, None, lp, usage=u, index=i))
                text_pos[i] += len(ev.text)
            elif isinstance(ev, Done):
                dones[i] = ev
                if shape.chat:  # (what the reasoning and tool streams held back, then the finish)
                    delta = _chat_delta(
                        "", calls[i] if calls else None, thinking[i] if thinking else None, True
                    )
                    finish: str | None = ev.finish_reason
                    if calls is not None:
                        last, finish = calls[i].end(finish)
                        _join_delta(delta, last)
                    if delta:
                        yield fmt.sse(fmt.chat_chunk(rid, model, delta, None, usage=u, index=i))
                    yield fmt.sse(fmt.chat_chunk(rid, model, {}, finish, usage=u, index=i))
                else:
                    yield fmt.sse(fmt.completion_chunk(rid, model, "", ev.finish_reason, usage=u, index=i))
        if shape.include_usage and all(d is not None for d in dones):
            usage = _usage([d for d in dones if d is not None], shape.n)
            if shape.chat:
                yield fmt.sse(fmt.chat_chunk(rid, model, {}, None, usage=usage, empty=True))
            else:
                yield fmt.sse(fmt.completion_chunk(rid, model, "", None, usage=usage, empty=True))
        yield fmt.SSE_DONE
    except ApiError as e:
        status = str(e.status)
        yield fmt.sse(error_body(e.message, e.type, e.param, e.code))
        yield fmt.SSE_DONE
    except (asyncio.CancelledError, GeneratorExit):
        status = "499"
        raise
    finally:
        await events.aclose()  # aborts the engine requests that have not finished
        st.metrics.requests.labels(_endpoint(shape), status).inc()


# ---- routes -------------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st = get_state(request)
    req = await read_json(request, CompletionRequest)
    st.check_model(req.model)
    prompts, texts = [], []
    for prompt in req.prompt_list():
        if isinstance(prompt, str):
            ids = await st.encode(prompt, add_special_tokens=True, fits=req.truncate_prompt_tokens is None)
        else:
            ids = _in_vocab(st, prompt, "prompt", "prompt token ids")
        whole = len(ids)
        ids = req.truncated(ids, st.max_context)
        params = sampling(st, req, len(ids), req.max_tokens, req.logprobs)
        # (the prompt's own logprobs: echo's, with logprobs' top-N, and / or vLLM's prompt_logprobs)
        params = with_prompt_logprobs(params, req.logprobs if req.echo else None, req.prompt_logprobs)
        prompts.append((ids, params))
        texts.append(prompt if isinstance(prompt, str) and len(ids) == whole else st.codec.decode(ids))
    rid = new_rid("cmpl")
    gens = generations(st, rid, prompts, req.stop_list(), req.n)
    for i, g in enumerate(gens):
        g.echo_text = texts[i // req.n] if req.echo else ""
    shape = Shape.of(req, False, req.logprobs, req.echo)
    return await serve(request, st, rid, gens, shape, req.stream)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = get_state(request)
    req = await read_json(request, ChatCompletionRequest)
    st.check_model(req.model)
    text = chat_text(
        st,
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.tools,
        req.chat_template_kwargs,
    )
    ids = await prompt_ids_with_documents(st, text, fits=req.truncate_prompt_tokens is None)
    ids = req.truncated(ids, st.max_context)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = with_prompt_logprobs(sampling(st, req, len(ids), req.limit(), logprobs), req.prompt_logprobs)
    rid = new_rid("chatcmpl")
    gens = generations(st, rid, [(ids, params)], req.stop_list(), req.n)
    shape = Shape.of(req, True, logprobs)
    if req.calls_tools():
        shape = dataclasses.replace(shape, tool_choice=req.tool_choice)
    elif req.may_call_tools():
        shape = dataclasses.replace(
            shape,
            tool_choice="auto",
            tools=req.tools,
            parallel_tool_calls=req.parallel_tool_calls,
            tool_format=tools.FORMATS[st.settings.tool_call_parser],
        )
    return await serve(request, st, rid, gens, with_reasoning(st, shape, params, text), req.stream)


def with_reasoning(st: ServerState, shape: Shape, params: m.WireSamplingParams, prompt: str) -> Shape:
    """`shape` reading <think> blocks into reasoning_content (`--reasoning-parser`; from the output's start
    when `prompt` leaves one open), unless the request is guided (a guide's output has no thinking)."""
    if st.settings.reasoning_parser == "none" or params.guided:
        return shape
    return dataclasses.replace(shape, reasoning="thought" if opens_in_thought(prompt) else "start")


def _chat_delta(
    text: str, calls: tools.ToolStream | None, thinking: ReasoningStream | None, end: bool = False
) -> dict[str, Any]:
    """A chat chunk's delta for `text`: its reasoning part, then its content, read for tool calls where the
    request has tools (`end`: the output is over; ending the tool stream is the caller's)."""
    thought, content = thinking.delta(text, end) if thinking is not None else ("", text)
    delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
    if calls is not None:
        _join_delta(delta, calls.delta(content) if content else None)
    elif content:
        delta["content"] = content
    return delta


def _join_delta(delta: dict[str, Any], more: dict[str, Any] | None) -> None:
    """`more`'s content appended to `delta`'s, its tool calls after `delta`'s (other keys: `more`'s)."""
    for key, v in (more or {}).items():
        if key == "content":
            delta[key] = delta.get(key, "") + v
        elif key == "tool_calls":
            delta[key] = delta.get(key, []) + v
        else:
            delta[key] = v


def chat_text(
    st: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The chat template's text for `messages` (OpenAI's "developer" role is its newer name for "system"), with
    `tools` as the template's `tools` and each message's tool calls / call id, as transformers passes them."""
    msgs = [
        {"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
        | ({"name": msg.name} if msg.name else {})
        | ({"tool_calls": msg.tool_calls} if msg.tool_calls else {})
        | ({"tool_call_id": msg.tool_call_id} if msg.tool_call_id else {})
        for msg in messages
    ]
    try:
        return st.codec.render_chat(
            msgs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools or None,
            template_kwargs=template_kwargs,
        )
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: a prompt's or a chat's token ids as a request would send them to the engine, with
    their count and the context limit, so a client can tell whether a long document fits first."""
    st = get_state(request)
    req = await read_json(request, TokenizeRequest)
    st.check_model(req.model)
    if req.messages is not None:
        text = chat_text(
            st,
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            None,
            req.chat_template_kwargs,
        )
        ids = await prompt_ids_with_documents(st, text)
    else:
        assert req.prompt is not None
        ids = await st.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": st.max_context, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's /detokenize: token ids -> text."""
    st = get_state(request)
    req = await read_json(request, DetokenizeRequest)
    st.check_model(req.model)
    return {"prompt": st.codec.decode(_in_vocab(st, req.tokens, "tokens", "token ids"))}


def _in_vocab(st: ServerState, ids: list[int], param: str, what: str) -> list[int]:
    """`ids` when every one is a token id of the served model's vocabulary, else a 400 naming `param`."""
    vocab = st.ready.vocab_size
    if vocab and any(not (0 <= t < vocab) for t in ids):
        raise ApiError(400, f"{what} must be in [0, {vocab})", param=param, code="invalid_value")
    return list(ids)


async def prompt_ids_with_documents(st: ServerState, text: str, fits: bool = True) -> list[int]:
    """Tokenise a rendered prompt; one that starts with a pinned document reuses its exact tokens.

    Tokenising the whole text could merge tokens across the document's end, so the prompt would
    diverge from the cached pages a few tokens early; splitting at the document keeps every page.
    """
    matches = [d for d in st.documents.values() if text.startswith(d.prefix_text)]
    best = max(matches, key=lambda d: len(d.prefix_text), default=None)
    if best is None:
        return await st.encode(text, param="messages", fits=fits)
    return best.ids + await st.encode(text[len(best.prefix_text) :], param="messages", fits=fits)
