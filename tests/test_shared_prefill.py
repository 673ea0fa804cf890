"""Requests that share prompt pages with a prefill in progress: its full pages enter the prefix cache chunk
by chunk, and a request whose shared pages are not computed yet waits for them instead of computing them
again (so two clients sending one long document at once prefill it once), with the tokens unchanged."""

from __future__ import annotations

import random

from longctx import Engine
from longctx.engine.plan import BatchResult, RowResult
from longctx.engine.request import Request, SamplingParams
from longctx.engine.scheduler import Scheduler, common_full_pages
from longctx.engine.sizing import PAGE_SIZE
from longctx.kvstore.allocator import PageAllocator
from longctx.kvstore.prefix_cache import PrefixCache
from tests.conftest import rand_ids


def _req(ids: list[int], n: int = 4) -> Request:
    return Request(f"sp-{random.random()}", list(ids), SamplingParams(max_new_tokens=n, ignore_eos=True))


def _drive(eng: Engine, reqs: list[Request], arrive: dict[int, int] | None = None) -> dict:
    """Step until every request finishes; request i is added before step arrive.get(i, 0). Per request:
    its tokens, cached prompt tokens and the step its first token came at; "_computed": the prompt tokens
    the steps computed."""
    arrive = arrive or {}
    got: dict = {r.rid: {"tokens": [], "cached": 0, "first": None} for r in reqs}
    step, computed = 0, 0
    while True:
        for i, r in enumerate(reqs):
            if arrive.get(i, 0) == step:
                eng.add_request(r)
        if not eng.has_work() and all(arrive.get(i, 0) <= step for i in range(len(reqs))):
            break
        before = {r.rid: min(r.num_computed, len(r.prompt_ids)) for r in reqs}
        for o in eng.step():
            if o.rid in got:
                g = got[o.rid]
                g["tokens"] += list(o.new_token_ids)
                g["cached"] = max(g["cached"], o.cached_tokens)
                if o.new_token_ids and g["first"] is None:
                    g["first"] = step
        # (a request admitted this step starts from its cached tokens)
        computed += sum(
            min(r.num_computed, len(r.prompt_ids)) - max(before[r.rid], r.num_cached if r.num_computed else 0)
            for r in reqs
            if r.num_computed
        )
        step += 1
    got["_computed"] = computed
    return got


def test_two_requests_with_one_long_prompt_prefill_it_once(eng):
    """Sent together: the second starts when the first's last chunk leaves room in the step, and takes
    every page the first computed; one that is the first's prompt and more waits a step for the first's
    last page. Without incremental caching it computed the whole prompt again."""
    prompt = rand_ids(300, 12)  # chunks of 29 tokens; 4 full pages
    a, b = _req(prompt), _req(prompt)
    got = _drive(eng, [a, b])
    assert got[b.rid]["cached"] == 4 * PAGE_SIZE and got[a.rid]["cached"] == 0
    assert got["_computed"] == 300 + 300 - 4 * PAGE_SIZE
    (want,) = [c.token_ids for c in eng.generate([prompt], max_new_tokens=4, ignore_eos=True)]
    assert got[a.rid]["tokens"] == got[b.rid]["tokens"] == want
    # a prompt of 5 full pages and the same with 50 more tokens: the leader's last chunk holds part of
    # page 5, which the follower waits one step for
    lead = rand_ids(5 * PAGE_SIZE, 13)
    a, b = _req(lead), _req(lead + rand_ids(50, 14))
    waits = eng.scheduler.num_prefix_waits
    got = _drive(eng, [a, b])
    assert got[b.rid]["cached"] == 5 * PAGE_SIZE and eng.scheduler.num_prefix_waits == waits + 1
    assert got["_computed"] == 5 * PAGE_SIZE + 50
    (want,) = [
        c.token_ids for c in eng.generate([lead + b.prompt_ids[-50:]], max_new_tokens=4, ignore_eos=True)
    ]
    assert got[b.rid]["tokens"] == want


def test_a_request_joining_mid_prefill_takes_the_pages_computed_so_far(eng):
    lead = rand_ids(10 * PAGE_SIZE, 15)
    follow = lead[: 5 * PAGE_SIZE] + rand_ids(100, 16)
    a, b = _req(lead), _req(follow)
    got = _drive(eng, [a, b], arrive={1: 14})  # (before step 14: 406 of the leader's 640 tokens computed)
    assert got[b.rid]["cached"] == 5 * PAGE_SIZE
    (want,) = [c.token_ids for c in eng.generate([follow], max_new_tokens=4, ignore_eos=True)]
    assert got[b.rid]["tokens"] == want


def test_no_wait_for_a_score_request(eng):
    """A score request (every position's logits) never uses or fills the prefix cache: nothing waits for it."""
    prompt = rand_ids(200, 18)
    waits = eng.scheduler.num_prefix_waits
    a = Request(
        f"score-{random.random()}", list(prompt), SamplingParams(max_new_tokens=0), return_logits=True
    )
    b = _req(prompt)
    got = _drive(eng, [a, b])
    assert eng.scheduler.num_prefix_waits == waits and got[b.rid]["cached"] == 0
    assert got["_computed"] == 400


PS = 4


def _sched(budget: int, chunk: int) -> Scheduler:
    alloc = PageAllocator(256, PS)
    return Scheduler(alloc, PrefixCache(alloc), max_context=4096, chunk_size=chunk, max_batch_tokens=budget)


def _step(s: Scheduler) -> dict[str, tuple[int, int]]:
    """One step with a made-up token for every sampling row: rid -> (start, tokens) of each row."""
    plan = s.schedule()
    assert plan is not None
    s.update(
        plan,
        BatchResult(plan.step_id, [RowResult(r.rid, 7 if r.logits == "last" else None) for r in plan.rows]),
    )
    return {r.rid: (r.start, len(r.token_ids)) for r in plan.rows}


def test_scheduler_holds_a_follower_until_the_shared_pages_are_computed():
    """Two prefills fit a step (budget 24, chunks of 8): the follower of a running prefill is held, keeping
    its place, while the request behind it (nothing shared) is admitted; once the leader has computed the
    shared pages the follower starts from them."""
    s = _sched(budget=24, chunk=8)
    doc = list(range(100, 100 + 10 * PS))  # 10 full pages
    lead = Request("lead", doc + [1], SamplingParams(max_new_tokens=2))
    follow = Request("follow", doc + [2, 3], SamplingParams(max_new_tokens=2))
    other = Request("other", list(range(500, 530)), SamplingParams(max_new_tokens=2))
    for r in (lead, follow, other):
        s.add(r)
    rows = _step(s)
    assert set(rows) == {"lead", "other"} and [r.rid for r in s.waiting] == ["follow"]
    while lead.num_computed < 10 * PS:
        assert "follow" not in _step(s)
    rows = _step(s)
    assert rows["follow"][0] == 10 * PS and follow.num_cached == 10 * PS
    assert s.stats()["prefix_waits"] >= 5


def test_common_full_pages():
    assert common_full_pages(list(range(20)), list(range(20)), 4) == 5
    assert common_full_pages(list(range(20)), list(range(9)) + [0] * 11, 4) == 2
    assert common_full_pages([1, 2, 3], [1, 2, 3], 4) == 0
    assert common_full_pages([9] + list(range(19)), list(range(20)), 4) == 0
