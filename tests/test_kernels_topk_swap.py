"""Exact top-k (radix select) and the zero-copy swap-in gather: Triton (interpreter) vs reference."""

from __future__ import annotations

import pytest
import torch
from longctx.kernels import topk as topk_mod
from longctx.kernels.common import KernelInputError
from longctx.kernels.swap import swap_in_gather, swap_in_gather_ref, swap_out_scatter, swap_out_scatter_ref
from longctx.kernels.topk import topk_indices, topk_indices_ref

from . import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are built)

# -------------------------------------------------------------------------------------- top-k


def _check_contract(out: torch.Tensor, logits: torch.Tensor, k: int, valid: torch.Tensor) -> None:
    """Ascending indices then -1 padding; exactly min(k, valid) picks; each pick >= every non-pick."""
    for i in range(logits.shape[0]):
        v = int(min(max(int(valid[i]), 0), logits.shape[1]))
        row = out[i]
        picks = row[row >= 0].long()
        assert picks.numel() == min(k, v)
        assert torch.all(row[picks.numel() :] == -1)
        assert torch.all(picks[1:] > picks[:-1]) and (picks.numel() == 0 or int(picks[-1]) < v)
        if 0 < picks.numel() < v:
            rest = torch.ones(v, dtype=torch.bool)
            rest[picks] = False
            assert logits[i, picks].min() >= logits[i, :v][rest].max()


