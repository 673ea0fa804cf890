"""vLLM's priority scheduling (`scheduling_policy="priority"`): requests served by (priority, arrival),
lower first; the victim when pages run out is the running request with the largest key; a waiting head
that does not fit preempts running requests of a strictly lower priority. "fcfs" (the default) keeps
arrival order and refuses a nonzero priority."""

from __future__ import annotations

import httpx
import pytest

from longctx import Engine
from longctx.engine.plan import BatchResult, RowResult
from longctx.engine.request import Request, SamplingParams
from longctx.engine.scheduler import Scheduler
from longctx.errors import ConfigError, RequestError
from longctx.kvstore.allocator import PageAllocator
from tests.conftest import rand_ids

from .server_helpers import fake_server

PS = 4  # page size of the scheduler-level pools


def _sched(pages: int, policy: str = "priority", budget: int = 16) -> Scheduler:
    alloc = PageAllocator(pages, PS)
    return Scheduler(
        alloc, None, max_context=256, chunk_size=budget, max_batch_tokens=budget, scheduling_policy=policy
    )


def _req(rid: str, n_prompt: int, priority: int = 0, new: int = 10) -> Request:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, priority=priority)
    return Request(rid, list(range(10, 10 + n_prompt)), params)


def _step(s: Scheduler) -> list[str]:
    """One step with a made-up token for every sampling row: the rids of its rows, in order."""
    plan = s.schedule()
    assert plan is not None
    s.update(
        plan,
        BatchResult(plan.step_id, [RowResult(r.rid, 7 if r.logits == "last" else None) for r in plan.rows]),
    )
    return [r.rid for r in plan.rows]


def _ids(reqs: object) -> list[str]:
    return [r.rid for r in reqs]  # type: ignore[attr-defined]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    """Each arrival takes its (priority, arrival) place in the queue; a step with room for one prompt
    admits the lowest priority value first, equal priorities in arrival order."""
    s = _sched(pages=64, budget=8)
    for rid, prio in (("late", 2), ("a", 0), ("b", 1), ("c", 0), ("neg", -1)):
        s.add(_req(rid, 8, prio))
    assert _ids(s.waiting) == ["neg", "a", "c", "b", "late"]
    admitted = [_step(s)[-1] for _ in range(5)]
    assert admitted == ["neg", "a", "c", "b", "late"]


def _victim_setup(s: Scheduler, prios: tuple[int, int, int]) -> None:
    """b admitted alone, then a and c: 4 pages of 4, all used; the next step's decodes need 2 more."""
    s.add(_req("b", 4, prios[0]))
    _step(s)
    s.add(_req("a", 4, prios[1]))
    s.add(_req("c", 4, prios[2]))
    _step(s)
    assert _ids(s.running) == ["b", "a", "c"] and s.alloc.num_free == 0


def test_the_victim_is_the_running_request_with_the_largest_key():
    """b (priority 2) was admitted first; when pages run out it is preempted, not c (the last admitted),
    and the higher-priority decodes are served; it waits, and preempts nobody for its way back."""
    s = _sched(pages=4)
    _victim_setup(s, (2, 0, 1))
    assert _step(s) == ["a", "c"]
    assert s.num_preempted == 1 and _ids(s.waiting) == ["b"] and _ids(s.running) == ["a", "c"]


def test_fcfs_is_unchanged():
    """Under fcfs the same pressure preempts the most recently admitted request, which goes back to the
    queue's head; and a nonzero priority is refused."""
    s = _sched(pages=4, policy="fcfs")
    _victim_setup(s, (0, 0, 0))
    assert _step(s) == ["b", "a"]
    assert s.num_preempted == 1 and _ids(s.waiting) == ["c"]
    s.add(_req("d", 4))
    assert _ids(s.waiting) == ["c", "d"]
    with pytest.raises(RequestError, match="priority 3: .*first come, first served") as e:
        s.add(_req("e", 4, priority=3))
    assert e.value.param == "priority"


def _full_of(s: Scheduler, prio: int) -> None:
    """Two running requests of 7 prompt tokens each (2 pages each, room for their next token): the 4-page
    pool is full."""
    s.add(_req("l1", 7, prio, new=8))
    s.add(_req("l2", 7, prio, new=8))
    _step(s)
    assert s.alloc.num_free == 0


def test_a_higher_priority_arrival_preempts_the_lowest_priority_running_request():
    """h (priority 0) does not fit: the running request with the largest key (l2, the later of two at
    priority 5) is preempted for it, only as many as it needs, and h is admitted in that step."""
    s = _sched(pages=4)
    _full_of(s, 5)
    s.add(_req("h", 4, 0))
    assert _step(s) == ["l1", "h"]
    assert s.num_preempted == 1 and _ids(s.waiting) == ["l2"] and _ids(s.running) == ["l1", "h"]


@pytest.mark.parametrize("prio", [5, 9])
def test_no_preemption_for_an_equal_or_lower_priority(prio):
    """An arrival of the running requests' priority, or a lower one, waits for pages."""
    s = _sched(pages=4)
    _full_of(s, 5)
    s.add(_req("h", 4, prio))
    assert _step(s) == ["l1", "l2"]
    assert s.num_preempted == 0 and _ids(s.waiting) == ["h"]


