"""The penalties pass (`kernels.penalties`): the Triton kernel against its torch reference under the
interpreter, bit for bit, on fresh random rows of several widths (one block, a ragged last block, many
blocks), in float32 / bfloat16 / float16, with unpenalised rows between penalised ones, rows sharing a
slot, strided rows, and -inf / +inf / NaN logits; bad shapes are refused with a message."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels.penalties import penalise, penalise_ref

from longctx.errors import KernelInputError

pytest.importorskip("triton")


def _case(r: int, v: int, s: int, seed: int, dtype: torch.dtype, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, v + pad, generator=g) * 5
    x.view(-1)[torch.randint(0, x.numel(), (8,), generator=g)] = float("-inf")
    x.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = float("inf")
    x.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = float("nan")
    x = x.to(dtype)[:, :v]  # (pad > 0: rows strided wider than they are)
    slot = torch.randint(-1, s, (r,), generator=g, dtype=torch.int32)
    slot[0] = -1
    slot[-1] = s - 1
    hot = torch.rand(s, v, generator=g) < 0.2
    counts = (torch.randint(1, 5, (s, v), generator=g) * hot).to(torch.int32)
    prompt = (torch.rand(s, v, generator=g) < 0.1).to(torch.uint8)
    rep = torch.rand(r, generator=g) * 2 + 0.25
    rep[torch.rand(r, generator=g) < 0.3] = 1.0
    freq = torch.randn(r, generator=g)
    pres = torch.randn(r, generator=g)
    return x, slot, counts, prompt, rep, freq, pres


@pytest.mark.parametrize(
    "r,v,s,dtype,pad",
    [
        (3, 50, 2, torch.float32, 0),
        (6, 2048, 4, torch.float32, 0),
        (5, 5003, 3, torch.bfloat16, 0),
        (4, 4097, 5, torch.float16, 7),
        (2, 154_880, 2, torch.float32, 0),
    ],
)
def test_the_kernel_equals_its_reference(r, v, s, dtype, pad):
    for seed in range(2):
        args = _case(r, v, s, seed, dtype, pad)
        got = penalise(*args, backend="triton")
        want = penalise_ref(*args)
        assert got.dtype == torch.float32 and got.shape == (r, v)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0, 1.0, -1.0), want.nan_to_num(0.0, 1.0, -1.0)), (seed, dtype)
        unpenalised = args[1] < 0
        assert torch.equal(got[unpenalised].nan_to_num(0.0), args[0][unpenalised].float().nan_to_num(0.0))


def test_no_rows_and_bad_shapes():
    x, slot, counts, prompt, rep, freq, pres = _case(3, 64, 2, 0, torch.float32)
    assert penalise(x[:0], slot[:0], counts, prompt, rep[:0], freq[:0], pres[:0], backend="triton").shape == (
        0,
        64,
    )
    bad = [
        ((x.double(), slot, counts, prompt, rep, freq, pres), "x must be float"),
        ((x, slot, counts[:, :10].contiguous(), prompt, rep, freq, pres), "counts must be"),
        ((x, slot, counts, prompt.bool(), rep, freq, pres), "prompt must be"),
        ((x, slot.long(), counts, prompt, rep, freq, pres), "slot must be"),
        ((x, slot, counts, prompt, rep[:2], freq, pres), "rep must be"),
        ((x, slot, counts, prompt, rep, freq.double(), pres), "freq must be"),
    ]
    for args, msg in bad:
        with pytest.raises(KernelInputError, match=msg):
            penalise(*args, backend="triton")
