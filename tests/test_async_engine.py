"""AsyncEngine over an Engine on the tiny random model (CPU): streams carry exactly the sync path's tokens,
concurrent streams share steps, leaving a stream aborts its request, close ends the streams in flight,
bad input raises the sync path's errors, a failed step fails the streams (and blocking calls) it held and
the engine serves on, and blocking calls from other threads run beside the driver."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from longctx import Engine
from longctx.engine.async_engine import AsyncEngine
from longctx.engine.request import FinishReason, SamplingParams
from longctx.errors import EngineDeadError, RequestError
from tests.conftest import rand_ids, rel

GREEDY = SamplingParams(max_new_tokens=7, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=400, ignore_eos=True)  # (ended early in every test that uses it)


def _run(coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def _tokens(aeng: AsyncEngine, prompt: Any, params: SamplingParams, **kw: Any) -> list[int]:
    return [t async for o in aeng.generate(prompt, params, **kw) for t in o.new_token_ids]


def _counting(eng: Engine) -> dict[str, int]:
    """Count the engine's steps and record the most requests one of them ran."""
    seen = {"steps": 0, "peak": 0}
    step = eng._step

    def counting() -> list:
        outs = step()
        seen["steps"] += 1
        seen["peak"] = max(seen["peak"], len(eng.scheduler.running))
        return outs

    eng._step = counting  # type: ignore[method-assign]
    return seen


def _idle(eng: Engine) -> bool:
    return eng.num_running() == eng.num_waiting() == 0


def test_streams_carry_the_sync_paths_tokens_logits_and_completions(tiny_dir) -> None:
    p = rand_ids(60, 11)  # (prefill chunks of 29 whose progress is streamed first; no full page to reuse)
    seeded = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=3)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        want = eng.generate([p], max_new_tokens=7, ignore_eos=True)[0]
        want_text = eng.generate("Hello there", max_new_tokens=6, ignore_eos=True)[0]
        want_seeded = eng.generate(p[:20], max_new_tokens=8, temperature=0.9, top_p=0.95, seed=3)[0]
        want_logits = eng.score(p)

        async def main() -> Any:
            async with AsyncEngine(eng, close_engine=False) as aeng:
                outs = [o async for o in aeng.generate(p, GREEDY, request_id="r1")]
                text = await aeng.complete("Hello there", SamplingParams(max_new_tokens=6, ignore_eos=True))
                sampled = await aeng.complete(p[:20], seeded)
                logits = await aeng.score(p)
                stats = await aeng.stats()
                reset = await aeng.reset_prefix_cache()
            return outs, text, sampled, logits, stats, reset

        outs, text, sampled, logits, stats, reset = _run(main())
        assert reset["kept_pages"] == 0 and eng.stats()["prefix_cache"]["cached_pages"] == 0
        assert [t for o in outs for t in o.new_token_ids] == want.token_ids
        assert {o.rid for o in outs} == {"r1"}
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
        assert not any(o.finished for o in outs[:-1])
        assert not outs[0].new_token_ids and outs[0].prompt_done < 60  # a prefill chunk's progress
        for got, w in ((text, want_text), (sampled, want_seeded)):
            assert (got.token_ids, got.text, got.finish_reason) == (w.token_ids, w.text, w.finish_reason)
            assert got.prompt_tokens == w.prompt_tokens
        assert rel(logits, want_logits) <= 1e-5
        assert stats["async_streams"] == 0 and stats["running"] == 0
        # close_engine=False: the engine serves on after the AsyncEngine closed
        assert _idle(eng)
        assert eng.generate([p], max_new_tokens=7, ignore_eos=True)[0].token_ids == want.token_ids


