"""Presence / frequency / repetition penalties: the last stage's device state against the reference,
through the engine (greedy tokens equal a step-by-step reference over `Engine.score`), under
preemption, across pipeline stages, and over HTTP."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from longctx import Engine
from longctx.engine.plan import RowPlan
from longctx.engine.request import SamplingParams
from longctx.engine.sampling import Penalties, penalise_row_ref, sample_rows_device
from longctx.errors import RequestError
from tests.conftest import rand_ids

VOCAB = 50
STRONG = dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=4.0)


def _row(rid: str, step: int, prompt: list[int] = (), **kw) -> RowPlan:  # type: ignore[assignment]
    return RowPlan(rid=rid, token_ids=(0,), start=0, pages=(), step=step, penalty_prompt=tuple(prompt), **kw)


@pytest.mark.parametrize("seed,backend", [(0, "torch"), (1, "torch"), (2, "torch"), (3, "triton")])
def test_penalties_match_the_reference(seed, backend):
    """Rows of several requests, each with its own penalties and history, over many steps (a step
    sampled twice keeps the second token; halfway a request is rewound two steps and samples them anew):
    the penalised logits equal `penalise_row_ref` on each row, through the torch form and the kernel
    (interpreted)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pen = Penalties()
    reqs = {
        "a": dict(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.0),
        "b": dict(presence_penalty=0.0, frequency_penalty=-0.5, repetition_penalty=1.7),
        "c": dict(presence_penalty=-1.0, frequency_penalty=0.0, repetition_penalty=0.6),
    }
    prompts = {rid: [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for rid in reqs}
    outs: dict[str, list[int]] = {rid: [] for rid in reqs}
    steps = {rid: 0 for rid in reqs}
    for it in range(12):
        if it == 7:  # "b" takes back its last two tokens
            steps["b"] -= 2
            del outs["b"][-2:]
        rows = [_row(rid, steps[rid], prompts[rid] if it == 0 else (), **kw) for rid, kw in reqs.items()]
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        got = pen.apply(logits, rows, range(len(rows)), backend)
        for i, rid in enumerate(reqs):
            want = penalise_row_ref(logits[i], prompts[rid], outs[rid], **reqs[rid])
            assert torch.allclose(got[i], want, atol=1e-5), (rid, it)
        toks = torch.tensor([rng.randrange(VOCAB) for _ in rows])
        if it == 5:  # the same step sampled again: the second token replaces the first
            pen.record(torch.tensor([rng.randrange(VOCAB) for _ in rows]), rows, range(len(rows)))
        pen.record(toks, rows, range(len(rows)))
        for rid, t in zip(reqs, toks.tolist()):
            outs[rid].append(t)
            steps[rid] += 1
    assert len(pen) == 3
    pen.release(["a", "b", "c"])
    assert len(pen) == 0


def test_rows_without_penalties_are_untouched_and_penalised_rows_need_state():
    logits = torch.randn(2, VOCAB)
    rows = [_row("x", 0), _row("y", 0, [1, 2], repetition_penalty=2.0)]
    pen = Penalties()
    toks = sample_rows_device(logits, rows, pen)
    assert toks[0] == logits[0].argmax()
    assert toks[1] == penalise_row_ref(logits[1], [1, 2], [], 0.0, 0.0, 2.0).argmax()
    with pytest.raises(ValueError, match="need the last stage"):
        sample_rows_device(logits, rows)
    with pytest.raises(ValueError, match="only 0 were recorded"):  # a step with no history before it
        Penalties().apply(logits, [_row("z", 3, frequency_penalty=1.0)], [0])


def _reference_greedy(eng: Engine, prompt: list[int], n: int, **kw) -> list[int]:
    """Greedy tokens with penalties, one `Engine.score` of the whole sequence per token."""
    out: list[int] = []
    for _ in range(n):
        last = eng.score(prompt + out)[-1]
        out.append(int(penalise_row_ref(last, prompt, out, **kw).argmax()))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        STRONG,
        dict(presence_penalty=2.0, frequency_penalty=0.0, repetition_penalty=1.0),
        dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=0.5),
    ],
)
def test_engine_greedy_with_penalties_equals_the_reference(eng, kw):
    prompts = [rand_ids(40, 60), rand_ids(9, 61)]
    got = [c.token_ids for c in eng.generate(prompts, max_new_tokens=10, ignore_eos=True, **kw)]
    want = [_reference_greedy(eng, p, 10, **kw) for p in prompts]
    assert got == want
    plain = [c.token_ids for c in eng.generate(prompts, max_new_tokens=10, ignore_eos=True)]
    assert got != plain  # (the penalties changed something)
    assert len(eng.runner.worker.penalties) == 0  # finished requests' state is freed


