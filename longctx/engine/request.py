"""Requests, sampling parameters and the per-step outputs the scheduler reports.

These are plain data: the scheduler, the engine process and the HTTP frontend all speak them
(the frontend through msgpack, see `longctx/server/messages.py`).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from longctx.config import is_int, is_real
from longctx.engine.guided import GuideState, check_guided
from longctx.errors import RequestError

MAX_REPETITION_PENALTY = 100.0
MAX_BAD_WORDS = 64  # a request's bad_words (each is checked against the output's tail every step)
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias (OpenAI's values are in [-100, 100])


def check_priority(value: Any) -> None:
    """A request's priority: an integer (`SamplingParams.priority`; `Engine.generate` takes one per prompt)."""
    if not is_int(value):
        raise RequestError.about("priority", repr(value), "must be an integer")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` disable them."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text (needs a tokenizer)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-N logprobs per generated token (0 = only the chosen one)
    # the same for every prompt token after the first (vLLM's prompt_logprobs; the request skips the prefix
    # cache until they are all out, since a cached position computes no logits)
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # over the prompt's and the generated tokens (CTRL / transformers / vLLM): a positive logit divided
    # by it, a negative one multiplied; 1 = off
    repetition_penalty: float = 1.0
    # the first min_tokens tokens are never an EOS (unless ignore_eos) or a stop token, and no stop string
    # ends within their text (vLLM's min_tokens)
    min_tokens: int = 0
    # a sampled token's probability must be at least min_p times the likeliest one's (after temperature)
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits before anything else, greedy rows included (OpenAI's)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the output text keeps the stop string that ended it (vLLM's include_stop_str_in_output)
    include_stop_str_in_output: bool = False
    # only these tokens are drawn, greedy rows included (vLLM's allowed_token_ids; empty: every token)
    allowed_token_ids: tuple[int, ...] = ()
    # words never generated (vLLM's bad_words): the last token of a word's tokens is never drawn right after
    # the output's last tokens are the rest of them (a one-token word: never drawn)
    bad_words: tuple[str, ...] = ()
    # guided decoding, (kind, spec): the output held to a regex, one of a JSON list of choices, a JSON
    # schema's instances or any JSON object (`longctx.engine.guided`; kinds "regex" / "choice" / "json" /
    # "json_object"); empty: unguided
    guided: tuple[str, ...] = ()
    # when the scheduler serves the request under `scheduling_policy="priority"` (vLLM's priority: lower is
    # earlier, ties by arrival); not a sampling setting, but carried with them end to end. "fcfs" takes 0 only
    priority: int = 0

    def validate(self) -> None:
        """RequestError `about` the first bad field (`min_p 2.0: must be in [0, 1]`; of a wrong type too: a
        bool, a string or a float seed passed here would only fail inside a step, taking the batch's other
        requests with it)."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise RequestError.about(
                "max_new_tokens", repr(self.max_new_tokens), "must be a non-negative integer"
            )
        if not is_real(self.temperature) or self.temperature < 0:
            raise RequestError.about("temperature", repr(self.temperature), "must be a number >= 0")
        if not (is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise RequestError.about("top_p", repr(self.top_p), "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise RequestError.about("top_k", repr(self.top_k), "must be a non-negative integer")
        # (a negative seed drew what seed + 2**63 does; a larger one is taken modulo 2**63, as the HTTP
        # server's seed + choice index may be past its own limit of 2**63 - 1)
        if self.seed is not None and not (is_int(self.seed) and self.seed >= 0):
            raise RequestError.about("seed", repr(self.seed), "must be a non-negative integer")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (is_int(v) and 0 <= v <= 20):
                raise RequestError.about(name, repr(v), "must be between 0 and 20")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (is_real(v) and -2.0 <= v <= 2.0):
                raise RequestError.about(name, repr(v), "must be between -2 and 2")
        rp = self.repetition_penalty
        if not (is_real(rp) and 0.0 < rp <= MAX_REPETITION_PENALTY):
            raise RequestError.about(
                "repetition_penalty", repr(rp), f"must be in (0, {MAX_REPETITION_PENALTY:g}]"
            )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError.about(
                "min_tokens",
                repr(self.min_tokens),
                f"must be an integer between 0 and {{}} ({self.max_new_tokens})",
                "max_new_tokens",
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # ("no" was read as True)
                raise RequestError.about(name, repr(getattr(self, name)), "must be True or False")
        if not (is_real(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise RequestError.about("min_p", repr(self.min_p), "must be in [0, 1]")
        if isinstance(self.stop, str):  # (it was read as one stop string per character)
            raise RequestError.about("stop", repr(self.stop), "must be a list of strings, not one string")
        # (a container of another type failed as a TypeError in add_request, or in the step)
        for name, what in (
            ("stop", "strings"),
            ("stop_token_ids", "token ids"),
            ("logit_bias", "pairs"),
            ("allowed_token_ids", "token ids"),
            ("bad_words", "strings"),
        ):
            v = getattr(self, name)
            if not isinstance(v, tuple | list):
                raise RequestError.about(name, None, f"must be a list of {what}, got {type(v).__name__}")
        for s in self.stop:
            if not isinstance(s, str):
                raise RequestError.about("stop", repr(s), "is not a string")
            if not s:  # (it would end every generation at once, as vLLM refuses it)
                raise RequestError.about("stop", repr(s), "stop strings must not be empty")
        for name, cap in (
            ("logit_bias", MAX_LOGIT_BIAS),
            ("allowed_token_ids", MAX_LOGIT_BIAS),
            ("bad_words", MAX_BAD_WORDS),
        ):
            if len(getattr(self, name)) > cap:
                raise RequestError.about(name, None, f"has {len(getattr(self, name))} entries, at most {cap}")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise RequestError.about("logit_bias", None, f"must be (token id, bias) pairs, got {pair!r}")
            tok, bias = pair
            if not is_int(tok) or tok < 0:
                raise RequestError.about(
                    "logit_bias", None, f"token ids must be non-negative integers, got {tok!r}"
                )
            if not (is_real(bias) and -100.0 <= bias <= 100.0):
                raise RequestError.about(
                    "logit_bias", None, f"token {tok}'s bias must be in [-100, 100], got {bias!r}"
                )
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise RequestError.about("logit_bias", None, "a token appears twice")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise RequestError.about("bad_words", repr(w), "must be a word (a string that is not blank)")
        check_priority(self.priority)
        if self.guided:
            self._validate_guided()

    def _validate_guided(self) -> None:
        check_guided(self.guided)
        # what would leave a guided row with no token to draw: tokens held back or banned that the
        # guide needs next (EOS included), or its EOS ignored
        for name, bad in (
            ("min_tokens", self.min_tokens > 0),
            ("ignore_eos", self.ignore_eos),
            ("allowed_token_ids", bool(self.allowed_token_ids)),
            ("bad_words", bool(self.bad_words)),
        ):
            if bad:
                raise RequestError.about(name, None, "cannot be combined with guided decoding")


def check_token_ids(req: Request, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
    """Every token id a request names (prompt, stop tokens, logit_bias, allowed tokens) an int (not a bool)
    inside [0, vocab_size); allowed tokens that min_tokens would all hold back (each an EOS, `eos_ids`, or a
    stop token) are refused, since no token could be drawn."""
    if not isinstance(req.prompt_ids, list):  # (a tuple failed in the step joining it to the output)
        raise RequestError(f"prompt_ids must be a list, got {type(req.prompt_ids).__name__}", "prompt")
    p = req.params
    for param, ids in (
        ("prompt", req.prompt_ids),
        ("stop_token_ids", p.stop_token_ids),
        ("logit_bias", [t for t, _ in p.logit_bias]),
        ("allowed_token_ids", p.allowed_token_ids),
    ):
        for t in ids:
            if type(t) is not int:  # (not a bool; as fast as isinstance)
                problem = f"token id {t!r} is a {type(t).__name__}, not an int"
            elif not 0 <= t < vocab_size:
                problem = f"token id {t!r} is outside the vocabulary [0, {vocab_size})"
            else:
                continue
            if param == "prompt":  # (a prompt is no setting: `token id 5000 is outside ...`)
                raise RequestError(problem, param)
            e = RequestError.about(param, None, problem)  # (`logit_bias: token id 5000 is outside ...`)
            e.param = param
            raise e
    if p.allowed_token_ids and p.min_tokens:
        held = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        if set(p.allowed_token_ids) <= held:
            e = RequestError.about(
                "allowed_token_ids",
                None,
                "every allowed token ends the generation, which min_tokens holds back",
            )
            e.param = "allowed_token_ids"
            raise e


def as_token_ids(ids: object, name: str) -> list[int]:
    """A caller's token ids (a list, a tuple, a numpy array, a torch tensor... of integers) as a list of ints;
    RequestError naming `name` for anything else (a string, a float, a nested list, a bool: Python's,
    numpy's and torch's bools index as 0 and 1, so `[True, 5]` was read as token 1)."""
    # (a set or a dict iterates in no order a prompt has, bytes-likes as their bytes: each was a prompt)
    if isinstance(ids, str | bytes | bytearray | memoryview | Set | Mapping) or not isinstance(ids, Iterable):
        raise RequestError(f"{name} must be a list of token ids, got {type(ids).__name__}", "prompt")
    if hasattr(ids, "tolist"):  # an array or tensor: its items as Python numbers (a bool stays a bool)
        ids = ids.tolist()
        if not isinstance(ids, list):  # (a 0-d array failed as a TypeError)
            raise RequestError(f"{name} must be a list of token ids, got the single number {ids!r}", "prompt")
    # (`type(t) is int`: is_int inline, as a 1M-token prompt pays it per token)
    return [t if type(t) is int else _token_id(t, name) for t in ids]


def _token_id(t: Any, name: str) -> int:
    """A token id that is not a plain int: an integer scalar of numpy or torch (`__index__`); RequestError
    for anything else, bools of any kind included."""
    v = t.tolist() if hasattr(t, "tolist") else t  # (a torch scalar indexes, bool or not)
    if isinstance(v, bool):
        raise RequestError(f"{name}: token id {t!r} is a bool, not an integer", "prompt")
    try:
        return operator.index(v)
    except TypeError:
        raise RequestError(f"{name}: token id {t!r} is not an integer", "prompt") from None


def find_stop(
    text: str, stops: Sequence[str], start: int = 0, floor: int = 0, include: bool = False
) -> int | None:
    """Where the text is cut for its stop strings: the earliest index at or after `start` where a stop
    string begins and ends after `floor` (the length of the text no stop string may end within: that of a
    request's first min_tokens tokens). `include` (vLLM's include_stop_str_in_output): the earliest end of
    such a match instead, so the text keeps the first stop string to complete (the one that ended the
    generation). None: no match."""
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, start, floor - len(s) + 1))
        if i >= 0:
            cut = i + len(s) if include else i
            best = cut if best is None else min(best, cut)
    return best


def bad_word_ids(encode: Callable[[str], list[int]], words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequence, as vLLM forms them: the word (without leading spaces), and the word
    after a space too where that space joins the word's first token (the same number of tokens, another
    first token: a word inside the text, for tokenizers that merge a space into the word)."""
    out: list[tuple[int, ...]] = []
    for w in words:
        bare = tuple(encode(w.lstrip()))
        spaced = tuple(encode(" " + w.lstrip()))
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(s for s in out if s)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS / stop token / stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine failed (message in StepOutput.error)


@dataclass(eq=False)
class Request:
    """One sequence in the scheduler. Mutable bookkeeping only; KV lives in the page pool.

    Compared by identity (`eq=False`): the scheduler's `req in self.running` checks must not compare
    whole prompts field by field (that made a batch-64 step cost over a millisecond of host time)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (prefix hits + computed)
    num_cached: int = 0  # prompt tokens served from the prefix cache
    finish_reason: FinishReason | None = None
    arrival: float = 0.0
    pin_prefix: bool = False  # register the prompt's pages in the prefix cache as pinned (documents)
    return_logits: bool = False  # score(): keep fp32 logits of every prompt position, no prefix reuse
    seed: int = 0  # the sampling seed actually used (params.seed, or one drawn at admission)
    logits: list = field(default_factory=list)  # score(): [n, vocab] chunks in order
    prompt_lp_upto: int = 0  # prompt tokens 1..prompt_lp_upto have had their logprobs reported
    # a running request's rid -> the full prompt pages the two have in common (Scheduler._waits_for_prefill)
    shared_pages: dict[str, int] = field(default_factory=dict)
    bad_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words' token sequences (`bad_word_ids`)
    guide: GuideState | None = None  # params.guided compiled (`EngineCore._add`)

    def banned(self, step: int) -> set[int]:
        """The tokens token `step` may not be for its bad words, given the output before it."""
        out: set[int] = set()
        for seq in self.bad_ids:
            k = len(seq) - 1
            if k == 0 or (step >= k and self.output_ids[step - k : step] == list(seq[:-1])):
                out.add(seq[-1])
        return out

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all reported yet (so every prompt position is computed)."""
        return self.params.prompt_logprobs is not None and self.prompt_lp_upto < len(self.prompt_ids) - 1

    @property
    def pending(self) -> int:
        """Tokens whose KV is not computed yet (1 for a decoding request)."""
        return self.num_tokens - self.num_computed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step of a 1M prompt reads one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.pending > 1 or not self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # (prompt logprobs) 1 + how many tokens are likelier than token_id


@dataclass(frozen=True)
class StepOutput:
    """What one scheduler step produced for one request."""

    rid: str
    new_token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_done: int = 0  # prompt tokens in the cache so far (progress of a long prefill)
    prompt_total: int = 0
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the next prompt tokens' (from token 1 on), in order

    @classmethod
    def of(
        cls,
        req: Request,
        new: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
    ) -> StepOutput:
        """req's state after a step that produced `new` tokens (with their `logprobs`)."""
        return cls(
            rid=req.rid,
            new_token_ids=new,
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_done=min(req.num_computed, len(req.prompt_ids)),
            prompt_total=len(req.prompt_ids),
            cached_tokens=req.num_cached,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