def test_concurrent_streams_get_their_own_tokens_in_shared_steps_and_idle_costs_no_steps(tiny_dir) -> None:
    prompts = [rand_ids(n, 100 + i) for i, n in enumerate((12, 40, 75, 33, 5))]
    news = (5, 9, 3, 7, 11)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        alone = [
            eng.generate([p], max_new_tokens=n, ignore_eos=True)[0].token_ids
            for p, n in zip(prompts, news, strict=True)
        ]
        seen = _counting(eng)

        async def main() -> tuple[list[list[int]], int]:
            async with AsyncEngine(eng) as aeng:
                got = await asyncio.gather(
                    *[
                        _tokens(aeng, p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                        for p, n in zip(prompts, news, strict=True)
                    ]
                )
                steps = seen["steps"]
                await asyncio.sleep(0.3)  # nothing in flight: the driver sleeps, it does not poll
                return got, seen["steps"] - steps

        got, idle_steps = _run(main())
        assert got == alone
        assert seen["peak"] >= 3  # the streams ran in shared steps, not one after another
        assert seen["steps"] <= 20  # (14 here; one after another they took over 40)
        assert idle_steps == 0
        assert eng._closed  # (the AsyncEngine closed the engine it was given)


def test_leaving_a_stream_early_aborts_its_request_and_frees_its_pages(tiny_dir) -> None:
    p = rand_ids(40, 5)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        want = eng.generate([p], max_new_tokens=7, ignore_eos=True)[0].token_ids
        used = eng.stats()["pages_used"]  # (what the prefix cache keeps of earlier requests)

        async def gone(aeng: AsyncEngine) -> None:
            await _until(lambda: _idle(eng) and not aeng._live)
            assert eng.stats()["pages_used"] == used and not eng._requests

        async def main() -> None:
            async with AsyncEngine(eng, close_engine=False) as aeng:
                # break (the generator is closed when dropped)
                n = 0
                async for o in aeng.generate(p, LONG, request_id="brk"):
                    n += len(o.new_token_ids)
                    if n >= 2:
                        break
                await gone(aeng)

                # aclose
                agen = aeng.generate(p, LONG)
                async for o in agen:
                    if o.new_token_ids:
                        break
                assert eng.num_running() == 1
                await agen.aclose()  # type: ignore[attr-defined]
                await gone(aeng)

                # a cancelled task consuming a stream
                first = asyncio.Event()

                async def consume() -> None:
                    async for o in aeng.generate(p, LONG):
                        if o.new_token_ids:
                            first.set()

                task = asyncio.create_task(consume())
                await first.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await gone(aeng)

                # a cancelled complete
                done = asyncio.create_task(aeng.complete(p, LONG))
                await _until(lambda: any(r.output_ids for r in list(eng.scheduler.running)))
                done.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await done
                await gone(aeng)

                # AsyncEngine.abort: the stream ends with an abort output
                outs = []
                async for o in aeng.generate(p, LONG, request_id="ab"):
                    outs.append(o)
                    if o.new_token_ids and len(outs) < 100:
                        aeng.abort("ab")
                assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ABORT
                await gone(aeng)

                # the engine serves on, the ids of the aborted requests free again
                assert await _tokens(aeng, p, GREEDY, request_id="brk") == want

        _run(main())


def test_close_ends_the_streams_in_flight_and_never_hangs(tiny_dir) -> None:
    p, q = rand_ids(40, 1), rand_ids(25, 2)
    eng = Engine(tiny_dir, device="cpu", chunk_size=29)
    aeng = AsyncEngine(eng)

    async def consume(aeng: AsyncEngine, prompt: list[int], started: asyncio.Event) -> str:
        try:
            async for o in aeng.generate(prompt, LONG):
                if o.new_token_ids:
                    started.set()
        except RequestError as e:
            return str(e)
        return "finished"

    async def main() -> None:
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(consume(aeng, x, e)) for x, e in zip((p, q), started, strict=True)]
        for e in started:
            await e.wait()
        await asyncio.wait_for(aeng.close(), 30)
        assert await asyncio.gather(*tasks) == ["the engine is closed"] * 2
        assert eng._closed and not aeng._thread.is_alive()
        with pytest.raises(RequestError, match="the engine is closed"):
            await aeng.complete(p, GREEDY)
        with pytest.raises(RequestError, match="the engine is closed"):
            await aeng.score(p)
        await aeng.close()  # (again: nothing to do)

    _run(main())
    with pytest.raises(RequestError, match="the engine is closed"):
        eng.generate([p], max_new_tokens=2)

    # Engine.close from another thread, under a running stream: the stream ends with the same error
    eng = Engine(tiny_dir, device="cpu", chunk_size=29)

    async def closed_under() -> None:
        aeng = AsyncEngine(eng)
        started = asyncio.Event()
        task = asyncio.create_task(consume(aeng, p, started))
        await started.wait()
        await asyncio.to_thread(eng.close)
        assert await task == "the engine is closed"
        with pytest.raises(RequestError, match="the engine is closed"):
            await aeng.complete(p, GREEDY)
        await aeng.close()

    _run(closed_under())


