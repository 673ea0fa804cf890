"""OpenAI-compatible request schemas and error bodies.

Validation is strict about types (no "5" for 5, no true for 1.0) and ranges; unknown fields are
ignored so newer clients still work, except the known ones that ask for output longctx does not make
(tool calls on completions, grammar-guided decoding, beam search and logits processors): those are refused,
naming the field, since ignoring them would hand back text the client did not ask for. Chat tool calls are
served by name, "required" (guides) and "auto" (GLM's format read back, `longctx.server.tools`). JSON mode, JSON schemas and
vLLM's regex / choice / json guides are served (`_SamplingFields.guided`, `longctx.engine.guided`).
Every rejection is an `ApiError`, rendered as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from longctx.engine.guided import guide_of, guide_regex
from longctx.engine.request import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY
from longctx.errors import RequestError, clipped
from longctx.server.tools import MAX_TOOLS, parameters_of, tool_guide

I64 = 2**63 - 1
MAX_STOPS = 16
MAX_N = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each its own n choices)
# Retry-After on the statuses a client should send again (429: the queue is full; 503: the server is
# shutting down or has no engine). The server cannot tell how long a queue slot or a restart takes, so
# this is only the least wait; clients back off further on repeated refusals.
RETRY_AFTER_S = 1
RETRYABLE = frozenset({429, 503})


class ApiError(Exception):
    """An error the client sees as an HTTP status + OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code),
            status_code=self.status,
            headers=retry_headers(self.status),
        )


def retry_headers(status: int) -> dict[str, str]:
    """A Retry-After header for a status the client should retry, else none."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in RETRYABLE else {}


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def engine_error(message: str, code: str | None, param: str | None = None) -> ApiError:
    """An error the engine answered a request (or a call) with. One with a code is the request's fault,
    found by the engine's own checks (token ids against the vocabulary, ...): a 400 with that code and
    field (a full queue: a 429 to retry). One without is the engine's: a 500."""
    if code is None:
        return ApiError(500, message, "server_error")
    if code == "queue_full":
        return ApiError(429, message, "rate_limit_error", code=code)
    return ApiError(400, message, param=param, code=code)


# How pydantic names the member of a union that an error belongs to, in the error's location
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\]|constrained-\w+)$")


def _wanted(member: str, depth: int) -> str:
    """What a union member wants `depth` list items into the value (list[list[int]] at prompt.0: list[int])."""
    for _ in range(depth):
        member = member.removeprefix("list[").removesuffix("]")
    return re.sub(r"constrained-(\w+)", r"\1", member)


def validation_error(e: ValidationError | Any) -> ApiError:
    """First pydantic error -> ApiError(400) naming the offending field. A union field's error is the
    first error of its member that got furthest (`prompt: ["a", 3]` -> "prompt.1: Input should be a valid
    string", not the str member's complaint), or, when several got as far, what they wanted there:
    `prompt: 5` -> "prompt: expected one of str, list[int], list[str], list[list[int]]",
    `prompt: [true]` -> "prompt.0: expected one of int, str, list[int]"."""
    errs = e.errors() if hasattr(e, "errors") else []
    if not errs:
        return ApiError(400, "invalid request")

    def loc(err: Any) -> list[Any]:
        return [x for x in err.get("loc", ()) if x != "body"]

    def tag_at(where: list[Any]) -> int | None:
        return next((i for i, x in enumerate(where) if isinstance(x, str) and _UNION_TAG.match(x)), None)

    def plain(err: Any) -> list[Any]:  # the location without union member tags
        return [x for x in loc(err) if not (isinstance(x, str) and _UNION_TAG.match(x))]

    err = errs[0]
    msg = str(err.get("msg", "invalid value"))
    path = loc(err)
    ti = tag_at(path)
    if ti is not None:
        # a union: one error per member, side by side (a dict key that only looks like a member is not one)
        firsts: dict[str, Any] = {}  # each member's first error: where it stopped
        for x in errs:
            if loc(x)[:ti] == path[:ti] and tag_at(loc(x)) == ti:
                firsts.setdefault(loc(x)[ti], x)
        reach = {m: (len(loc(x)), [i for i in loc(x) if isinstance(i, int)]) for m, x in firsts.items()}
        furthest = [m for m, r in reach.items() if r == max(reach.values())]
        if len(firsts) > 1:
            err = firsts[furthest[0]]
            msg = str(err.get("msg", "invalid value"))
            path = plain(err)
        if len(furthest) > 1:  # as far as each other: what each wanted there
            depth = sum(isinstance(i, int) for i in path[ti:])
            msg = "expected one of " + ", ".join(dict.fromkeys(_wanted(m, depth) for m in furthest))
    param = ".".join(str(x) for x in path) or None
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


