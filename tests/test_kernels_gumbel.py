"""The seeded Gumbel-max draw (`kernels.gumbel`): the Triton kernel against its torch reference under the
interpreter (rows split over programs, masked and flat rows, candidate ids in any order), the int64-held
32-bit mixer against Python's integers, and the draws' frequencies against softmax."""

from __future__ import annotations

import dataclasses
import math
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels.gumbel import (
    MIX_A,
    MIX_B,
    _as_s32,
    gumbel_argmax,
    gumbel_argmax_ref,
    mix32_ref,
    scale_logits_ref,
)

from longctx.errors import KernelInputError

pytest.importorskip("triton")


def _mix32_py(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * MIX_A) & m
    x ^= x >> 15
    x = (x * MIX_B) & m
    return x ^ (x >> 15)


def test_the_mixer_is_the_32_bit_one_and_a_bijection():
    """The int32 reference (wrapping products, masked shifts) equals the mixer over Python's integers on
    values with the top bit set and not, 2,004 of them (the vector loops and their scalar tails)."""
    rng = random.Random(1)
    xs = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    got = (mix32_ref(_as_s32(torch.tensor(xs, dtype=torch.int64))).long() & 0xFFFFFFFF).tolist()
    assert got == [_mix32_py(x) for x in xs]
    dense = mix32_ref(torch.arange(1 << 16, dtype=torch.int32))
    assert dense.unique().numel() == 1 << 16