def test_bad_input_raises_the_sync_errors_and_leaves_other_streams_running(tiny_dir, monkeypatch) -> None:
    p = rand_ids(30, 4)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        want = eng.generate([p], max_new_tokens=40, ignore_eos=True)[0].token_ids
        sync_errors = {}
        for name, call in {
            "top_p": lambda: eng.generate([p], top_p=2.0),
            "vocab": lambda: eng.generate([[10**9]]),
            "empty": lambda: eng.generate([[]]),
            "bool": lambda: eng.generate([[True, 5]]),
        }.items():
            with pytest.raises(RequestError) as err:
                call()
            sync_errors[name] = str(err.value)
        validated = []
        validate = SamplingParams.validate

        def counting(self: SamplingParams) -> None:
            validated.append(self)
            validate(self)

        monkeypatch.setattr(SamplingParams, "validate", counting)

        async def main() -> None:
            async with AsyncEngine(eng, close_engine=False) as aeng:
                other = asyncio.create_task(
                    aeng.complete(p, SamplingParams(max_new_tokens=40, ignore_eos=True), request_id="a")
                )
                await _until(lambda: eng.num_running() == 1)
                with pytest.raises(RequestError, match="duplicate request id 'a'"):
                    await aeng.complete(p, GREEDY, request_id="a")
                # at the call: the params, the prompt, the id's type (nothing reaches the engine)
                with pytest.raises(RequestError) as err:
                    aeng.generate(p, SamplingParams(top_p=2.0))
                assert str(err.value) == sync_errors["top_p"]
                with pytest.raises(RequestError, match="params must be SamplingParams, got dict"):
                    aeng.generate(p, {"max_new_tokens": 3})  # type: ignore[arg-type]
                with pytest.raises(RequestError, match="token id True is a bool"):
                    aeng.generate([True, 5])
                with pytest.raises(RequestError, match="request id must be a string, got int"):
                    aeng.generate(p, request_id=5)  # type: ignore[arg-type]
                # at the first step of the stream: what the engine refuses
                with pytest.raises(RequestError) as err:
                    await aeng.complete([10**9])
                assert str(err.value) == sync_errors["vocab"]
                with pytest.raises(RequestError) as err:
                    await aeng.complete([])
                assert str(err.value) == sync_errors["empty"]
                assert eng.num_running() == 1 and not other.done()  # (the errors were raised beside it)
                validated.clear()
                done = (await other).token_ids
                assert len(validated) == 0  # (checked at its call, before this count started)
                assert done == want
                await aeng.complete(p, GREEDY)
                assert validated == [GREEDY]  # once per call
                assert _idle(eng) and not aeng._live

        _run(main())


@pytest.mark.parametrize("where", ["driver", "blocking"])
def test_a_failed_step_ends_the_streams_it_held_and_the_engine_serves_on(tiny_dir, where) -> None:
    """The step holding two streams' requests and a blocking call's (another thread) raises, run by the
    driver or by the blocking call's thread: both streams and the blocking call end with its error, and
    the next requests run as on a fresh engine."""
    p, q, r = rand_ids(20, 1), rand_ids(25, 2), rand_ids(15, 3)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        want = [eng.generate([x], max_new_tokens=6, ignore_eos=True)[0].token_ids for x in (p, q, r)]
        aeng = AsyncEngine(eng, close_engine=False)
        run, raised = eng.runner.run, []

        def failing(plan):  # type: ignore[no-untyped-def]
            rids = {req.rid for req in eng.scheduler.running}
            on_driver = threading.current_thread() is aeng._thread
            if (
                not raised
                and {"x", "y"} <= rids
                and any(r.startswith("gen-") for r in rids)
                and on_driver == (where == "driver")
            ):
                raised.append(plan)
                raise RuntimeError("device fault")
            return run(plan)

        eng.runner.run = failing

        def blocking() -> str:
            try:
                eng.generate([r], max_new_tokens=LONG.max_new_tokens, ignore_eos=True)
            except RequestError as e:
                return str(e)
            except RuntimeError as e:  # (the thread that ran the step raises its error as is)
                return f"RuntimeError: {e}"
            return "finished"

        async def stream(x: list[int], rid: str) -> str:
            try:
                await _tokens(aeng, x, LONG, request_id=rid)
            except RequestError as e:
                return str(e)
            return "finished"

        async def main() -> None:
            got = await asyncio.gather(stream(p, "x"), stream(q, "y"), asyncio.to_thread(blocking))
            assert raised and got == ["RuntimeError: device fault"] * 3, got
            assert _idle(eng) and not eng._mail and not aeng._live
            eng.runner.run = run
            again = await asyncio.gather(
                _tokens(aeng, p, SamplingParams(max_new_tokens=6, ignore_eos=True), request_id="x"),
                _tokens(aeng, q, SamplingParams(max_new_tokens=6, ignore_eos=True)),
                asyncio.to_thread(lambda: eng.generate([r], max_new_tokens=6, ignore_eos=True)[0].token_ids),
            )
            assert again == want
            await aeng.close()

        _run(main())