def _tricky_logits(tq: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tq, n, generator=g)
    if tq > 1:
        x[1] = torch.randint(0, 5, (n,), generator=g).float()  # massive ties at every level
    if tq > 2:
        x[2, : n // 2] = float("-inf")  # causal-style -inf inside the valid range
        x[2, n // 2 :: 3] = -0.0  # -0.0 and +0.0 are the same value
        x[2, n // 2 + 1 :: 3] = 0.0
    if tq > 3:
        x[3] = 7.0  # all equal: the lowest indices win
    return x


@pytest.mark.parametrize(
    "tq,n,k,chunk_kind",
    [
        (4, 5000, 64, "multi-chunk"),
        (4, 5000, 2048, "k=2048"),
        (4, 300, 16, "one chunk"),
        (4, 100, 200, "k > N"),
    ],
)
def test_topk_triton_equals_ref_exactly(tq, n, k, chunk_kind):
    x = _tricky_logits(tq, n, seed=n + k)
    for valid in (
        torch.full((tq,), n),
        torch.tensor([n, k, k + 1, max(n - 37, 0)][:tq]),
        torch.tensor([0, 1, n, k // 2][:tq]),
    ):
        got = topk_indices(x, k, valid, backend="triton")
        ref = topk_indices_ref(x, k, valid)
        assert got.dtype == torch.int32 and got.shape == (tq, k)
        assert torch.equal(got, ref), chunk_kind
        _check_contract(ref, x, k, valid)


@pytest.mark.parametrize(
    "n,k,window", [(5000, 64, 16), (5000, 2040, 8), (300, 12, 4), (100, 190, 10), (40, 5, 1)]
)
def test_topk_with_window_equals_ref_exactly(n, k, window, monkeypatch):
    """`window` W: the write pass stores each query's top k before its window, then the window (or every
    key when the query has at most k + W of them), as `with_local_window` composes it; queries on both
    sides of k + W, at the first and last position, over several chunks, with ties."""
    g = torch.Generator().manual_seed(n + k + window)
    pos = torch.randint(0, n, (6,), generator=g)
    pos[:3] = torch.tensor([0, min(k + window - 1, n - 1), min(k + window, n - 1)])
    x = _tricky_logits(6, n, seed=k)
    valid = (pos - window).clamp(min=0) + 1  # (the indexer's `local_window_bound` + 1)
    got = topk_indices(x, k, valid, window, pos, backend="triton")
    ref = topk_indices_ref(x, k, valid, window, pos)
    assert got.dtype == torch.int32 and got.shape == (6, k + window)
    assert torch.equal(got, ref)
    # valid_len None: the kernels make it from the positions (the decode step's call)
    assert torch.equal(topk_indices(x, k, None, window, pos, backend="triton"), ref)
    assert torch.equal(topk_indices_ref(x, k, None, window, pos), ref)
    for i, p in enumerate(pos.tolist()):  # the window's positions close every long row
        if p >= k + window:
            assert got[i, k:].tolist() == list(range(p - window + 1, p + 1))
        else:
            assert got[i].tolist() == [j if j <= p else -1 for j in range(k + window)]
    with pytest.raises(KernelInputError, match="positions"):
        topk_indices(x, k, valid, window, None, backend="triton")
    with pytest.raises(KernelInputError, match="valid_len"):
        topk_indices(x, k, None, backend="triton")
    monkeypatch.setattr(topk_mod, "WINDOW_IN_WRITE", False)  # LONGCTX_TOPK_WINDOW=0: composed after it
    assert torch.equal(topk_indices(x, k, valid, window, pos, backend="triton"), ref)
    assert torch.equal(topk_indices(x, k, None, window, pos, backend="triton"), ref)


def test_topk_ref_equals_torch_topk_set_at_200k():
    g = torch.Generator().manual_seed(5)
    n, k = 200_000, 2048
    x = torch.randn(3, n, generator=g)  # continuous values: no ties at the boundary
    valid = torch.tensor([n, 150_001, 1000])
    out = topk_indices_ref(x, k, valid)
    for i in range(3):
        v = int(valid[i])
        expect = torch.topk(x[i, :v], min(k, v)).indices.sort().values
        got = out[i][out[i] >= 0].long()
        assert torch.equal(got, expect)
    assert torch.all(out[2, 1000:] == -1)
    _check_contract(out, x, k, valid)


def test_topk_tie_rule_prefers_lower_index():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    valid = torch.tensor([7])
    for fn in (topk_indices_ref, lambda a, b, c: topk_indices(a, b, c, backend="triton")):
        assert fn(x, 3, valid).tolist() == [[1, 2, 3]]  # both 3.0s, then the first 2.0
        assert fn(x, 2, torch.tensor([3])).tolist() == [[1, 2]]
        assert fn(x, 9, torch.tensor([2])).tolist() == [[0, 1] + [-1] * 7]


def test_topk_triton_matches_torch_topk_on_continuous_values():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 4100, generator=g) * 1e3
    valid = torch.tensor([4100, 3000])
    got = topk_indices(x, 256, valid, backend="triton")
    for i in range(2):
        expect = torch.topk(x[i, : int(valid[i])], 256).indices.sort().values.int()
        assert torch.equal(got[i], expect)


def test_topk_rejects_bad_inputs():
    with pytest.raises(KernelInputError):
        topk_indices(torch.randn(2, 10).double(), 3, torch.tensor([10, 10]))
    with pytest.raises(KernelInputError):
        topk_indices(torch.randn(2, 10), 3, torch.tensor([10]))


# --------------------------------------------------------------------------------------- swap


@pytest.mark.parametrize(
    "row_bytes,dtype,rows_per_item",
    [
        (656, torch.uint8, 1),
        (656, torch.uint8, 64),
        (132, torch.uint8, 1),
        (132, torch.uint8, 64),
        (52, torch.uint8, 3),
        (7, torch.uint8, 2),
    ],
)
def test_swap_in_gather_triton_matches_ref(row_bytes, dtype, rows_per_item):
    g = torch.Generator().manual_seed(row_bytes + rows_per_item)
    host = torch.randint(0, 256, (640, row_bytes), dtype=torch.uint8, generator=g)
    n = min(7, 256 // rows_per_item)
    src = torch.randperm(640 // rows_per_item, generator=g)[:n] * rows_per_item
    dst = torch.randperm(256 // rows_per_item, generator=g)[:n] * rows_per_item
    a = torch.zeros(256, row_bytes, dtype=torch.uint8)
    b = a.clone()
    swap_in_gather(host, src, a, dst, rows_per_item, backend="triton")
    swap_in_gather_ref(host, src, b, dst, rows_per_item)
    assert torch.equal(a, b)
    for i in range(n):  # and the rows really are where the contract says
        s, d = int(src[i]), int(dst[i])
        assert torch.equal(a[d : d + rows_per_item], host[s : s + rows_per_item])

    h1, h2 = host.clone(), host.clone()
    swap_out_scatter(h1, src, a, dst, rows_per_item, backend="triton")
    swap_out_scatter_ref(h2, src, a, dst, rows_per_item)
    assert torch.equal(h1, h2) and torch.equal(h1, host)


def test_swap_dense_pool_unaligned_runs_and_empty():
    g = torch.Generator().manual_seed(1)
    host = torch.randn(300, 40, generator=g).bfloat16()  # a dense bf16 KV pool: moved as bytes
    src = torch.tensor([5, 130, 299 - 4])  # runs that do not start on a page
    dst = torch.tensor([0, 17, 60])
    a = torch.zeros(128, 40, dtype=torch.bfloat16)
    b = a.clone()
    swap_in_gather(host, src, a, dst, 5, backend="triton")
    swap_in_gather_ref(host, src, b, dst, 5)
    assert torch.equal(a, b)
    swap_in_gather(host, src[:0], a, dst[:0], backend="triton")  # n = 0 is a no-op
    assert torch.equal(a, b)
    with pytest.raises(KernelInputError):
        swap_in_gather(host, src, a.float(), dst, backend="triton")  # dtype mismatch
