"""Fused indexer + top-k (Triton under the interpreter) vs the composition of the two references.

Most cases use integer keys (one element of each key is +-7, so the fp8 scale is exactly 2^-6 and
e4m3 holds the key exactly), integer queries and weights that are multiples of 1/16: every logit
is then exact in fp32 whatever the summation order, so the fused kernel, the unfused kernels and
the references compute bit-identical logits and the index SETS (and outputs) must be equal. The
integer logits also tie a lot, which exercises the lowest-index tie-break at the boundary.
One case uses plain random floats, where only fp32 rounding may differ: there the selections
must agree except between logits within rounding of the k-th value.
"""

from __future__ import annotations

import pytest
import torch
from longctx.kernels import kv_layout as kvl
from longctx.kernels.common import KernelInputError
from longctx.kernels.indexer import indexer_logits_paged, indexer_logits_paged_ref
from longctx.kernels.indexer_topk import (
    candidate_capacity,
    indexer_topk_paged,
    indexer_topk_paged_ref,
    sample_positions,
    sample_thresholds,
)
from longctx.kernels.topk import topk_indices_ref

from . import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are built)


def _case(lens, queries, *, heads=8, dim=16, kind="fp8_e4m3", dtype=torch.float32, w_mode="mixed", seed=0):
    """Paged index pool with shuffled pages; queries: list of (request, positions)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    p = max((n + 63) // 64 for n in lens) + 1
    num_pages = b * p + 2
    page_table = torch.randperm(num_pages, generator=g)[: b * p].view(b, p).int()
    pool = kvl.alloc_index_pool(num_pages * 64, dim, kind, dtype, "cpu").zero_()
    for r, n in enumerate(lens):
        t = torch.arange(n)
        key = torch.randint(-6, 7, (n, dim), generator=g).float()
        col = torch.randint(0, dim, (n,), generator=g)
        key[t, col] = torch.where(torch.rand(n, generator=g) < 0.5, -7.0, 7.0)  # amax 7: scale 2^-6
        kvl.write_index_k(
            pool, page_table[r, t // 64].long() * 64 + t % 64, key.to(dtype), kind, backend="torch"
        )
    q_seq = torch.tensor([r for r, pos in queries for _ in pos], dtype=torch.int32)
    q_pos = torch.tensor([x for _, pos in queries for x in pos], dtype=torch.int64)
    tq = q_seq.numel()
    q = torch.randint(-3, 4, (tq, heads, dim), generator=g).to(dtype)
    w = torch.randint(-8, 9, (tq, heads), generator=g).float() / 16
    if w_mode == "negative":  # logits <= 0, exact zeros wherever every head's relu is zero
        w = -w.abs() - 1 / 16
    elif w_mode == "positive":
        w = w.abs() + 1 / 16
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q, w, pool, page_table, seq_lens, q_seq, q_pos


def _check_exact(args, kind, k, *, expect_fused=True, **kw):
    ref = indexer_topk_paged_ref(*args, kind, k)
    stats: dict = {}
    got = indexer_topk_paged(*args, kind, k, backend="triton", stats=stats, **kw)
    assert got.dtype == torch.int32 and got.shape == ref.shape == (args[0].shape[0], k)
    assert torch.equal(got, ref), _first_diff(got, ref)
    if expect_fused:
        assert stats["path"] == "fused"
        assert stats["fallback_queries"] <= args[0].shape[0] // 4, stats  # most resolved in-kernel
    return stats


def _first_diff(got, ref):
    bad = torch.nonzero((got != ref).any(1)).flatten()
    i = int(bad[0]) if bad.numel() else -1
    return f"{bad.numel()} rows differ; row {i}: got {got[i].tolist()} ref {ref[i].tolist()}"


def test_ref_is_the_composition_of_the_two_references():
    args = _case([150, 97], [(0, list(range(60, 150, 7))), (1, [0, 5, 96])])
    logits = indexer_logits_paged_ref(*args, "fp8_e4m3")
    expect = topk_indices_ref(logits, 24, args[6] + 1)
    assert torch.equal(indexer_topk_paged_ref(*args, "fp8_e4m3", 24), expect)


@pytest.mark.parametrize(
    "kind,dtype", [("fp8_e4m3", torch.float32), ("auto", torch.float32), ("bf16", torch.bfloat16)]
)
def test_several_requests_in_one_chunk(kind, dtype):
    # contexts not a multiple of 64; query blocks spanning two requests; page-boundary positions
    lens = [301, 190, 77]
    queries = [(0, [63, 64, 127, 128, 200, 255, 256, 300]), (1, list(range(100, 190, 9))), (2, [76, 70, 64])]
    args = _case(lens, queries, kind=kind, dtype=dtype, seed=1)
    _check_exact(args, kind, 32, sample_keys=128, block_k=32)


def test_tf32x3_products_select_as_the_reference():
    # fp32 queries through three TF32 products (the trainer's fused selection): on these exact integer
    # logits the same selection as the reference; an unknown precision is refused
    args = _case([301, 190], [(0, [63, 64, 200, 300]), (1, list(range(100, 190, 17)))], kind="auto", seed=8)
    _check_exact(args, "auto", 32, sample_keys=128, block_k=32, fp32_dot="tf32x3")
    with pytest.raises(KernelInputError, match="fp32_dot"):
        indexer_topk_paged(*args, "auto", 8, backend="triton", fp32_dot="tf32")


def test_k_larger_than_context_pads():
    lens = [90, 40]
    queries = [(0, [0, 1, 30, 63, 64, 89]), (1, [5, 39])]
    args = _case(lens, queries, seed=2)
    stats = _check_exact(args, "fp8_e4m3", 64, sample_keys=8, block_k=16, expect_fused=False)
    assert stats["path"] == "fused"
    got = indexer_topk_paged(*args, "fp8_e4m3", 64, backend="triton", sample_keys=8, block_k=16)
    assert torch.equal((got >= 0).sum(1), torch.clamp(args[6] + 1, max=64).int())


@pytest.mark.parametrize("w_mode", ["negative", "positive"])
def test_heavy_ties_lowest_index_wins(w_mode):
    # negative weights: logits <= 0 with many exact zeros (the top-k boundary sits inside a tie)
    args = _case([260], [(0, [100, 150, 199, 200, 259])], heads=2, w_mode=w_mode, seed=3)
    _check_exact(args, "fp8_e4m3", 40, sample_keys=64, block_k=32)


def test_all_zero_logits_take_the_first_k():
    args = list(_case([333, 200], [(0, [70, 200, 332]), (1, [199])], seed=4))
    args[0] = torch.zeros_like(args[0])  # every logit is exactly 0
    stats = _check_exact(tuple(args), "fp8_e4m3", 50, sample_keys=16, block_k=64)
    assert stats["fallback_queries"] == 0  # ties never overflow: the tie buffer keeps the first k
    got = indexer_topk_paged(*args, "fp8_e4m3", 50, backend="triton", sample_keys=16)
    assert torch.equal(got, torch.arange(50, dtype=torch.int32).expand(4, 50))


def test_fallback_path_is_exact():
    # capacity == k and a coarse sample: many thresholds miss and go through the unfused kernels
    args = _case([300, 120], [(0, list(range(150, 300, 13))), (1, [119])], seed=5)
    stats: dict = {}
    ref = indexer_topk_paged_ref(*args, "fp8_e4m3", 16)
    got = indexer_topk_paged(*args, "fp8_e4m3", 16, backend="triton", sample_keys=4, capacity=16, stats=stats)
    assert stats["fallback_queries"] > 0
    assert torch.equal(got, ref)


def test_short_context_uses_unfused_kernels():
    args = _case([100], [(0, [10, 50, 99])], seed=6)
    stats = _check_exact(args, "fp8_e4m3", 20, expect_fused=False)  # max_len <= sample_keys
    assert stats["path"] == "unfused"


def test_extreme_query_magnitudes_per_head():
    # bf16 q over fp8 keys takes the fp16 dot with a power-of-two scale per head: heads spanning
    # 2^-100 .. 2^100 (and an all-zero head) with weights scaled inversely keep every logit exact,
    # so the fused, unfused and reference logits and selections must agree exactly.
    lens, queries = [300], [(0, [40, 130, 250, 299])]
    q, w, *rest = _case(lens, queries, dtype=torch.bfloat16, w_mode="positive", seed=10)
    e = torch.tensor([-100, -37, 0, 29, 100, 0, -5, 7], dtype=torch.float64)
    q = (q.double() * torch.exp2(e)[None, :, None]).to(torch.bfloat16)
    q[:, 5] = 0
    w = (w.double() * torch.exp2(-e)[None, :]).float()
    args = (q, w, *rest)
    ref_logits = indexer_logits_paged_ref(*args, "fp8_e4m3")
    got_logits = indexer_logits_paged(*args, "fp8_e4m3", backend="triton")
    assert torch.equal(got_logits, ref_logits)
    _check_exact(args, "fp8_e4m3", 40, sample_keys=64, block_k=32, num_warps=2, num_stages=2)
    _check_exact(args, "fp8_e4m3", 40, expect_fused=False)


def test_glm_head_shape():
    args = _case([200], [(0, [130, 199])], heads=32, dim=128, seed=7)
    _check_exact(args, "fp8_e4m3", 24, sample_keys=64)


def test_random_floats_agree_up_to_rounding():
    g = torch.Generator().manual_seed(8)
    args = list(_case([280], [(0, list(range(200, 280, 5)))], kind="auto", seed=8))
    tq = args[0].shape[0]
    args[0] = torch.randn(tq, 8, 16, generator=g)
    args[1] = torch.rand(tq, 8, generator=g) * 0.1
    kvl.write_index_k(
        args[2], torch.arange(args[2].shape[0]), torch.randn(args[2].shape[0], 16, generator=g), "auto"
    )
    k = 32
    got = indexer_topk_paged(*args, "auto", k, backend="triton", sample_keys=32, block_k=32)
    ref = indexer_topk_paged_ref(*args, "auto", k)
    logits = indexer_logits_paged_ref(*args, "auto")
    for i in range(tq):
        a, b = set(got[i].tolist()), set(ref[i].tolist())
        kth = logits[i].sort(descending=True).values[k - 1]
        tol = 1e-5 * logits[i, : int(args[6][i]) + 1].abs().max()
        for j in a ^ b:  # a differing pick must sit at the boundary, within rounding
            assert abs(float(logits[i, j] - kth)) <= tol
        assert len(a) == len(b) == k


def test_rejects_bad_inputs():
    args = _case([100], [(0, [10])], seed=9)
    with pytest.raises(KernelInputError):
        indexer_topk_paged(*args, "fp8_e4m3", -1, backend="triton")
    with pytest.raises(KernelInputError):
        indexer_topk_paged(*args, "fp8_e4m3", 8, backend="triton", sample_keys=8, capacity=4)
    with pytest.raises(KernelInputError):
        indexer_topk_paged(args[0], args[1].bfloat16(), *args[2:], "fp8_e4m3", 8, backend="triton")


def test_small_k_candidates_fit_without_fallback():
    # k = 4 of 1,024 keys with a 64-key sample (strata of 16): the threshold sits at sample rank ~4,
    # so ~64 keys pass it; a fixed capacity of 4k (16) sent such queries to the unfused fallback
    # (the seventeenth session's top-32 training step at 128K: 58% of queries, 17x slower)
    args = _case([1024], [(0, [700, 811, 900, 1000, 1023])], seed=7)
    stats = _check_exact(args, "fp8_e4m3", 4, sample_keys=64, block_k=64)
    assert stats["fallback_queries"] == 0 and stats["capacity"] > 16, stats
    old: dict = {}
    indexer_topk_paged(
        *args, "fp8_e4m3", 4, backend="triton", sample_keys=64, block_k=64, capacity=16, stats=old
    )
    assert old["fallback_queries"] > 0  # the case does tell the two capacities apart


@pytest.mark.parametrize("length,k", [(131072, 32), (65536, 32), (262144, 4), (262144, 2048)])
def test_candidate_capacity_covers_the_sampled_threshold(length, k):
    # the counts a sampled threshold lets through on random relu'd logits stay within the capacity
    # (at 2048 of 262,144 the capacity is the memory-bounded 4k)
    logits = torch.relu(torch.randn(16, length))
    spos, s_len = sample_positions(length, 8192, "cpu")
    n_valid = torch.full((16,), length)
    thr = sample_thresholds(logits[:, spos.long()].clone(), spos, s_len, n_valid, k)
    above = (logits > thr[:, None]).sum(1)
    cap = candidate_capacity(k, s_len, spos.numel(), length)
    assert k <= cap <= length and int(above.max()) <= cap, (cap, above.tolist())
    if k == 2048:
        assert cap == 4 * k  # a large k's buffers stay as they were