def test_a_dead_engine_ends_every_stream_and_refuses_new_ones(tiny_dir) -> None:
    p = rand_ids(20, 1)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        run = eng.runner.run

        def dead(plan):  # type: ignore[no-untyped-def]
            if len(plan.rows) == 2:
                raise EngineDeadError("stage 1 died")
            return run(plan)

        eng.runner.run = dead

        async def main() -> None:
            async with AsyncEngine(eng, close_engine=False) as aeng:
                got = await asyncio.gather(
                    *[_tokens(aeng, x, LONG) for x in (p, p[:9])], return_exceptions=True
                )
                assert [type(e) for e in got] == [EngineDeadError] * 2 and str(got[0]) == "stage 1 died"
                with pytest.raises(EngineDeadError, match="stage 1 died"):
                    await aeng.complete(p, GREEDY)

        _run(main())


def test_streams_and_blocking_calls_of_other_threads_run_together(tiny_dir) -> None:
    """Streams, blocking generates and a score from other threads at once: each gets exactly its own
    outputs, whichever thread ran the step, and they share steps."""
    ids = rand_ids(70, 7)
    with Engine(tiny_dir, device="cpu", chunk_size=29) as eng:
        want_score = eng.score(ids)
        parts = [ids[:30], ids[20:], ids[5:50], ids[40:]]
        news = [9, 5, 8, 6]
        want = [
            eng.generate([x], max_new_tokens=n, ignore_eos=True)[0].token_ids
            for x, n in zip(parts, news, strict=True)
        ]
        seen = _counting(eng)

        def blocking(x: list[int], n: int) -> list[int]:
            return eng.generate([x], max_new_tokens=n, ignore_eos=True)[0].token_ids

        async def main() -> list[Any]:
            async with AsyncEngine(eng, close_engine=False) as aeng:
                return await asyncio.gather(
                    _tokens(aeng, parts[0], SamplingParams(max_new_tokens=news[0], ignore_eos=True)),
                    asyncio.to_thread(blocking, parts[1], news[1]),
                    _tokens(aeng, parts[2], SamplingParams(max_new_tokens=news[2], ignore_eos=True)),
                    asyncio.to_thread(blocking, parts[3], news[3]),
                    asyncio.to_thread(eng.score, ids),
                    aeng.score(ids),
                )

        *tokens, s1, s2 = _run(main())
        assert tokens == want
        assert rel(s1, want_score) <= 1e-5 and rel(s2, want_score) <= 1e-5
        assert seen["peak"] >= 3
        assert _idle(eng) and not eng._mail and not eng._held

        async def beside_a_stream() -> int:
            """A blocking call made while a stream runs takes its turns at the lock (`TurnLock`): it is
            done within a few of the stream's steps, not when the driver happens to let go."""
            async with AsyncEngine(eng, close_engine=False) as aeng:
                n = 0
                async for o in aeng.generate(parts[0], LONG):
                    n += len(o.new_token_ids)
                    if n == 1:
                        got = await asyncio.to_thread(blocking, parts[1], news[1])
                        assert got == want[1]
                        return seen["steps"] - steps
                raise AssertionError("the stream finished first")

        steps = seen["steps"]
        assert _run(beside_a_stream()) <= 15  # (9 or 10: its prefill and 5 tokens; 10 to over 100 before)


