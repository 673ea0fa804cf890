"""Overlapped decode (step n+1 planned while step n runs, launched before step n's outputs go back):
every observable result equals the one-step-at-a-time engine's, through early stops, stop strings,
context limits, arrivals, aborts and preemption, with and without the decode-graph path."""

from __future__ import annotations

import pytest
import torch

from longctx import Engine
from longctx.engine.request import Request, SamplingParams


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [ids_of(n, n) for n in (7, 70, 130, 5)]


def _engines(tiny_dir, **kw):
    return [Engine(tiny_dir, device="cpu", overlap=ov, **kw) for ov in (False, True)]


@pytest.mark.parametrize("graphs", [False, True])
def test_generate_matches_and_overlaps(tiny_dir, graphs):
    base, ov = _engines(tiny_dir, cuda_graphs=graphs)
    with base, ov:
        assert ov.overlap and not base.overlap
        want = [o.token_ids for o in base.generate(PROMPTS, max_new_tokens=10)]
        got = [o.token_ids for o in ov.generate(PROMPTS, max_new_tokens=10)]
        assert got == want
        assert ov.stats()["overlapped_steps"] > 0 and base.stats()["overlapped_steps"] == 0
        # the continuations took their tokens from the device samples: no wait for the host between steps
        assert ov.stats()["device_fed_steps"] > 0 and base.stats()["device_fed_steps"] == 0
        # an early stop on a token one request produces mid-way, and seeded sampling
        stop = want[1][3]
        kw = dict(max_new_tokens=12, stop=[stop], temperature=0.8, seed=11)
        a = [(o.token_ids, o.finish_reason) for o in base.generate(PROMPTS, **kw)]
        b = [(o.token_ids, o.finish_reason) for o in ov.generate(PROMPTS, **kw)]
        assert a == b
        # no page is left behind by the continuations of requests that stopped
        assert ov.allocator.num_used == base.allocator.num_used


def test_logprobs_continuations_wait_for_the_host(tiny_dir):
    """A step whose logits are read back (logprobs) is not followed by a device-fed continuation
    (the next replay would overwrite its logits); tokens and logprobs equal the plain engine's."""

    def run(eng):
        for i, p in enumerate(PROMPTS[:2]):
            eng.add_request(
                Request(f"r{i}", p, SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2))
            )
        got: dict[str, list] = {}
        while eng.has_work():
            for o in eng.step():
                got.setdefault(o.rid, []).extend((lp.token_id, round(lp.logprob, 5)) for lp in o.logprobs)
        return got

    base, ov = _engines(tiny_dir, cuda_graphs=True)
    with base, ov:
        assert run(ov) == run(base)
        assert ov.stats()["overlapped_steps"] > 0 and ov.stats()["device_fed_steps"] == 0


def test_stop_strings_and_context_limit(tiny_dir):
    base, ov = _engines(tiny_dir, max_context=140)
    with base, ov:
        text = base.generate(PROMPTS[:1], max_new_tokens=8)[0]
        stop = base.tokenizer.decode(text.token_ids[2:4])
        kw = dict(max_new_tokens=20, stop=[stop])
        a = [(o.token_ids, o.text, o.finish_reason) for o in base.generate(PROMPTS, **kw)]
        b = [(o.token_ids, o.text, o.finish_reason) for o in ov.generate(PROMPTS, **kw)]
        assert a == b  # PROMPTS[2] (130 tokens) also hits max_context 140 on the way


@pytest.mark.parametrize("graphs", [False, True])
def test_bad_words_under_overlap(tiny_dir, graphs):
    """Bad words of several tokens: what step n+1 may not draw depends on step n's token, so the
    continuation's forward is launched device-fed and its draw waits for step n's tokens; the tokens
    are the engine's without overlap."""
    base, ov = _engines(tiny_dir, cuda_graphs=graphs)
    with base, ov:
        letters = dict(max_new_tokens=10, ignore_eos=True, allowed_token_ids=[97, 98, 99, 100])
        free = base.generate(PROMPTS[:1], **letters)[0]
        kw = dict(letters, bad_words=[free.text[3:5]])
        a = [o.token_ids for o in base.generate(PROMPTS, **kw)]
        b = [o.token_ids for o in ov.generate(PROMPTS, **kw)]
        assert a == b and a[0] != free.token_ids
        assert ov.stats()["device_fed_steps"] > 0 and ov.stats()["launched_ahead"] > 0
        # arrivals and aborts between steps launched ahead: every request as without overlap
        p = SamplingParams(max_new_tokens=15, ignore_eos=True, bad_words=[free.text[3:5]])
        assert _drive(ov, p) == _drive(base, p)


