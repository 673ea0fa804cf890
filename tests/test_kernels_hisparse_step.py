"""HiSparse's per-step and per-layer index kernels (kernels/hisparse_step.py, interpreted) against
their torch references, bit for bit: a decode step's rows (padding rows, short requests, several
layers) and the top-k -> slot-row lookup (int32 / int64 positions, -1 anywhere, strided rows)."""

from __future__ import annotations

import pytest
import torch
from longctx.kernels.common import HAS_TRITON, triton_interpret
from longctx.kernels.hisparse_step import slot_lookup, slot_lookup_ref, step_rows, step_rows_ref

from . import conftest_kernels  # noqa: F401  (TRITON_INTERPRET=1 before triton is imported)

pytestmark = pytest.mark.skipif(not (HAS_TRITON and triton_interpret()), reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize(
    "B,L,recent,m,with_valid", [(1, 1, 4, 1, False), (5, 3, 2, 1, True), (4, 6, 8, 1, True)]
)
def test_step_rows_matches_reference(B, L, recent, m, with_valid):
    g = torch.Generator().manual_seed(B * 10 + L)
    blk = torch.randint(0, 9, (B,), generator=g)
    seq = torch.randint(1, 50, (B,), generator=g).to(torch.int32)
    seq[0] = 1  # a request at its first token
    valid = (torch.rand(B, generator=g) < 0.6) if with_valid else None
    kw = dict(n_layers=L, n_slots=13, pos_len=71, recent=recent, m=m)
    now_r, now_t = torch.tensor(5), torch.tensor(5)
    a = step_rows_ref(blk, seq, valid, now_r, None, **kw)
    b = step_rows(blk, seq, valid, now_t, None, backend="triton", **kw)
    assert int(now_r) == int(now_t) == 6
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("T,K,dtype", [(1, 5, torch.int32), (3, 40, torch.int64), (4, 1500, torch.int32)])
def test_slot_lookup_matches_reference(T, K, dtype):
    g = torch.Generator().manual_seed(T + K)
    P, rows = 97, 6
    p2s = torch.randint(-1, 20, (rows * P,), generator=g).to(torch.int32)
    q = torch.randint(-1, P - 1, (T, K), generator=g).to(dtype)
    at = (torch.randint(0, rows, (T, 2), generator=g) * P)[:, 1]  # a strided view
    base = torch.randint(1, 500, (T, 3), generator=g)[:, 0]
    want = slot_lookup_ref(q, p2s, at, base)
    got = slot_lookup(q, p2s, at, base, backend="triton")
    assert (want >= 0).any() and (want < 0).any()
    assert torch.equal(want, got)


@pytest.mark.parametrize("n_lists,B,M,width", [(0, 1, 1, 40), (1, 2, 1, 36), (2, 3, 20, 40), (2, 1, 37, 10)])
def test_resolve_tail_matches_reference(n_lists, B, M, width):
    from longctx.kernels.hisparse_step import resolve_tail, resolve_tail_ref

    g = torch.Generator().manual_seed(n_lists * 100 + M)
    T, K, P = B, 33, 61
    p2s = torch.randint(-1, 20, (B * P,), generator=g).to(torch.int32)
    q = torch.randint(-1, P - 1, (T, K), generator=g).to(torch.int32)
    at, base = torch.arange(T) * P, torch.randint(1, 30, (T,), generator=g)
    host = torch.randint(0, 1000, (90, width), generator=g).float()
    copies = []
    for i in range(n_lists):  # disjoint destinations, as a placement's lists are
        dst = torch.randperm(B * M * 2, generator=g)[i * B * M : (i + 1) * B * M].view(B, M)
        copies.append(
            (torch.randint(0, 90, (B, M), generator=g), dst, torch.randint(0, M + 1, (B,), generator=g))
        )
    a, b = torch.zeros(2 * B * M + 1, width), torch.zeros(2 * B * M + 1, width)
    ra = resolve_tail_ref(q, p2s, at, base, host, a, copies)
    rb = resolve_tail(q, p2s, at, base, host, b, copies, backend="triton")
    assert torch.equal(ra, rb) and torch.equal(a, b)
    assert n_lists == 0 or a.any()