@pytest.mark.parametrize("d,w", [(1, 1), (1, 5), (3, 1000), (2, 4097), (7, 3000), (1, 20000)])
def test_the_kernel_draws_the_references_token(d, w):
    """Random rows with a third of their tokens masked to -inf, and the same rows with their columns
    permuted and the ids passed (a sorted candidate prefix): every draw is the reference's token."""
    g = torch.Generator().manual_seed(d * 7919 + w)
    x = torch.randn(d, w, generator=g) * 3
    x[:, torch.randperm(w, generator=g)[: w // 3]] = float("-inf")
    keys = torch.randint(0, 2**63 - 1, (d,), generator=g)
    want = gumbel_argmax_ref(x, keys)
    assert torch.equal(gumbel_argmax(x, keys, backend="triton"), want)
    assert torch.isfinite(x.gather(1, want[:, None])).all()
    ids = torch.stack([torch.randperm(w, generator=g) for _ in range(d)])
    col = gumbel_argmax(x.gather(1, ids), keys, ids, backend="triton")
    assert torch.equal(ids.gather(1, col[:, None])[:, 0], want)
    assert torch.equal(ids.gather(1, gumbel_argmax_ref(x.gather(1, ids), keys, ids)[:, None])[:, 0], want)


@pytest.mark.parametrize("d,w", [(1, 7), (4, 1000), (2, 4097), (1, 20000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings(
    "ignore:overflow encountered in divide:RuntimeWarning"
)  # (the interpreter's numpy)
def test_the_kernel_scales_raw_logits_as_the_reference_does(d, w, dtype):
    """With a temperature the kernel takes the raw logits and draws what the reference draws over
    `scale_logits_ref`'s rows: ordinary rows, a row with NaNs, a row whose +inf tokens alone are drawn
    (one of them in each program's share), a row all -inf, a row all NaN (uniform), temperatures tiny
    enough to overflow finite logits to +inf, bf16 logits; rows split over several programs (w 4097,
    20000)."""
    g = torch.Generator().manual_seed(d * 31 + w)
    x = (torch.randn(d, w, generator=g) * 4).to(dtype)
    x[0, torch.randperm(w, generator=g)[: w // 4]] = float("-inf")
    t = torch.rand(d, generator=g) * 1.5 + 0.1
    if d > 1:
        x[1, :: max(1, w // 5)] = float("inf")
        x[1, 1] = float("nan")
    if d > 2:
        x[2] = float("-inf")
        t[3] = 1e-38  # (finite logits over it overflow to +inf: those draw alone)
        x[3, : w // 2] = float("nan")
    if d == 1 and w == 7:
        x[0] = float("nan")
    keys = torch.randint(0, 2**63 - 1, (d,), generator=g)
    want = gumbel_argmax_ref(scale_logits_ref(x, t[:, None]), keys)
    assert torch.equal(gumbel_argmax(x, keys, temperature=t, backend="triton"), want)
    assert torch.equal(gumbel_argmax(x, keys, temperature=t, backend="torch"), want)
    if d > 1:
        assert bool(torch.isposinf(x[1, want[1]].float()))
    with pytest.raises(KernelInputError, match="temperature"):
        gumbel_argmax(x, keys, temperature=t[:1].double(), backend="triton")


def test_flat_rows_break_ties_the_same_way_in_any_column_order():
    """Equal logits (a uniform draw): on the 23-bit grid of the noise several tokens can tie; the larger
    first hash wins, so the kernel, the reference and a permuted row agree, and different keys spread."""
    x = torch.zeros(6, 50_000)
    keys = torch.arange(6, dtype=torch.int64) * 1_000_003
    want = gumbel_argmax_ref(x, keys)
    assert torch.equal(gumbel_argmax(x, keys, backend="triton"), want)
    ids = torch.randperm(50_000).expand(6, -1).contiguous()
    assert torch.equal(ids.gather(1, gumbel_argmax_ref(x, keys, ids)[:, None])[:, 0], want)
    assert want.unique().numel() == 6


def test_draws_follow_softmax():
    """20,000 keys over 8 tokens: each token's count within 5 sigma of softmax(x) * n."""
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    n = 20_000
    keys = torch.randint(0, 2**63 - 1, (n,), generator=torch.Generator().manual_seed(5))
    got = torch.bincount(gumbel_argmax_ref(x.expand(n, -1), keys), minlength=8).tolist()
    p = torch.softmax(x, dim=0).tolist()
    for c, q in zip(got, p):
        assert abs(c - n * q) <= 5 * math.sqrt(n * q * (1 - q)) + 1, (got, p)
    assert got[6] == 0


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 8)
    with pytest.raises(KernelInputError, match="float32"):
        gumbel_argmax(x.double(), torch.zeros(2, dtype=torch.int64), backend="triton")
    with pytest.raises(KernelInputError, match="keys"):
        gumbel_argmax(x, torch.zeros(3, dtype=torch.int64), backend="triton")
    with pytest.raises(KernelInputError, match="ids"):
        gumbel_argmax(
            x, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 7, dtype=torch.int64), backend="triton"
        )


def _rows(rng: random.Random, n: int, vocab: int, all_top_k: bool = False, no_top_p: bool = False) -> list:
    from longctx.engine.plan import RowPlan

    rows = []
    for i in range(n):
        rows.append(
            RowPlan(
                rid=f"r{i}",
                token_ids=(0,),
                start=0,
                pages=(),
                temperature=rng.choice([1e-5, 0.3, 0.7, 1.0, 1.8]),
                top_k=rng.choice([1, 3, 17, vocab - 1])
                if all_top_k
                else rng.choice([0, 0, 1, 5, 40, vocab, 10**9]),
                top_p=1.0 if no_top_p else rng.choice([1.0, 1.0, 0.9, 0.5, 1e-320]),
                min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
                seed=rng.getrandbits(64),
                step=rng.randrange(0, 1000),
            )  # fmt: skip
        )
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batched_draws_are_the_per_row_references(seed, backend):
    """`draw_rows` over a batch of rows with mixed temperature / top-k / top-p / min-p (a batch where every
    row has a top-k draws from the sorted prefix only; one without top-p keeps its top-k by a select, no
    sort) equals `_sample` row by row, and a row draws the same token alone as in the batch."""
    from longctx.engine.sampling import _sample, draw_rows

    rng = random.Random(seed)
    vocab = 300
    g = torch.Generator().manual_seed(seed)
    for all_top_k, no_top_p in ((False, False), (True, False), (False, True), (True, True)):
        rows = _rows(rng, 9, vocab, all_top_k, no_top_p)
        logits = torch.randn(len(rows), vocab, generator=g) * 4
        logits[0, :50] = float("-inf")
        logits[1, 7] = float("inf")
        logits[1, 9] = float("inf")
        logits[2] = float("-inf")
        got = draw_rows(logits, rows, backend=backend)
        for i, r in enumerate(rows):
            want = _sample(logits[i], r.temperature, r.top_p, r.top_k, r.seed, r.step, r.min_p)
            assert int(got[i]) == int(want), (i, r)
            assert int(draw_rows(logits[i : i + 1], [r], backend=backend)[0]) == int(want)
        assert int(got[1]) in (7, 9)


def test_the_cpu_reference_path_in_row_blocks_is_the_whole_references():
    """On the CPU `gumbel_argmax(backend="torch")` draws a few rows at a time (in cache); same tokens."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 100_000, generator=g)
    keys = torch.randint(0, 2**63 - 1, (5,), generator=g)
    ids = torch.stack([torch.randperm(100_000, generator=g) for _ in range(5)])
    assert torch.equal(gumbel_argmax(x, keys, backend="torch"), gumbel_argmax_ref(x, keys))
    assert torch.equal(gumbel_argmax(x, keys, ids, backend="torch"), gumbel_argmax_ref(x, keys, ids))
    assert gumbel_argmax(x[:0], keys[:0], backend="torch").shape == (0,)


def test_top_k_by_select_keeps_the_lower_ids_among_equal_logits():
    """Without top-p the top-k is a select and a tie rank: over equal logits (and a row with fewer finite
    logits than k) it keeps the sort's set, lower ids first."""
    from longctx.engine.plan import RowPlan
    from longctx.engine.sampling import _keep_top_k, draw_rows

    x = torch.zeros(3, 40)
    x[1, 5:] = float("-inf")  # 5 finite, k 8
    x[2, [3, 9, 30]] = 2.0  # three above, then ties
    kept = _keep_top_k(x, [3, 8, 5], torch.tensor([[3], [8], [5]]))
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [0, 1, 2]
    assert torch.isfinite(kept[1]).nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert torch.isfinite(kept[2]).nonzero().flatten().tolist() == [0, 1, 3, 9, 30]
    assert torch.equal(_keep_top_k(x, [0, 0, 0], torch.zeros(3, 1, dtype=torch.int64)), x)
    rows = [
        RowPlan(rid="a", token_ids=(0,), start=0, pages=(), temperature=1.0, top_k=3, seed=1, step=s)
        for s in range(60)
    ]
    assert set(draw_rows(torch.zeros(60, 40), rows).tolist()) == {0, 1, 2}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_top_p_rows_draw_from_their_likeliest_candidates_or_sort(backend, monkeypatch):
    """A batch of top-p rows (some with a top-k too) draws from each row's likeliest TOP_P_CANDIDATES tokens
    when those hold top_p of its mass (peaked rows), and sorts whole rows when one row's do not (a flat
    row): the per-row reference's tokens either way."""
    from longctx.engine import sampling
    from longctx.engine.plan import RowPlan

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 16)
    vocab = 500
    g = torch.Generator().manual_seed(3)
    taken: list[bool] = []
    real = sampling._top_p_candidates

    def spy(*a):
        out = real(*a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(sampling, "_top_p_candidates", spy)
    for flat_row in (None, 2):
        rank = torch.rand(6, vocab, generator=g).argsort(dim=1).float() + 1
        logits = -2.5 * torch.log(rank)  # peaked: the top 16 hold ~0.95 of the mass
        if flat_row is not None:
            logits[flat_row] = torch.randn(vocab, generator=g) * 0.1
        logits[4, 10:] = float("-inf")  # (fewer finite tokens than candidates)
        rows = [
            RowPlan(rid=str(i), token_ids=(0,), start=0, pages=(), temperature=t, top_p=p, top_k=k, seed=i * 31, step=i)
            for i, (t, p, k) in enumerate([(1.0, 0.9, 0), (0.7, 0.8, 0), (1.0, 0.6, 0), (1.0, 0.9, 5), (1.0, 0.5, 0), (1.3, 0.95, 16)])
        ]  # fmt: skip
        got = sampling.draw_rows(logits, rows, backend=backend)
        assert taken[-1] is (flat_row is None)
        for i, r in enumerate(rows):
            want = sampling._sample(logits[i], r.temperature, r.top_p, r.top_k, r.seed, r.step, r.min_p)
            assert int(got[i]) == int(want), (flat_row, i)


def test_a_draw_copies_its_rows_numbers_to_the_device_once(monkeypatch):
    """Every column a draw needs (temperatures, seeds, min_p, top-k, top-p and the widths derived from
    them) reaches the device through one buffer (`_all_on`), on every route, and so do a step's penalty
    and logit-bias columns: one transfer each instead of one per column. A batch mixing rows drawn over
    the whole row with top-p rows draws the two groups apart (only the second sorts), in the same one
    transfer (with greedy rows too), each row's token the reference's. The packing round-trips mixed
    dtypes and odd lengths exactly (int64 seeds near 2**63, bool after float32)."""
    from longctx.engine import sampling
    from longctx.engine.plan import RowPlan

    cols = [
        ([1.5, -2.25, 3e38, 1e39], torch.float32),
        ([2**63 - 1, -(2**62), 7], torch.int64),
        ([True, False], torch.bool),
    ]
    for got, (want, dt) in zip(sampling._all_on(torch.device("cpu"), *cols, ([], torch.int64)), cols):
        assert got.dtype == dt and torch.equal(got, torch.tensor(want, dtype=dt))
    calls = {"on": 0, "all": 0}
    real_all, real_on = sampling._all_on, sampling._on

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(sampling, "_all_on", counted("all", real_all))
    monkeypatch.setattr(sampling, "_on", counted("on", real_on))
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 16)
    g = torch.Generator().manual_seed(5)
    vocab = 300
    peaked = -2.5 * torch.log(torch.rand(4, vocab, generator=g).argsort(dim=1).float() + 1)
    flat = torch.randn(4, vocab, generator=g) * 0.1
    batches = {
        "top-k": [dict(top_k=5), dict(top_k=9, min_p=0.05), dict(top_k=3), dict(top_k=40)],
        "top-p, candidates": [dict(top_p=0.8), dict(top_p=0.6, top_k=7), dict(top_p=0.9), dict(top_k=4)],
        "top-p and temperature only": [
            dict(top_p=0.8),
            dict(top_p=0.6, top_k=700),
            dict(top_p=0.9, min_p=0.01),
            {},
        ],
        "temperature only": [{}, dict(min_p=0.1), {}, {}],
        "mixed": [dict(top_p=0.7), {}, dict(top_k=5, min_p=0.02), dict(top_p=0.9, top_k=6)],
        "with greedy": [dict(temperature=0.0), dict(top_p=0.8), {}, dict(top_k=3)],
    }
    groups = {
        "top-k": [4],
        "top-p, candidates": [4],
        "top-p and temperature only": [1, 3],
        "temperature only": [4],
        "mixed": [1, 3],
        "with greedy": [1, 2],
    }
    drawn: list[int] = []
    real_draw = sampling._draw
    monkeypatch.setattr(
        sampling, "_draw", lambda x, rows, *a: drawn.append(len(rows)) or real_draw(x, rows, *a)
    )
    for name, kws in batches.items():
        for logits in (peaked, flat):
            rows = [
                RowPlan(str(i), (0,), 0, (), seed=i, step=3, **{"temperature": 0.8, **kw})
                for i, kw in enumerate(kws)
            ]
            calls.update(on=0, all=0)
            drawn.clear()
            got = sampling.sample_rows_device(logits, rows)
            assert calls == {"on": 0, "all": 1}, name
            assert drawn == groups[name], name  # (a mixed batch sorts only the rows that need it)
            for i, r in enumerate(rows):
                want = sampling._sample(logits[i], r.temperature, r.top_p, r.top_k, r.seed, r.step, r.min_p)
                assert int(got[i]) == int(want), (name, i)
    pen = sampling.Penalties()
    rows = [
        RowPlan(rid="p", token_ids=(0,), start=0, pages=(), step=0, presence_penalty=0.5, repetition_penalty=1.3,
                penalty_prompt=(1, 2), logit_bias=((3, 2.0),), suppress=(4,)),
        RowPlan(rid="q", token_ids=(0,), start=0, pages=(), step=0, frequency_penalty=0.4, penalty_prompt=(5,)),
    ]  # fmt: skip
    pen.apply(peaked[:2], rows, [0, 1])  # (a request's first step copies its prompt's token set too)
    rows = [dataclasses.replace(r, penalty_prompt=()) for r in rows]  # (as the steps after it come)
    calls.update(on=0, all=0)
    sampling.shape_logits(peaked[:2], rows, [0])
    pen.apply(peaked[:2], rows, [0, 1])
    assert calls == {"on": 0, "all": 2}
