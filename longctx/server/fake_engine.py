"""A stand-in for `longctx.Engine`'s step API, for fast server tests and load benches.

It has the same serving surface (add_request / abort / step / has_work / num_waiting /
num_running / pin_document / unpin_document / reset_prefix_cache / stats / tokenizer / config / close)
and behaves like a paged scheduler in miniature: admission by a page budget (a request that does not fit waits),
chunked prefill with progress, one token per running request per step, pinned documents whose
full pages serve as a prefix cache. It computes nothing: greedy output echoes the prompt, sampled
output is seeded random bytes, so the text is printable under a byte-level tokenizer. A guided request
(`SamplingParams.guided`) is held to its guide as the real engine holds it: the token it would have written
where the guide allows it, else one the guide allows (greedy: fixed by the prompt and the step), and it ends
where the guide is whole and can go no further.
Selected with `longctx serve --fake-engine '{"step_delay_s": 0.002, ...}'`.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from longctx.checkpoint.tokenizer import make_tokenizer, token_bytes_table
from longctx.config import is_int, is_real
from longctx.engine.guided import GuideCache, GuideState, VocabBytes
from longctx.engine.request import FinishReason, Request, StepOutput, TokenLogprob, check_token_ids
from longctx.errors import LongctxError, RequestError

PAGE = 64


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 320
    eos_token_id: int | None = 257
    max_position_embeddings: int = 1_048_576


@dataclass
class FakeEngineOptions:
    """Knobs for the simulated costs; all optional in the `--fake-engine` JSON."""

    total_pages: int = 4096
    prefill_chunk: int = 2048  # prompt tokens prefilled per step, across requests
    step_delay_s: float = 0.002  # fixed cost of one step
    prefill_s_per_token: float = 0.0  # extra cost per prefilled token
    vocab_size: int = 320
    eos_token_id: int | None = 257
    # a step raises when a running request whose prompt holds this token has written poison_after
    # tokens (a failing batch, in tests)
    poison_token: int | None = None
    poison_after: int = 0


_AT_LEAST_1 = ("total_pages", "prefill_chunk", "vocab_size")
_TOKENS = ("eos_token_id", "poison_token")  # a token id or null
_SECONDS = ("step_delay_s", "prefill_s_per_token")
MAX_DELAY_S = 60.0  # (one step's or one token's simulated cost; time.sleep overflows on a huge one)


def fake_options(options: Mapping[str, Any]) -> FakeEngineOptions:
    """`FakeEngineOptions` from the `--fake-engine` JSON object, each option checked: an unknown name, a value
    of the wrong type or out of range is a one-line `LongctxError` naming the option (`serve` checks them
    before anything starts; the engine process built them with a TypeError traceback, or not at all)."""
    known = [f.name for f in fields(FakeEngineOptions)]
    for name, value in options.items():
        shown = _shown(value)
        if name not in known:
            raise LongctxError(f"unknown option {_shown(name)} (known: {', '.join(known)})")
        if name in _SECONDS:
            if not is_real(value):
                raise LongctxError(f"{name} {shown}: must be a number of seconds")
            if not 0 <= value <= MAX_DELAY_S:
                raise LongctxError(f"{name} {shown}: must be in [0, {MAX_DELAY_S:g}] seconds")
        elif name in _TOKENS:
            if value is not None and not is_int(value):
                raise LongctxError(f"{name} {shown}: must be a token id or null")
        elif not is_int(value):
            raise LongctxError(f"{name} {shown}: must be an integer")
        elif value < (1 if name in _AT_LEAST_1 else 0):
            raise LongctxError(f"{name} {shown}: must be >= {1 if name in _AT_LEAST_1 else 0}")
    opts = FakeEngineOptions(**options)
    for name in _TOKENS:
        token = getattr(opts, name)
        if token is not None and not 0 <= token < opts.vocab_size:
            raise LongctxError(f"{name} {_shown(token)}: must be in [0, vocab_size {opts.vocab_size})")
    return opts


def _shown(value: object) -> str:
    """A value as the JSON said it (true, "x"), a long one cut."""
    shown = json.dumps(value, default=repr)
    return shown if len(shown) <= 40 else shown[:40] + "..."


@dataclass
class _Live:
    req: Request
    pages: int  # reserved at admission
    rng: random.Random = field(default_factory=random.Random)
    guide: GuideState | None = None


class FakeEngine:
    """Deterministic, compute-free engine with the serving API of `longctx.Engine`."""

    def __init__(self, max_context: int = 1_048_576, **options: Any) -> None:
        self.opts = fake_options(options)
        self.max_context = max_context
        self.config = FakeConfig(self.opts.vocab_size, self.opts.eos_token_id, max_context)
        self._guide_cache: GuideCache | None = None  # (`_guides`: made for the first guided request)
        self.tokenizer = None
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._docs: dict[str, tuple[int, ...]] = {}
        self._doc_seq = 0
        self._pages_used = 0
        self._prefix_hit_tokens = 0

    @property
    def context_capacity(self) -> int:
        return min(self.max_context, self.opts.total_pages * PAGE)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        req.params.validate()
        if not req.prompt_ids:
            raise RequestError("empty prompt")
        if len(req.prompt_ids) > self.max_context:
            raise RequestError(
                f"prompt has {len(req.prompt_ids)} tokens, more than max_context {self.max_context}"
            )
        check_token_ids(req, self.opts.vocab_size)
        if req.params.priority != 0:  # (it schedules first come, first served, as the real engine's default)
            raise RequestError(
                f"priority {req.params.priority}: the engine schedules first come, first served", "priority"
            )
        seed = req.params.seed if req.params.seed is not None else hash(req.rid)
        need = -(-(len(req.prompt_ids) + req.params.max_new_tokens) // PAGE)
        if need > self.opts.total_pages:
            raise RequestError(f"request needs {need} KV pages, the pool has {self.opts.total_pages}")
        guide = GuideState(self._guides().get(*req.params.guided)) if req.params.guided else None
        self._waiting.append(_Live(req, 0, random.Random(seed), guide))

    def _guides(self) -> GuideCache:
        """Guides over this engine's vocabulary: the byte-level tokenizer's tokens, EOS the only end."""
        if self._guide_cache is None:
            pieces = token_bytes_table(make_tokenizer(), self.opts.vocab_size)
            eos = [] if self.opts.eos_token_id is None else [self.opts.eos_token_id]
            self._guide_cache = GuideCache(VocabBytes.build(pieces, eos))
        return self._guide_cache

    def abort(self, rid: str) -> None:
        for q in (self._waiting, self._running):
            for live in list(q):
                if live.req.rid == rid:
                    q.remove(live)
                    self._pages_used -= live.pages
                    live.req.finish_reason = FinishReason.ABORT

    def fail_step(self) -> list[str]:
        """After `step` raised: abort the requests it held (the running ones); see `Engine.fail_step`."""
        rids = [live.req.rid for live in self._running]
        for rid in rids:
            self.abort(rid)
        return rids

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self._running)

    # ---- scheduling -------------------------------------------------------------------------
    def _cached_prefix(self, prompt: list[int]) -> int:
        best = 0
        for doc in self._docs.values():
            if len(doc) <= len(prompt) and tuple(prompt[: len(doc)]) == doc:
                best = max(best, len(doc) // PAGE * PAGE)
        return min(best, len(prompt) - 1)  # the last prompt token is always computed

    def _admit(self) -> None:
        while self._waiting:
            live = self._waiting[0]
            req = live.req
            cached = max(0, self._cached_prefix(req.prompt_ids))
            need = -(-(len(req.prompt_ids) + req.params.max_new_tokens) // PAGE) - cached // PAGE
            if self._pages_used + need > self.opts.total_pages:
                return  # FCFS: the head waits until pages come back
            self._waiting.popleft()
            live.pages = need
            self._pages_used += need
            req.num_cached = req.num_computed = cached
            self._prefix_hit_tokens += cached
            self._running.append(live)

    def _next_token(self, live: _Live) -> int:
        req, p = live.req, live.req.params
        if p.temperature == 0:
            tok = req.prompt_ids[len(req.output_ids) % len(req.prompt_ids)]
        else:
            tok = (
                live.rng.randrange(32, 127)
                if self.opts.vocab_size > 127
                else live.rng.randrange(self.opts.vocab_size)
            )
        if live.guide is None:
            return tok
        ok = live.guide.guide.allowed(live.guide.at(req.output_ids))
        if ok[tok]:
            return tok
        allowed = [int(t) for t in ok.nonzero()[0]]
        # (greedy: a choice fixed by the prompt and the step, so the same request writes the same text; the
        # first allowed token would loop, e.g. "," before "]" for ever)
        rng = (
            random.Random(len(req.output_ids) * 1_000_003 + sum(req.prompt_ids[:64]))
            if p.temperature == 0
            else live.rng
        )
        return rng.choice(allowed)

    def step(self) -> list[StepOutput]:
        self._admit()
        poison = self.opts.poison_token
        if poison is not None and any(
            poison in live.req.prompt_ids and len(live.req.output_ids) >= self.opts.poison_after
            for live in self._running
        ):
            raise RuntimeError("a poisoned batch (fake engine)")
        outs: list[StepOutput] = []
        budget = self.opts.prefill_chunk
        prefilled = 0
        for live in list(self._running):
            req = live.req
            new: list[int] = []
            prompt_lps: tuple[TokenLogprob, ...] = ()
            if req.num_computed < len(req.prompt_ids):
                if budget <= 0:
                    continue
                n = min(budget, len(req.prompt_ids) - req.num_computed)
                budget -= n
                prefilled += n
                req.num_computed += n
                prompt_lps = self._prompt_logprobs(req)
                if req.num_computed < len(req.prompt_ids):
                    outs.append(self._out(req, (), prompt_lps))
                    continue
            if req.params.max_new_tokens > 0:
                tok = self._next_token(live)
                new.append(tok)
                req.output_ids.append(tok)
                req.num_computed += 1
            if len(req.output_ids) >= req.params.max_new_tokens or req.num_tokens >= self.max_context:
                req.finish_reason = FinishReason.LENGTH
            eos = self.opts.eos_token_id
            if new and eos is not None and new[-1] == eos and not req.params.ignore_eos:
                req.finish_reason = FinishReason.STOP
            elif new and live.guide is not None and live.guide.complete(req.output_ids):
                req.finish_reason = FinishReason.STOP  # (a whole match nothing can extend)
            outs.append(self._out(req, tuple(new), prompt_lps))
            if req.finished:
                self._running.remove(live)
                self._pages_used -= live.pages
        time.sleep(self.opts.step_delay_s + prefilled * self.opts.prefill_s_per_token)
        return outs

    def _out(
        self, req: Request, new: tuple[int, ...], prompt_lps: tuple[TokenLogprob, ...] = ()
    ) -> StepOutput:
        n = req.params.logprobs
        lps = self._logprobs(new, n) if n is not None else ()
        return StepOutput.of(req, new, lps, prompt_lps)

    def _logprobs(self, toks: Sequence[int], n: int) -> tuple[TokenLogprob, ...]:
        v = self.opts.vocab_size
        return tuple(TokenLogprob(t, -0.25, tuple(((t + i) % v, -0.25 - i) for i in range(n))) for t in toks)

    def _prompt_logprobs(self, req: Request) -> tuple[TokenLogprob, ...]:
        """Prompt tokens 1..num_computed - 1 not reported yet (params.prompt_logprobs)."""
        n = req.params.prompt_logprobs
        if n is None:
            return ()
        upto = min(req.num_computed, len(req.prompt_ids)) - 1
        new = req.prompt_ids[req.prompt_lp_upto + 1 : upto + 1]
        req.prompt_lp_upto = max(req.prompt_lp_upto, upto)
        return tuple(replace(lp, rank=1) for lp in self._logprobs(new, n))  # (its own top)

    # ---- documents --------------------------------------------------------------------------
    def pin_document(self, token_ids: list[int]) -> tuple[str, int]:
        if not token_ids:
            raise RequestError("empty document")
        if len(token_ids) > self.max_context:
            raise RequestError(
                f"document has {len(token_ids)} tokens, more than max_context {self.max_context}"
            )
        time.sleep(len(token_ids) * self.opts.prefill_s_per_token)
        self._doc_seq += 1
        doc_id = f"doc-{self._doc_seq}"
        self._docs[doc_id] = tuple(token_ids)
        self._pages_used += len(token_ids) // PAGE
        return doc_id, len(token_ids)

    def unpin_document(self, doc_id: str) -> None:
        doc = self._docs.pop(doc_id, None)
        if doc is None:
            raise RequestError(f"no pinned document {doc_id!r}")
        self._pages_used -= len(doc) // PAGE

    def reset_prefix_cache(self) -> dict[str, int]:
        """`Engine.reset_prefix_cache`: the only cached pages here are pinned documents', which stay."""
        return {"freed_pages": 0, "kept_pages": sum(len(doc) // PAGE for doc in self._docs.values())}

    def stats(self) -> dict[str, Any]:
        return {
            "pages_used": self._pages_used,
            "pages_total": self.opts.total_pages,
            "prefix_hit_tokens": self._prefix_hit_tokens,
            "host_pool_bytes": 0,
            "hisparse_hits": 0,
            "hisparse_misses": 0,
            "fake": True,
        }

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()
