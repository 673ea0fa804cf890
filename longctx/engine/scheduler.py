"""Continuous batching with chunked prefill, page-budget admission, prefix reuse and preemption.

Every request needs the KV of `all_ids[num_computed:]` computed; a decoding request has exactly one
such token. Each step takes every decoding request first (so a long prefill never stalls other
users' tokens), then spends the remaining token budget on prefill chunks of running requests, then
admits waiting requests while pages allow. The row that reaches a request's last token samples its
next token. When pages run out mid-flight the most recently admitted request without a row in the step
yet is preempted (a planned row's pages are its own until the step has run; the request growing is
always a candidate): its pages are freed and it is recomputed later (sampling is seeded per token, so it
continues identically).

`scheduling_policy="priority"` (vLLM's) orders all of this by each request's (priority, arrival), lower
first: the waiting queue, decodes and prefill chunks; the victim when pages run out is the running
request with the largest key, and a waiting head that does not fit preempts running requests of a
strictly larger key for its pages. "fcfs" (the default) is arrival order, and takes priority 0 only.

The scheduler holds no tensors; it produces `BatchPlan`s and consumes `BatchResult`s.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from typing import Any

from longctx.config import SCHEDULING_POLICIES
from longctx.engine.plan import BatchPlan, BatchResult, RowPlan, RowResult
from longctx.engine.request import FinishReason, Request, StepOutput, TokenLogprob
from longctx.errors import RequestError
from longctx.kvstore.allocator import OutOfPages, PageAllocator
from longctx.kvstore.page_table import RequestPages
from longctx.kvstore.prefix_cache import PrefixCache


class QueueFull(RequestError):
    """The waiting queue is at its limit (HTTP 429)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="queue_full")