Float = Annotated[float, Field(allow_inf_nan=False)]
StopT = str | list[Annotated[str, Field(min_length=1)]] | None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's) with include_usage: usage in every chunk too


def _guide(keyed: bool, regex: Any, choice: Any, json_schema: Any, json_object: bool = False) -> None:
    """guide_of's checks of one guide's shape, as the ValueError a field validator raises (`keyed`: the
    guide is a key of the field's object, which the message names)."""
    try:
        guide_of(regex, choice, json_schema, json_object, ("regex", "choice", "json", "json_object"))
    except RequestError as e:
        raise ValueError(str(e) if keyed else e.problem) from None


class _SamplingFields(_Strict):
    """Fields shared by every generating endpoint."""

    TOOLS_SERVED: ClassVar[bool] = False  # (tool calls are a chat completion's)

    model: str | None = None
    temperature: Float | None = Field(None, ge=0.0, le=100.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # -1 and 0 both mean "off"
    # -1 is no seed (vLLM's rule, and clients that always send a seed send it); other negative seeds are
    # refused: the engine's generators take a seed modulo 2**63, so each would draw what seed + 2**63 does
    seed: int | None = Field(None, ge=-1, le=I64)
    # vLLM's: under serve --scheduling-policy priority, lower is served earlier (ties by arrival); the
    # default fcfs policy refuses anything but 0
    priority: int = Field(0, ge=-I64 - 1, le=I64)
    stop: StopT = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(
        1, ge=1, le=MAX_N
    )  # choices: n engine requests of one prompt (its pages shared once cached)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    # (vLLM's extension; over the prompt's and the generated tokens, 1 = off)
    repetition_penalty: Float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's extensions: no EOS / stop token / stop string before min_tokens; stop_token_ids end the
    # generation like EOS; min_p drops tokens under min_p x the likeliest one's probability
    min_tokens: int = Field(0, ge=0, le=I64)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=I64)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # OpenAI's: token id (as a string) -> bias in [-100, 100], added to the logits
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    # vLLM's: the text keeps the stop string that ended it; only these tokens are drawn
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=I64)]] | None = Field(
        None, min_length=1, max_length=MAX_LOGIT_BIAS
    )
    # vLLM's: words never generated
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_BAD_WORDS)

    # Guides (`guided`): OpenAI's response_format, vLLM's guided_* and structured_outputs. Known fields
    # asking for output longctx does not make: refused (a 400 naming the field), not ignored. What leaves
    # the output unchanged passes: tools the model may not call (tool_choice "none"), an empty tools /
    # functions list.
    response_format: Any = None
    tool_choice: Any = None  # (before tools: their check reads it)
    tools: Any = Field(None, validate_default=True)
    function_call: Any = None
    functions: Any = Field(None, validate_default=True)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False  # (vLLM's: only false passes)
    logits_processors: Any = None
    # vLLM's: the prompt cut to its last k tokens (-1: to the context limit) instead of refused as too long
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=I64)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any) -> Any:
        kind = v.get("type") if isinstance(v, dict) else None
        if v is not None and kind not in ("text", "json_object", "json_schema"):
            raise ValueError('type must be "text", "json_object" or "json_schema"')
        if kind == "json_schema":
            js = v.get("json_schema")
            if not (isinstance(js, dict) and isinstance(js.get("schema"), dict | bool)):
                raise ValueError('"json_schema" needs {"json_schema": {"schema": {...}}}')
        return v

    @field_validator("guided_grammar")
    @classmethod
    def _no_grammar(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("grammar-guided decoding is not supported (regex, choice and json guides are)")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, dict):
            raise ValueError("must be an object")
        for key in ("grammar", "structural_tag"):
            if v.get(key) is not None:
                raise ValueError(f"{key} is not supported (regex, choice, json and json_object are)")
        _guide(True, v.get("regex"), v.get("choice"), v.get("json"), bool(v.get("json_object")))
        return v

    @field_validator("guided_regex", "guided_choice", "guided_json")
    @classmethod
    def _guide_shape(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            k = ("guided_regex", "guided_choice", "guided_json").index(info.field_name or "")
            regex, choice, schema = (v if i == k else None for i in range(3))
            _guide(False, regex, choice, schema)
        return v

    def guided(self) -> tuple[str, ...]:
        """SamplingParams.guided of the request's guide: vLLM's guided_regex / guided_choice / guided_json,
        its structured_outputs ({"regex" | "choice" | "json" | "json_object": ...}) or OpenAI's
        response_format ("json_object", or "json_schema" with its "schema"); () for none. Each field's shape
        is checked by its validator and that at most one guide is given by `_one_guide`."""
        if self.calls_tools():
            return tool_guide(self.tools, self.tool_choice, getattr(self, "parallel_tool_calls", True))
        rf = self.response_format
        if isinstance(rf, dict) and rf.get("type") == "json_object":
            return ("json_object", "")
        if isinstance(rf, dict) and rf.get("type") == "json_schema":
            return guide_of(json_schema=rf["json_schema"]["schema"])
        so = self.structured_outputs
        if so:
            return guide_of(so.get("regex"), so.get("choice"), so.get("json"), bool(so.get("json_object")))
        return guide_of(self.guided_regex, self.guided_choice, self.guided_json)

    def calls_tools(self) -> bool:
        """Whether the output is tool calls (a named tool_choice or "required", with tools)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def may_call_tools(self) -> bool:
        """Whether the output is text or tool calls as the model chooses (tool_choice "auto", with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @model_validator(mode="after")
    def _one_guide(self) -> _SamplingFields:
        rf = self.response_format
        given = [
            name
            for name, v in (
                ("tool_choice", self.tool_choice if self.calls_tools() else None),
                ("response_format", rf if isinstance(rf, dict) and rf.get("type") != "text" else None),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_json", self.guided_json),
                ("structured_outputs", self.structured_outputs or None),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: cannot be combined with {given[0]} (at most one guide)")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
        if v in (None, "none", "auto", "required") or (named and isinstance(v["function"].get("name"), str)):
            return v
        raise ValueError(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    @field_validator("function_call")
    @classmethod
    def _no_forced_call(cls, v: Any) -> Any:
        if v not in (None, "none", "auto"):
            raise ValueError('the legacy function calling is not supported; only "none" is (send tools)')
        return v

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: Any, info: ValidationInfo) -> Any:
        if v and info.data.get("function_call") != "none":  # (OpenAI's default with functions is "auto")
            raise ValueError(
                'the legacy function calling is not supported (send none, or function_call "none")'
            )
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: Any, info: ValidationInfo) -> Any:
        choice = info.data.get("tool_choice")
        if not v:  # (none, or an empty list: nothing to call)
            if choice not in (None, "none", "auto"):
                raise ValueError(f"tool_choice {choice!r} needs tools")
            return v
        if choice == "none":
            return v
        auto = choice in (None, "auto")  # (OpenAI's default with tools is "auto")
        if not cls.TOOLS_SERVED:
            raise ValueError('tool calling is for chat completions (send none, or tool_choice "none")')
        if not isinstance(v, list) or len(v) > MAX_TOOLS:
            raise ValueError(f"must be a list of at most {MAX_TOOLS} tools")
        names: set[str] = set()
        for i, t in enumerate(v):
            f = t.get("function") if isinstance(t, dict) else None
            if not (
                isinstance(t, dict)
                and t.get("type") == "function"
                and isinstance(f, dict)
                and isinstance(f.get("name"), str)
                and f["name"]
            ):
                raise ValueError(
                    f'{i}: must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
                )
            if f["name"] in names:
                raise ValueError(f"{i}: the name {f['name']!r} appears twice")
            names.add(f["name"])
            if not isinstance(f.get("parameters", {}), dict):
                raise ValueError(f"{i}: function.parameters must be a JSON schema (an object)")
            if auto:
                continue  # (nothing compiled: "auto" reads the model's calls back)
            try:  # (a guide's schema checked here, before the engine compiles it: its keywords in longctx's subset)
                guide_regex("json", json.dumps(parameters_of(t)))
            except RequestError as e:
                raise ValueError(f"{i}: function.parameters: {e.problem or e}") from None
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ValueError(
                f"tool_choice names {choice['function']['name']!r}, which is not one of the tools"
            )
        return v

    @field_validator("use_beam_search")
    @classmethod
    def _no_beams(cls, v: bool) -> bool:
        if v:
            raise ValueError("beam search is not supported")
        return v

    @field_validator("logits_processors")
    @classmethod
    def _no_processors(cls, v: Any) -> Any:
        if v:  # (an empty list changes nothing)
            raise ValueError("logits_processors is not supported")
        return v

    @field_validator("bad_words")
    @classmethod
    def _words(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not w.strip() for w in v):
            raise ValueError("bad words must not be blank")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1 for the context limit")
        return v

    def truncated(self, ids: list[int], max_context: int) -> list[int]:
        """The prompt's token ids cut to its last `truncate_prompt_tokens` (-1: the context limit's)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = max_context if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingFields:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} stop strings")
        if isinstance(self.stop, str) and not self.stop:
            raise ValueError("stop: must not be empty")
        self.bias_pairs()  # (keys checked here, so a bad one is a 400 naming the field)
        return self

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as sorted (token id, bias) pairs; a key that is not a token id is a ValueError."""
        out: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            # a token id in ASCII digits (not "²", nor "١٢"), read without int()'s limit of 4300 digits (a
            # longer key was refused in int()'s words, naming no field)
            digits = k.strip()
            digits = digits.lstrip("0") or digits[-1:]
            if not (digits.isascii() and digits.isdigit()) or len(digits) > 19 or int(digits) > I64:
                shown = repr(k) if len(k) <= 40 else clipped(k, 20)
                raise ValueError(f"logit_bias: keys are token ids, got {shown}")
            if int(digits) in out:
                raise ValueError(f"logit_bias: token {int(digits)} appears twice")
            out[int(digits)] = float(v)
        return tuple(sorted(out.items()))

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _PromptLogprobs(_Strict):
    # vLLM's: each prompt token's logprob, rank and top-N alternatives (the first token has none), in
    # every choice as `prompt_logprobs`; not with stream=true (vLLM's rule too)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _not_streamed(self) -> _PromptLogprobs:
        if self.prompt_logprobs is not None and getattr(self, "stream", False):
            raise ValueError("prompt_logprobs: not available with stream=true")
        return self


class CompletionRequest(_SamplingFields, _PromptLogprobs):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=I64)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=I64)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of = n ({self.n}) is supported: every choice is returned")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The request's prompts: a list of strings or of token-id lists is several (a batch), a string
        or one token-id list one."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # an assistant turn's calls and a tool turn's answer to one, for chat templates that render them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# the template's own variables, which chat_template_kwargs may not set
_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "raise_exception")


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's chat_template_kwargs: names of the template's own variables refused, as is a body past 64 KiB."""
    if v is None:
        return v
    taken = sorted(set(v) & set(_TEMPLATE_VARIABLES))
    if taken:
        raise ValueError(f"{taken[0]!r} is set by the request itself, not by chat_template_kwargs")
    if len(json.dumps(v)) > 64 * 1024:
        raise ValueError("must be at most 64 KiB of JSON")
    return v


# vLLM's chat_template_kwargs (chat completions and /tokenize): more variables for the chat template (GLM's
# `enable_thinking`, ...)
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(check_template_kwargs)]


class ChatCompletionRequest(_SamplingFields, _PromptLogprobs):
    TOOLS_SERVED: ClassVar[bool] = True
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=I64)
    max_completion_tokens: int | None = Field(None, ge=0, le=I64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the last message (an answer the client began) left open for the model to go on from
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    # OpenAI's: false allows one tool call at most ("required" is held to one, "auto" keeps the first)
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize body: a `prompt` (completions' tokens) or `messages` (a chat's)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=-(2**63), le=I64)]]


class DocumentCreate(_Strict):
    text: str = Field(min_length=1)
    name: str | None = None


class AskRequest(_SamplingFields):
    question: str = Field(min_length=1)
    max_tokens: int | None = Field(256, ge=0, le=I64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
