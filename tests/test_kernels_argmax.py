"""kernels.argmax: greedy decoding's argmax split over programs, against torch.argmax (the interpreter)."""

from __future__ import annotations

import pytest
import torch
from longctx.kernels.argmax import argmax_rows

pytest.importorskip("triton")


@pytest.mark.parametrize(
    ("d", "v", "dtype"),
    [(1, 5000, torch.float32), (3, 4096, torch.float32), (2, 777, torch.bfloat16), (5, 1, torch.float32)],
)
def test_argmax_rows_matches_torch(d, v, dtype):
    """Fresh rows with planted ties (the first index wins, also across the programs' chunks), a row of -inf,
    rows with NaNs (the first NaN wins) and +inf."""
    gen = torch.Generator().manual_seed(d * 100 + v)
    x = torch.randn(d, v, generator=gen).to(dtype)
    if v > 3000:
        top = x.max() + 1
        x[0, [2900, 17, 4000 % v, 2048]] = top  # a tie across chunks: 17 must win
    if d >= 3 and v > 3:
        x[1] = float("-inf")
        x[2, [v - 1, v // 2]] = float("nan")
        x[2, 3] = float("inf")
    if d >= 5:
        x[4, [v - 1, 0]] = float("inf")
        x[3] = float("-inf")
    got = argmax_rows(x, backend="triton")
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(x, dim=-1)), (got, torch.argmax(x, -1))


def test_argmax_rows_strided_and_rejects():
    x = torch.randn(4, 300)[:, ::2]  # a column stride of 2
    assert torch.equal(argmax_rows(x, backend="triton"), torch.argmax(x, dim=-1))
    assert argmax_rows(torch.empty(0, 7), backend="triton").shape == (0,)
    from longctx.errors import KernelInputError

    with pytest.raises(KernelInputError, match="argmax_rows"):
        argmax_rows(torch.zeros(3, 0), backend="triton")
    with pytest.raises(KernelInputError, match="argmax_rows"):
        argmax_rows(torch.zeros(3, 4, dtype=torch.int64), backend="triton")