def priority_key(req: Request) -> tuple[int, float]:
    """A request's place under the priority policy: its priority (lower first), then its arrival."""
    return req.params.priority, req.arrival


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        prefix_cache: PrefixCache | None,
        *,
        max_context: int,
        chunk_size: int = 2048,
        max_batch_tokens: int | None = None,
        max_running: int = 64,
        max_queue: int = 1024,
        eos_ids: tuple[int, ...] = (),
        scheduling_policy: str = "fcfs",
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy {scheduling_policy!r}: must be 'fcfs' or 'priority'")
        self.alloc = allocator
        self.cache = prefix_cache
        self.page_size = allocator.page_size
        self.max_context = max_context
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens or chunk_size
        self.max_running = max_running
        self.max_queue = max_queue
        self.eos_ids = tuple(eos_ids)
        self.by_priority = scheduling_policy == "priority"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pages: dict[str, RequestPages] = {}
        self._step = 0
        self.num_preempted = 0
        # admissions put off for a running prefill's shared pages (steps x requests)
        self.num_prefix_waits = 0
        # rid -> its prefill's PrefixCache.extend state (full pages registered, the last one's key)
        self._chains: dict[str, tuple[int, bytes | None]] = {}
        self.num_overlapped = 0  # steps planned while the previous one ran (plan_continuation)
        self._planned: set[str] = set()  # rids with a row in the step being planned (not preemptible)

    # ---- requests ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue `req`, or refuse it for its size, a full queue or a duplicate id. Its params are taken as
        valid: `SamplingParams.validate` runs once on the engine's public paths before this."""
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt", "empty_prompt")
        if n > self.max_context:
            raise RequestError(
                f"the prompt has {n} tokens, more than the maximum context of {self.max_context}",
                code="context_length_exceeded",
            )
        need = self.alloc.pages_for(min(n + max(req.params.max_new_tokens, 1), self.max_context))
        if need > self.alloc.num_pages:
            raise RequestError(
                f"the request needs {need} KV pages but the pool has {self.alloc.num_pages}; "
                "lower max_tokens or the prompt length",
                code="context_length_exceeded",
            )
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
        if any(r.rid == req.rid for r in self.running) or any(r.rid == req.rid for r in self.waiting):
            raise RequestError(f"duplicate request id {req.rid!r}")
        if req.params.priority != 0 and not self.by_priority:  # (as vLLM refuses it)
            raise RequestError(
                f"priority {req.params.priority}: the engine schedules first come, first served; "
                "priorities need scheduling_policy 'priority' (serve --scheduling-policy priority)",
                "priority",
            )
        req.seed = req.params.seed if req.params.seed is not None else random.getrandbits(31)
        req.arrival = req.arrival or time.monotonic()
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Put `req` at the waiting queue's end, or (priority) in its (priority, arrival) place: after
        every request whose key is not larger, so equal keys keep their order."""
        i = len(self.waiting)
        if self.by_priority:
            key = priority_key(req)
            while i > 0 and priority_key(self.waiting[i - 1]) > key:
                i -= 1
        self.waiting.insert(i, req)

    def abort(self, rid: str) -> Request | None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = FinishReason.ABORT
                return req
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = FinishReason.ABORT
                self._release(req, cache=False)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> BatchPlan | None:
        rows: list[RowPlan] = []
        budget = self.max_batch_tokens
        self._planned.clear()
        if self.by_priority:
            self._preempt_for_head()
        # 1. decodes: one token each, never starved by prefills
        for req in self._ordered([r for r in self.running if not r.in_prefill]):
            if req not in self.running:
                continue  # preempted while making room for an earlier one
            if not self._grow(req, 1):
                continue
            rows.append(self._row(req, 1))
            self._planned.add(req.rid)
            budget -= 1
        # 2. prefill chunks of admitted requests, oldest first; one that would not finish in this step
        # leaves half the budget to the requests behind it (other prefills, admissions), so a long
        # document's prefill does not hold every new request back until it is done
        # (a waiting request that waits for this very prefill's pages is not behind it)
        prefills = self._ordered([r for r in self.running if r.in_prefill])
        admissible = (
            bool(self.waiting)
            and len(self.running) < self.max_running
            and not self._waits_for_prefill(self.waiting[0])
        )
        for i, req in enumerate(prefills):
            if budget <= 0:
                break
            n = min(req.pending, budget, self.chunk_size)
            if (i + 1 < len(prefills) or admissible) and n < req.pending and n > budget // 2:
                n = max(1, budget // 2)
            if req not in self.running or not self._grow(req, n):
                continue
            rows.append(self._row(req, n))
            self._planned.add(req.rid)
            budget -= n
        # 3. admission (a request that shares uncached prompt pages with one still prefilling them waits
        # for them, keeping its place in the queue, and the requests behind it go on)
        held: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self._waits_for_prefill(req):
                held.append(self.waiting.popleft())
                self.num_prefix_waits += 1
                continue
            pages: list[int] = []
            cached = 0
            cache = self._cache_for(req)
            if cache is not None:
                pages, cached = cache.match(req.all_ids)
            rp = RequestPages(self.page_size, pages, cached)
            n = min(req.num_tokens - cached, budget, self.chunk_size)
            if not self._make_room(rp.pages_missing(n)):
                rp.release(self.alloc)
                break
            self.waiting.popleft()
            req.num_computed = cached
            req.num_cached = cached if not req.output_ids else req.num_cached
            self.pages[req.rid] = rp
            self.running.append(req)
            rp.grow(n, self.alloc)
            rows.append(self._row(req, n))
            self._planned.add(req.rid)
            budget -= n
        self.waiting.extendleft(reversed(held))
        if not rows:
            return None
        self._step += 1
        return BatchPlan(self._step, tuple(rows))

    def _ordered(self, reqs: list[Request]) -> list[Request]:
        """`reqs` in the order the step serves them: as admitted (fcfs), or by (priority, arrival)."""
        return sorted(reqs, key=priority_key) if self.by_priority else reqs

    def _preempt_for_head(self) -> None:
        """Priority preemption (vLLM's): while the waiting head's first chunk, with a token for each
        decode, does not fit the free pages, preempt the running request with the largest (priority,
        arrival) if it is strictly larger than the head's. Never for an equal or a higher priority, nor
        when the head could not be admitted anyway (the running limit, a prefill it waits for); each
        round preempts one request, so it ends."""
        head = self.waiting[0] if self.waiting else None
        if head is None or len(self.running) >= self.max_running or self._waits_for_prefill(head):
            return
        key = priority_key(head)
        while self.running and not self._make_room(self._head_need(head)):
            victim = max(self.running, key=priority_key)
            if priority_key(victim) <= key:
                return
            self._preempt(victim)

    def _head_need(self, head: Request) -> int:
        """Pages this step needs to admit `head` (its first chunk past its cached prefix) and to give
        every running decode its next token."""
        cached = 0
        cache = self._cache_for(head)
        if cache is not None:
            cached = cache.cached_tokens(head.all_ids)
        n = min(head.num_tokens - cached, self.max_batch_tokens, self.chunk_size)
        decodes = sum(max(0, self.pages[r.rid].pages_missing(1)) for r in self.running if not r.in_prefill)
        return self.alloc.pages_for(cached + n) - cached // self.page_size + decodes

    def _cache_for(self, req: Request) -> PrefixCache | None:
        """The prefix cache `req`'s prompt may take computed pages from; None without one, or when every
        position's logits or the prompt's logprobs are wanted (a cached page computes neither)."""
        if req.return_logits or req.needs_prompt_logprobs:
            return None
        return self.cache

    def _waits_for_prefill(self, req: Request) -> bool:
        """Whether `req` should wait for a running request whose prefill has not yet computed the full
        prompt pages the two share: they enter the prefix cache as that prefill computes them
        (`_cache_prefill`), so `req` then takes them instead of computing them a second time. Two
        clients sending one long document at once prefill it once."""
        if self._cache_for(req) is None:
            return False
        ps = self.page_size
        usable = (len(req.prompt_ids) - 1) // ps  # (a match leaves one token to compute)
        for lead in self.running:
            if lead.return_logits or lead.num_computed >= len(lead.prompt_ids):
                continue
            shared = req.shared_pages.get(lead.rid)
            if shared is None:
                shared = req.shared_pages[lead.rid] = common_full_pages(req.prompt_ids, lead.prompt_ids, ps)
            if lead.num_computed // ps < min(shared, usable):
                return True
        return False

    def _make_room(self, n_pages: int) -> bool:
        if n_pages <= self.alloc.num_free:
            return True
        if self.cache is not None:
            self.cache.ensure_free(n_pages)
        return n_pages <= self.alloc.num_free

    def _grow(self, req: Request, n: int) -> bool:
        """Give `req` slots for n more tokens, preempting later requests if pages run out."""
        rp = self.pages[req.rid]
        while True:
            if self._make_room(rp.pages_missing(n)):
                rp.grow(n, self.alloc)
                return True
            victim = self._victim()
            self._preempt(victim)
            if victim is req:
                return False

    def _victim(self) -> Request:
        """Whom to preempt when pages run out, among the requests without a row in this step yet (a
        planned row's pages must stay its own; the request growing is one of them): the most recently
        admitted (fcfs), or the one with the largest (priority, arrival)."""
        free = [r for r in self.running if r.rid not in self._planned]
        return max(free, key=priority_key) if self.by_priority else free[-1]

    def _preempt(self, req: Request) -> None:
        """Free `req`'s pages and put it back in the queue to be recomputed: at its head (fcfs), or in its
        (priority, arrival) place."""
        self._release(req, cache=False)
        req.num_computed = 0
        if self.by_priority:
            self._enqueue(req)
        else:
            self.waiting.appendleft(req)
        self.num_preempted += 1

    def _row(self, req: Request, n: int) -> RowPlan:
        start = req.num_computed
        ids = tuple(req.token_slice(start, start + n))
        reaches_end = start + n == req.num_tokens
        if req.return_logits:
            mode = "all"
        elif reaches_end and req.params.max_new_tokens > len(req.output_ids):
            mode = "last"
        else:
            mode = "none"
        p = req.params
        rp = self.pages[req.rid]
        targets: tuple[int, ...] = ()
        if req.needs_prompt_logprobs:  # positions start.. predict prompt tokens start + 1..
            count = max(0, min(start + n, len(req.prompt_ids) - 1) - start)
            targets = tuple(req.prompt_ids[start + 1 : start + 1 + count])
        return RowPlan(
            rid=req.rid,
            token_ids=ids,
            start=start,
            pages=rp.as_tuple(),
            pages_epoch=rp.epoch,
            logits=mode,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=req.seed,
            step=len(req.output_ids),
            logprobs=p.logprobs,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            penalty_prompt=self._penalty_prompt(req) if mode == "last" and not req.output_ids else (),
            logit_bias=p.logit_bias,
            suppress=self._suppress(req, len(req.output_ids)) if mode == "last" else (),
            allowed=p.allowed_token_ids if mode == "last" else (),
            guide_mask=req.guide.mask(req.output_ids) if mode == "last" and req.guide is not None else b"",
            min_p=p.min_p,
            prompt_lp_targets=targets,
            prompt_logprobs=p.prompt_logprobs or 0,
        )

    def _suppress(self, req: Request, step: int) -> tuple[int, ...]:
        """The tokens token `step` of `req` may not be: its EOS (unless ignore_eos) and stop tokens while
        it has fewer than min_tokens, and its bad words' last tokens where the output before it ends with
        the rest of them."""
        p = req.params
        out = req.banned(step) if req.bad_ids else set()
        if step < p.min_tokens:
            out |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        return tuple(sorted(out))

    @staticmethod
    def _penalty_prompt(req: Request) -> tuple[int, ...]:
        """The prompt's distinct token ids, for a repetition penalty (once per request: its first
        sampling row; the last stage keeps them)."""
        if req.params.repetition_penalty == 1.0:
            return ()
        return tuple(sorted(set(req.prompt_ids)))

    # ---- overlapped decode ---------------------------------------------------------------------
    def plan_continuation(self, plan: BatchPlan) -> BatchPlan | None:
        """Step n+1 of a pure decode batch, planned while step n runs (its tokens still unknown).

        Only when nothing else could change the batch: no request waiting, every running request
        decoding in `plan`, none about to reach its token or context limit, pages free for all.
        The rows carry placeholder tokens; `confirm_continuation` fills them after `update` and
        drops requests that finished at step n (their pages, this extra slot included, are freed
        by the release that finished them). What a guided row, or one with bad words of several
        tokens, may draw depends on step n's token: such rows are shaped by `confirm_continuation`
        too (`shapes_late`), and the engine draws their tokens once it has them.
        """
        if self.waiting or len(plan.rows) != len(self.running):
            return None
        live = {r.rid: r for r in self.running}
        for row in plan.rows:
            req = live.get(row.rid)
            if (
                req is None
                or len(row.token_ids) != 1
                or row.logits != "last"
                or row.end != req.num_tokens  # the row samples the request's next token
                or len(req.output_ids) + 2 > req.params.max_new_tokens
                or row.end + 1 >= self.max_context
            ):
                return None
        if not self._make_room(sum(max(0, self.pages[r.rid].pages_missing(1)) for r in plan.rows)):
            return None
        rows = []
        for row in plan.rows:
            req = live[row.rid]
            rp = self.pages[row.rid]
            rp.grow(1, self.alloc)
            rows.append(
                dataclasses.replace(
                    row,
                    token_ids=(-1,),
                    start=row.end,
                    pages=rp.as_tuple(),
                    pages_epoch=rp.epoch,
                    step=len(req.output_ids) + 1,
                    penalty_prompt=(),  # (sent with the request's first sampling row only)
                    # (a late-shaped row's suppression and mask wait for step n's token)
                    suppress=() if shapes_late(req) else self._suppress(req, len(req.output_ids) + 1),
                    guide_mask=b"",
                )
            )
        self._step += 1
        return BatchPlan(self._step, tuple(rows))

    def shapes_late(self, nxt: BatchPlan) -> bool:
        """Whether a continuation has rows whose shaping waits for step n's tokens (`shapes_late`)."""
        live = {r.rid: r for r in self.running}
        return any(shapes_late(live[row.rid]) for row in nxt.rows if row.rid in live)

    def confirm_continuation(self, nxt: BatchPlan, keep_finished: bool = False) -> BatchPlan | None:
        """After `update` of step n: the continuation with step n's tokens, its late-shaped rows'
        suppression and guide masks filled in, without finished requests (`keep_finished`: with their
        rows unchanged, so the plan still lists the rows a launched continuation computes)."""
        live = {r.rid: r for r in self.running}
        rows = []
        confirmed = 0
        for row in nxt.rows:
            req = live.get(row.rid)
            if req is None or req.finished:
                if keep_finished:
                    rows.append(row)
                continue
            confirmed += 1
            assert req.num_computed == row.start and req.num_tokens == row.end, (req, row)
            row = dataclasses.replace(row, token_ids=(req.output_ids[-1],))
            if shapes_late(req):
                step = len(req.output_ids)
                mask = req.guide.mask(req.output_ids) if req.guide is not None else b""
                row = dataclasses.replace(row, suppress=self._suppress(req, step), guide_mask=mask)
            rows.append(row)
        if not confirmed:
            return None
        self.num_overlapped += 1
        return BatchPlan(nxt.step_id, tuple(rows))

    # ---- results ------------------------------------------------------------------------------
    def update(self, plan: BatchPlan, result: BatchResult) -> list[StepOutput]:
        by_rid = {r.rid: r for r in result.rows}
        outs: list[StepOutput] = []
        live = {r.rid: r for r in self.running}
        for row in plan.rows:
            req = live.get(row.rid)
            if req is None or req.finished:
                continue  # aborted meanwhile
            res = by_rid.get(row.rid)
            req.num_computed = row.end
            if row.start < len(req.prompt_ids) and not req.return_logits:
                self._cache_prefill(req)
            new: tuple[int, ...] = ()
            lps: tuple[TokenLogprob, ...] = ()
            if res is not None and res.logits is not None:
                req.logits.append(res.logits)
            if res is not None and res.token_id is not None:
                req.output_ids.append(res.token_id)
                new = (res.token_id,)
                if res.logprob is not None:
                    lps = (TokenLogprob(res.token_id, res.logprob, res.top_logprobs),)
            prompt_lps = self._prompt_logprobs(req, row, res)
            self._check_finish(req, new)
            outs.append(StepOutput.of(req, new, lps, prompt_lps))
            if req.finished:
                self._release(req, cache=not req.return_logits)
        return outs

    @staticmethod
    def _prompt_logprobs(req: Request, row: RowPlan, res: RowResult | None) -> tuple[TokenLogprob, ...]:
        """The row's prompt logprobs not reported before (a recomputed prefill, after a preemption,
        computes them again)."""
        if res is None or not res.prompt_logprobs:
            return ()
        out = []
        for i, (tok, lp, top, rank) in enumerate(res.prompt_logprobs):
            idx = row.start + 1 + i  # the prompt token this entry is for
            if idx > req.prompt_lp_upto:
                out.append(TokenLogprob(tok, lp, top, rank))
                req.prompt_lp_upto = idx
        return tuple(out)

    def _check_finish(self, req: Request, new: tuple[int, ...]) -> None:
        p = req.params
        tok = new[-1] if new else None
        # (sampling holds EOS and the stop tokens back while the request has fewer than min_tokens)
        stoppable = tok is not None and len(req.output_ids) > p.min_tokens
        if stoppable and ((not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids):
            req.finish_reason = FinishReason.STOP
        elif tok is not None and req.guide is not None and req.guide.complete(req.output_ids):
            req.finish_reason = FinishReason.STOP  # a whole match nothing can extend: no step for its EOS
        elif req.pending > 1 or (req.pending == 1 and not req.output_ids):
            return  # still prefilling
        elif len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= self.max_context:
            req.finish_reason = FinishReason.LENGTH

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Finish a running request from outside (a stop string matched on its text)."""
        if req.finished:
            return
        req.finish_reason = reason
        self._release(req, cache=True)

    def _cache_prefill(self, req: Request) -> None:
        """The full prompt pages a prefill has computed so far go into the prefix cache after each of its
        chunks, not when it ends or at release: a request with the same prompt prefix that arrives
        meanwhile (another client's question on the same long document, a request's n choices) shares
        them. The cache takes its own reference; these pages are complete, and the request only writes
        past them. Each page is hashed once (`PrefixCache.extend` goes on from the last chunk's)."""
        rp = self.pages.get(req.rid)
        if self.cache is None or rp is None:
            return
        n_full = min(req.num_computed, len(req.prompt_ids)) // self.page_size
        start, prev = self._chains.get(req.rid, (0, None))
        if n_full > start:
            self._chains[req.rid] = self.cache.extend(req.prompt_ids, rp.pages, start, prev, n_pages=n_full)

    def _release(self, req: Request, cache: bool) -> None:
        self._chains.pop(req.rid, None)
        rp = self.pages.pop(req.rid, None)
        if req in self.running:
            self.running.remove(req)
        if rp is None:
            return
        if cache and self.cache is not None:
            n_full = min(req.num_computed, rp.num_tokens) // self.page_size
            if n_full:
                self.cache.insert(req.all_ids[: n_full * self.page_size], rp.pages[:n_full])
                if req.pin_prefix:
                    self.cache.pin_prefix(req.prompt_ids)
        rp.release(self.alloc)

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "pages_total": self.alloc.num_pages,
            "pages_used": self.alloc.num_used,
            "preempted": self.num_preempted,
            "prefix_waits": self.num_prefix_waits,
            "overlapped_steps": self.num_overlapped,
        }
        if self.cache is not None:
            s["prefix_cache"] = self.cache.stats()
        return s


def shapes_late(req: Request) -> bool:
    """Whether what `req`'s next token may be depends on its last one: a guide, or a bad word of
    several tokens."""
    return req.guide is not None or any(len(w) > 1 for w in req.bad_ids)


def common_full_pages(a: list[int], b: list[int], page_size: int) -> int:
    """How many full pages `a` and `b` share from their start."""
    n = min(len(a), len(b)) // page_size
    i = 0
    while i < n and a[i * page_size : (i + 1) * page_size] == b[i * page_size : (i + 1) * page_size]:
        i += 1
    return i


__all__ = ["OutOfPages", "QueueFull", "Scheduler", "common_full_pages", "priority_key"]