def test_prefill_chunks_are_served_by_priority():
    """Two running prefills with a budget of one chunk: the higher priority's chunk comes first, though
    it arrived later."""
    s = _sched(pages=64, budget=8)
    s.add(_req("low", 40, 3))
    _step(s)
    s.add(_req("high", 40, 1))
    rows = _step(s)  # (low's chunk leaves half the budget to the admission behind it)
    assert rows == ["low", "high"]
    assert _step(s)[0] == "high"


def test_an_unknown_policy_is_refused(tiny_dir):
    with pytest.raises(ConfigError, match="scheduling_policy 'lifo': must be 'fcfs' or 'priority'"):
        Engine(tiny_dir, device="cpu", scheduling_policy="lifo")


def test_engine_requests_keep_their_tokens_under_pressure_with_mixed_priorities(tiny_dir):
    """Six requests, mixed priorities, on 6 pages of 64 tokens (each needs 3, running alone): preempted
    and recomputed in every order, each ends with the greedy tokens it gets alone. Under the default
    fcfs a nonzero priority is refused."""
    prompts = [rand_ids(100 + 7 * i, 40 + i) for i in range(6)]
    prios = [3, 0, 2, 0, 1, 3]
    with Engine(tiny_dir, device="cpu", chunk_size=64, kv_pages=6, scheduling_policy="priority") as e:
        alone = [e.generate(p, max_new_tokens=40, ignore_eos=True)[0].token_ids for p in prompts]
        got: dict[str, list[int]] = {}
        for i, (p, prio) in enumerate(zip(prompts, prios, strict=True)):
            params = SamplingParams(max_new_tokens=40, ignore_eos=True, priority=prio)
            e.add_request(Request(f"r{i}", p, params))
            got[f"r{i}"] = []
        while e.has_work():
            for o in e.step():
                got[o.rid] += list(o.new_token_ids)
        assert e.scheduler.num_preempted > 0
    assert [got[f"r{i}"] for i in range(6)] == alone
    with Engine(tiny_dir, device="cpu") as fcfs:
        with pytest.raises(RequestError, match="priority 1") as err:
            fcfs.add_request(Request("x", [1, 2, 3], SamplingParams(priority=1)))
        assert err.value.param == "priority"
        fcfs.add_request(Request("y", [1, 2, 3], SamplingParams(priority=0)))


def test_fcfs_server_answers_a_priority_with_400(tmp_path):
    """Over HTTP (the fake engine schedules first come, first served): a nonzero priority is a 400 naming
    `priority`, in completions and chat; priority 0 is served."""
    with fake_server(tmp_path, "--served-model-name", "fake", step_delay_s=0.0) as s:
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ):
            r = httpx.post(s.url + path, json={**body, "priority": 1})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "priority", r.text
            assert httpx.post(s.url + path, json={**body, "priority": 0}).status_code == 200


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_row_planned_in_the_step_keeps_its_pages(policy):
    """A prefill chunk that runs out of pages never preempts a request already given a row in the same step
    (its pages would go to the chunk while the row still writes its KV there): a is prefilling when b, admitted
    after it, decodes first; with no page left for a's last chunk a itself is preempted (and re-admitted
    from its start in the same step, into its own freed pages), and b's row stands."""
    s = _sched(pages=6, policy=policy, budget=16)
    s.chunk_size = 8
    s.add(_req("a", 20, new=2))
    s.add(_req("b", 4, new=12))
    assert _step(s) == ["a", "b"] and _step(s) == ["b", "a"]
    assert s.alloc.num_free == 0 and _ids(s.running) == ["a", "b"]
    plan = s.schedule()  # b decodes in its page; a's last 4 prompt tokens need a page there is not
    assert plan is not None and [(r.rid, r.start) for r in plan.rows] == [("b", 5), ("a", 0)]
    assert s.num_preempted == 1 and _ids(s.running) == ["b", "a"]
    for r in plan.rows:  # every planned row's request still holds the pages its row writes
        assert r.pages == tuple(s.pages[r.rid].pages[: len(r.pages)])
    assert not set(plan.rows[0].pages) & set(plan.rows[1].pages)


def test_generate_takes_one_priority_or_one_per_prompt(tiny_dir):
    """Engine.generate(priority=): one value for every prompt or a list with one per prompt (vLLM's LLM); the
    tokens are each prompt's alone; a list of the wrong length or a value that is not an integer is refused,
    and under fcfs a nonzero priority is."""
    prompts = [rand_ids(9, seed=1), rand_ids(30, seed=2), rand_ids(5, seed=3)]
    with Engine(tiny_dir, device="cpu", scheduling_policy="priority") as eng:
        alone = [eng.generate(p, max_new_tokens=6)[0].token_ids for p in prompts]
        assert [c.token_ids for c in eng.generate(prompts, max_new_tokens=6, priority=[2, -1, 0])] == alone
        assert [c.token_ids for c in eng.generate(prompts, max_new_tokens=6, priority=3)] == alone
        with pytest.raises(RequestError, match="priority has 2 values for 3 prompts"):
            eng.generate(prompts, priority=[0, 1])
        with pytest.raises(RequestError, match="priority"):
            eng.generate(prompts, priority=[0, 1.5, 0])  # type: ignore[list-item]
    with Engine(tiny_dir, device="cpu") as eng, pytest.raises(RequestError, match="priority"):
        eng.generate(prompts, priority=1)