def test_a_failed_late_draw_keeps_the_finished_steps_outputs(tiny_dir, monkeypatch):
    """A continuation whose draw was queued late (a guided row) and failed: step n's outputs are
    delivered, the next step raises, and the engine serves the next request."""
    with Engine(tiny_dir, device="cpu", overlap=True) as eng:
        p = SamplingParams(max_new_tokens=8, guided=("regex", "[a-z]{8}"))
        eng.add_request(Request("a", PROMPTS[0], p))
        assert eng.step()[0].new_token_ids  # prefill
        assert eng.step()[0].new_token_ids  # a decode step; its continuation is launched
        monkeypatch.setattr(eng.runner, "sample", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("lost")))
        second = eng.step()
        assert second and second[0].new_token_ids
        with pytest.raises(RuntimeError, match="lost"):
            eng.step()
        assert eng.fail_step() == ["a"]
        monkeypatch.undo()
        out = eng.generate([PROMPTS[1]], max_new_tokens=8, guided_regex="[a-z]{8}")[0]
        assert len(out.token_ids) == 8 and out.finish_reason == "stop"


def _drive(eng: Engine, p: SamplingParams | None = None) -> dict[str, list]:
    """Step API: requests arrive while others decode; one is aborted mid-way."""
    got: dict[str, list] = {}
    p = p or SamplingParams(max_new_tokens=15, ignore_eos=True)
    eng.add_request(Request("a", PROMPTS[0], p))
    eng.add_request(Request("b", PROMPTS[3], p))
    steps = 0
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                got[o.rid].append(o.finish_reason)
        steps += 1
        if steps == 4:
            eng.add_request(Request("c", PROMPTS[1], p))
        if steps == 7:
            eng.abort("b")
            got.setdefault("b", []).append("aborted")
    return got


def test_step_api_arrivals_and_aborts(tiny_dir):
    base, ov = _engines(tiny_dir)
    with base, ov:
        assert _drive(ov) == _drive(base)
        assert ov.stats()["overlapped_steps"] > 0
        assert ov.allocator.num_used == base.allocator.num_used


def test_preemption_under_page_pressure(tiny_dir):
    prompts = [ids_of(120, 20 + i) for i in range(4)]
    base, ov = _engines(tiny_dir, kv_pages=10)  # 640 tokens for 4 x 190
    with base, ov:
        kw = dict(max_new_tokens=70, ignore_eos=True)
        want = [o.token_ids for o in base.generate(prompts, **kw)]
        got = [o.token_ids for o in ov.generate(prompts, **kw)]
        assert got == want
        assert ov.scheduler.num_preempted > 0 and ov.stats()["overlapped_steps"] > 0
        assert ov.stats()["pages_used"] == ov.prefix_cache.num_cached_pages


def test_a_failed_launch_keeps_the_finished_steps_outputs(tiny_dir, monkeypatch):
    with Engine(tiny_dir, device="cpu", overlap=True) as eng:
        eng.add_request(Request("a", PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True)))
        assert eng.step()[0].new_token_ids  # prefill (no continuation after a prefill row)
        assert eng.step()[0].new_token_ids  # a decode step; its continuation is launched
        assert eng._pending is not None
        real = eng.runner.launch

        def boom(plan, tokens=None, sample=True):
            raise RuntimeError("device lost")

        monkeypatch.setattr(eng.runner, "launch", boom)
        second = eng.step()  # resolves the launched step: its token is delivered despite the failure
        assert second and second[0].new_token_ids
        with pytest.raises(RuntimeError, match="device lost"):
            eng.step()
        monkeypatch.setattr(eng.runner, "launch", real)


def test_real_server_with_overlap(tiny_dir):
    """The HTTP server's engine loop with overlap on (forced on CPU): concurrent greedy streams give
    the engine's tokens, and a client that disconnects mid-stream still frees its pages."""
    import concurrent.futures as cf

    import httpx

    from longctx.server.testing import ServerProcess

    from .server_helpers import check_disconnect_frees_pages

    prompts = ["The capital of France is", "Once upon a time", "abc"]
    with Engine(tiny_dir, device="cpu", overlap=False) as eng:
        want = [c.text for c in eng.generate(prompts, max_new_tokens=6, ignore_eos=True)]
    with ServerProcess(
        str(tiny_dir), "--device", "cpu", "--max-context", "2048", env={"LONGCTX_OVERLAP": "1"}
    ) as s:

        def complete(p: str) -> str:
            body = {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with cf.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(complete, prompts))
        assert got == want
        body = {"prompt": "x" * 300, "max_tokens": 400, "stream": True, "ignore_eos": True}
        check_disconnect_frees_pages(s, body, after_events=3, http_timeout=60, free_within=20)
        assert httpx.get(s.url + "/v1/stats", timeout=30).json()["overlapped_steps"] > 0


def test_take_rows_reads_host_row_lists_without_indexing_by_list():
    from longctx.engine.worker import take_rows

    t = torch.randn(5, 7)
    assert take_rows(t, [0, 1, 2, 3, 4]) is t  # every row in order: no copy, no index transfer
    assert torch.equal(take_rows(t, [4, 1]), t[[4, 1]])
    assert take_rows(t, []).shape == (0, 7)