def test_a_stalled_driver_sleeps_until_the_engine_changes(tiny_dir, monkeypatch) -> None:
    """A stream whose request waits for pages a blocking call of another thread holds (a pinned document)
    costs no steps while nothing changes: the driver sleeps until the engine reports a change
    (`Engine.watch`: here an `Engine.abort` and an `unpin_document` from other threads), not on a timer.
    Polling every 2 ms, as it did before, took over 200 steps in the half second below."""
    from longctx.engine import async_engine

    monkeypatch.setattr(async_engine, "_STALLED_WAIT_S", 30.0)  # (the safety net out of the way)
    doc, p, q = rand_ids(192, 9), rand_ids(100, 3), rand_ids(90, 4)
    # 4 pages: the document pins 3, and a first prefill chunk of 90 or 100 tokens needs 2
    with Engine(tiny_dir, device="cpu", chunk_size=128, kv_pages=4) as eng:
        want = eng.generate([p], max_new_tokens=5, ignore_eos=True)[0].token_ids
        steps = [0]
        step = eng.step

        def counting() -> list:
            steps[0] += 1
            return step()

        eng.step = counting  # type: ignore[method-assign]

        async def main() -> None:
            async with AsyncEngine(eng, close_engine=False) as aeng:
                doc_id, _ = await asyncio.to_thread(eng.pin_document, doc)
                # aborted through Engine.abort by another thread: the stream ends at once
                lost = asyncio.create_task(aeng.complete(q, GREEDY, request_id="q"))
                await _until(lambda: eng.num_waiting() == 1)
                await asyncio.to_thread(eng.abort, "q")
                assert (await asyncio.wait_for(lost, 10)).finish_reason == "abort"

                task = asyncio.create_task(
                    aeng.complete(p, SamplingParams(max_new_tokens=5, ignore_eos=True))
                )
                await _until(lambda: eng.num_waiting() == 1)
                before = steps[0]
                await asyncio.sleep(0.5)
                assert steps[0] - before <= 2  # (the step that found it stalled, if it came after `before`)
                assert not task.done()
                await asyncio.to_thread(eng.unpin_document, doc_id)  # its pages can be evicted now
                assert (await asyncio.wait_for(task, 10)).token_ids == want

        _run(main())


def test_a_new_guide_compiles_off_the_driver_while_other_streams_step(tiny_dir, monkeypatch) -> None:
    """A stream with a guide the engine has not compiled waits for it on a worker thread; the driver steps the
    other streams meanwhile, the guided stream then gets Engine.generate's tokens, and a bad guide raises."""
    import re

    from longctx.engine.guided import GuideCache

    gate = threading.Event()
    real = GuideCache._compile
    monkeypatch.setattr(GuideCache, "_compile", staticmethod(lambda k, s: (gate.wait(10), real(k, s))[1]))
    regex = "[a-f]{4}"
    guided = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, guided=("regex", regex))
    with Engine(tiny_dir, device="cpu") as eng:
        seen = _counting(eng)

        async def main() -> list[int]:
            async with AsyncEngine(eng) as aeng:
                plain = asyncio.ensure_future(_tokens(aeng, rand_ids(9, 1), LONG))
                g = asyncio.ensure_future(_tokens(aeng, "key: ", guided))
                await _until(lambda: seen["steps"] >= 5)  # (stepping while the guide is held)
                assert not g.done() and eng.num_running() == 1
                gate.set()
                got = await g
                with pytest.raises(RequestError, match="lookarounds"):
                    await _tokens(aeng, "x", SamplingParams(guided=("regex", "(?=a)")))
                plain.cancel()
                return got

        got = _run(main())
    with Engine(tiny_dir, device="cpu") as eng:  # (the async engine closed the first)
        want = eng.generate("key: ", max_new_tokens=12, temperature=0.8, seed=5, guided_regex=regex)[0]
    assert got == want.token_ids and re.fullmatch(regex, bytes(got).decode())
