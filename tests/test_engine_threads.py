"""One Engine shared by several threads: blocking calls made at once batch together and each gets exactly
its own results; the step API and a close from another thread stay coherent."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from longctx import Engine
from longctx.engine.request import Request, SamplingParams
from longctx.errors import RequestError
from tests.conftest import rand_ids, rel


def _together(fns: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    """Run `fns` in threads started at the same moment; their results (an exception re-raised)."""
    start = threading.Barrier(len(fns))
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = ("ok", fns[i]())
        except BaseException as e:  # re-raised in the test's thread
            out[i] = ("err", e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    for kind, v in out:
        if kind == "err":
            raise v
    return [v for _, v in out]


def _running_peak(eng: Engine) -> list[int]:
    """Record the number of running requests after each step (the batch the threads share)."""
    peak = [0]
    step = eng._step

    def counting() -> list:
        outs = step()
        peak[0] = max(peak[0], len(eng.scheduler.running))
        return outs

    eng._step = counting  # type: ignore[method-assign]
    return peak


def test_threads_generating_at_once_batch_and_get_their_own_tokens(tiny_dir) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    prompts = [rand_ids(int(torch.randint(5, 90, (), generator=g)), 100 + i) for i in range(6)]
    news = [int(torch.randint(3, 14, (), generator=g)) for _ in prompts]
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        alone = [
            eng.generate([p], max_new_tokens=n, ignore_eos=True)[0].token_ids
            for p, n in zip(prompts, news, strict=True)
        ]
        peak = _running_peak(eng)
        calls = [
            (lambda p=p, n=n: eng.generate([p], max_new_tokens=n, ignore_eos=True)[0].token_ids)
            for p, n in zip(prompts, news, strict=True)
        ]
        got = _together(calls)
        assert got == alone
        assert peak[0] >= 2  # the threads' requests ran in shared steps, not one call after another
        assert eng.num_running() == eng.num_waiting() == 0 and not eng._mail and not eng._held


def test_score_generate_and_the_step_api_from_threads(tiny_dir) -> None:
    """A score, two generates and a step-API caller (add_request + step) at once: each gets its own
    outputs (the step-API caller every token of its request, none of the blocking calls')."""
    ids = rand_ids(70, 7)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        want_score = eng.score(ids)
        want_a = eng.generate([ids[:30]], max_new_tokens=9, ignore_eos=True)[0].token_ids
        want_b = eng.generate([ids[20:]], max_new_tokens=5, ignore_eos=True)[0].token_ids
        want_c = eng.generate([ids[5:50]], max_new_tokens=8, ignore_eos=True)[0].token_ids

        def stepper() -> list[int]:
            eng.add_request(Request("api-0", ids[5:50], SamplingParams(max_new_tokens=8, ignore_eos=True)))
            toks: list[int] = []
            for _ in range(10_000):
                for o in eng.step():
                    assert o.rid == "api-0", o.rid  # never a blocking call's output
                    toks += o.new_token_ids
                    if o.finished:
                        return toks
            raise AssertionError("the step-API request never finished")

        s, a, b, c = _together(
            [
                lambda: eng.score(ids),
                lambda: eng.generate([ids[:30]], max_new_tokens=9, ignore_eos=True)[0].token_ids,
                lambda: eng.generate([ids[20:]], max_new_tokens=5, ignore_eos=True)[0].token_ids,
                stepper,
            ]
        )
    assert rel(s, want_score) <= 1e-5
    assert (a, b, c) == (want_a, want_b, want_c)


def test_a_failing_call_in_one_thread_leaves_the_others_running(tiny_dir) -> None:
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        p = rand_ids(40, 3)
        want = eng.generate([p], max_new_tokens=6, ignore_eos=True)[0].token_ids

        def bad() -> None:
            eng.generate([[10**9]], max_new_tokens=3)

        calls = [lambda: eng.generate([p], max_new_tokens=6, ignore_eos=True)[0].token_ids] * 3
        results = _together([*calls, lambda: pytest.raises(RequestError, bad)])
        assert results[:3] == [want] * 3
        assert eng.num_running() == eng.num_waiting() == 0 and not eng._mail


def test_close_from_another_thread_ends_a_running_generate_with_an_error(tiny_dir) -> None:
    eng = Engine(tiny_dir, device="cpu", chunk_size=29)
    started = threading.Event()
    step = eng._step

    def marking() -> list:
        started.set()
        return step()

    eng._step = marking  # type: ignore[method-assign]

    def long_generate() -> str:
        try:
            eng.generate([rand_ids(60, 1)], max_new_tokens=100_000 // 100, ignore_eos=True)
        except RequestError as e:
            return str(e)
        return "finished"

    def closer() -> None:
        assert started.wait(60)
        eng.close()

    msg, _ = _together([long_generate, closer])
    assert msg == "the engine is closed"
    with pytest.raises(RequestError, match="closed"):
        eng.score([1, 2, 3])


def test_a_failed_step_fails_every_request_it_held_and_the_engine_goes_on(tiny_dir) -> None:
    """A step that raises in one thread's call fails the requests of every call in it (their KV may be
    half-written): each thread's call raises the step's error, a step-API request gets a finished output
    carrying it, nothing stays queued, and the next calls run as on a fresh engine."""
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        p, q = rand_ids(80, 1), rand_ids(70, 2)
        want = [eng.generate([x], max_new_tokens=6, ignore_eos=True)[0].token_ids for x in (p, q)]
        run, raised = eng.runner.run, [False]
        both = threading.Barrier(2)

        def failing(plan):  # type: ignore[no-untyped-def]
            gens = [r for r in eng.scheduler.running if r.rid.startswith("gen-")]
            if len(gens) == 2 and not raised[0]:  # the first step holding both threads' requests
                raised[0] = True
                raise RuntimeError("device fault")
            return run(plan)

        eng.runner.run = failing
        eng.add_request(Request("api-0", q, SamplingParams(max_new_tokens=50, ignore_eos=True)))

        def call(x: list[int]) -> str:
            both.wait()
            try:
                eng.generate([x], max_new_tokens=50, ignore_eos=True)
            except (RuntimeError, RequestError) as e:
                return str(e)
            return "finished"

        got = _together([lambda: call(p), lambda: call(q)])
        assert all(g.endswith("device fault") for g in got), got  # (the other thread's: "RuntimeError: ...")
        api = [o for o in eng.step() if o.rid == "api-0"]
        assert api and api[-1].finished and api[-1].error == "RuntimeError: device fault"
        assert eng.num_running() == eng.num_waiting() == 0 and not eng._mail
        eng.runner.run = run
        assert [eng.generate([x], max_new_tokens=6, ignore_eos=True)[0].token_ids for x in (p, q)] == want


def test_the_step_api_drivers_contract(tiny_dir, caplog) -> None:
    """What AsyncEngine relies on beyond the public API: `admit` draws ids and refuses as `add_request`
    does, `has_held_outputs` and `lost` tell what the engine still holds of step-API requests (a finished
    one's last output kept for `step()` included), and `watch` calls after a step that ran, an abort, an
    unpin and close, not after a step that found nothing to run."""
    p, q = rand_ids(40, 1), rand_ids(30, 2)
    eng = Engine(tiny_dir, device="cpu", chunk_size=29)
    calls = [0]

    def count() -> None:
        calls[0] += 1

    def failing() -> None:
        raise RuntimeError("a watcher's bug")

    eng.watch(count)
    eng.watch(failing)  # (logged; the steps it is called from go on)
    assert eng.step() == [] and calls[0] == 0  # nothing to run: nothing changed

    # admit: an id drawn for the kind, none the engine has; refusals leave nothing behind
    eng.add_request(Request("api-0", p, SamplingParams(max_new_tokens=2, ignore_eos=True)))
    drawn = Request("", q, SamplingParams(max_new_tokens=2))
    eng.admit(drawn, "api")
    assert drawn.rid.startswith("api-") and drawn.rid != "api-0"
    with pytest.raises(RequestError, match="duplicate request id 'api-0'"):
        eng.admit(Request("api-0", q, SamplingParams()))
    with pytest.raises(RequestError, match="is outside the vocabulary"):
        eng.admit(Request("bad", [10**9], SamplingParams()), "bad")
    assert eng.num_waiting() == 2
    eng.abort(drawn.rid)
    assert calls[0] == 1

    # a blocking call steps api-0 to its end: its outputs are held for step(), so it is not lost
    assert not eng.has_held_outputs()
    eng.generate([q], max_new_tokens=6, ignore_eos=True)
    assert calls[0] > 1 and "a watcher's bug" in caplog.text
    assert eng.has_held_outputs() and "api-0" not in eng._requests
    assert eng.lost(["api-0", drawn.rid, "never"]) == [drawn.rid, "never"]
    outs = eng.step()  # (the held outputs, without a step)
    assert outs[-1].rid == "api-0" and outs[-1].finished
    assert not eng.has_held_outputs() and eng.lost(["api-0"]) == ["api-0"]

    eng.add_request(Request("api-1", p, SamplingParams(max_new_tokens=50)))
    assert eng.lost(["api-1"]) == []
    n = calls[0]
    with eng.turn():  # (reentrant: the engine's own calls inside take it again)
        eng.abort("api-1")
    assert eng.lost(["api-1"]) == ["api-1"] and calls[0] == n + 1
    doc, _ = eng.pin_document(p)
    n = calls[0]
    eng.unpin_document(doc)
    assert calls[0] == n + 1
    eng.unwatch(failing)
    assert not eng.closed
    eng.close()
    assert eng.closed and calls[0] == n + 2
    with pytest.raises(RequestError, match="the engine is closed"):
        eng.admit(Request("late", q, SamplingParams()))
    eng.unwatch(count)
    eng.unwatch(count)  # (one not watching: ignored)