def test_engine_rejects_bad_penalties_with_one_line(eng):
    with pytest.raises(RequestError, match="presence_penalty 50.0: must be between -2 and 2"):
        eng.generate([rand_ids(20, 62)], max_new_tokens=2, presence_penalty=50.0)
    assert eng.generate([rand_ids(20, 62)], max_new_tokens=2)[0].token_ids  # (the engine goes on)


def test_seeded_sampling_with_penalties_is_reproducible_and_batch_independent(eng):
    p = rand_ids(30, 63)
    kw = dict(max_new_tokens=12, temperature=1.1, ignore_eos=True, seed=5, **STRONG)
    a = eng.generate([p], **kw)[0].token_ids
    b = eng.generate([rand_ids(50, 64), p], **{**kw, "seed": 4})[1].token_ids  # seed 4 + 1
    assert a == b


def test_penalties_survive_preemption(tiny_dir):
    prompts = [rand_ids(120, 70 + i) for i in range(4)]
    kw = dict(max_new_tokens=70, ignore_eos=True, **STRONG)
    with Engine(tiny_dir, device="cpu", kv_pages=1024) as big:
        want = [c.token_ids for c in big.generate(prompts, **kw)]
    with Engine(tiny_dir, device="cpu", kv_pages=10) as small:
        got = [c.token_ids for c in small.generate(prompts, **kw)]
        assert small.scheduler.num_preempted > 0
    assert got == want


def test_penalties_across_pipeline_stages(tiny_dir, eng):
    prompts = [rand_ids(23, 80), rand_ids(31, 81)]
    kw = dict(max_new_tokens=8, ignore_eos=True, **STRONG)
    want = [c.token_ids for c in eng.generate(prompts, **kw)]
    with Engine(tiny_dir, device="cpu", kv_pages=16, chunk_size=29, pp=2) as e:
        got = [c.token_ids for c in e.generate(prompts, **kw)]
        again = [
            c.token_ids for c in e.generate(prompts, **kw)
        ]  # (the last stage freed the first run's state)
    assert got == want == again


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    ],
)
def test_bad_penalties_are_rejected(kw, msg):
    with pytest.raises(RequestError, match=msg):
        dataclasses.replace(SamplingParams(), **kw).validate()


@pytest.mark.parametrize("graphs", [False, True])
def test_penalties_with_overlapped_decode_and_graphs(tiny_dir, eng, graphs):
    """Continuations launched before step n's tokens reach the host sample step n+1 from device
    state that already holds step n's token; a request stopping mid-way drops its continuation."""
    prompts = [rand_ids(n, 90 + n) for n in (7, 70, 5)]
    kw = dict(max_new_tokens=12, **STRONG)
    want = [c.token_ids for c in eng.generate(prompts, ignore_eos=True, **kw)]
    stop = want[1][4]
    with Engine(tiny_dir, device="cpu", overlap=True, cuda_graphs=graphs) as ov:
        got = [c.token_ids for c in ov.generate(prompts, ignore_eos=True, **kw)]
        assert ov.stats()["overlapped_steps"] > 0
        a = [
            (c.token_ids, c.finish_reason)
            for c in ov.generate(prompts, stop=[stop], temperature=0.7, seed=3, **kw)
        ]
        assert len(ov.runner.worker.penalties) == 0
    b = [
        (c.token_ids, c.finish_reason)
        for c in eng.generate(prompts, stop=[stop], temperature=0.7, seed=3, **kw)
    ]
    assert got == want and a == b


def test_slots_are_reused_clean_and_the_pools_grow():
    """Requests come and go, more at once than the pools first hold: a request in a freed slot starts
    from no history and no prompt set, and every row stays equal to the reference."""
    g = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    pen = Penalties()
    live: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (prompt, output)
    kw = dict(presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.6)
    for it in range(10):
        for _ in range(rng.randrange(0, 5)):
            live[f"r{it}-{len(live)}"] = ([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))], [])
        if not live:
            continue
        rids = list(live)
        rows = [_row(rid, len(live[rid][1]), live[rid][0] if not live[rid][1] else (), **kw) for rid in rids]
        logits = torch.randn(len(rows), VOCAB, generator=g)
        got = pen.apply(logits, rows, range(len(rows)))
        for i, rid in enumerate(rids):
            want = penalise_row_ref(logits[i], live[rid][0], live[rid][1], **kw)
            assert torch.allclose(got[i], want, atol=1e-5), (rid, it, (got[i] - want).abs().max())
        toks = torch.tensor([rng.randrange(VOCAB) for _ in rows])
        pen.record(toks, rows, range(len(rows)))
        for rid, t in zip(rids, toks.tolist()):
            live[rid][1].append(t)
        done = [rid for rid in rids if rng.random() < 0.4]
        pen.release(done)
        for rid in done:
            del live[rid]
        assert len(pen) == len(live)
    pen.release(list(live))
    assert len(pen) == 0 and pen._counts.numel() == pen._prompt.numel() == 0  # (the pools go with the last)
