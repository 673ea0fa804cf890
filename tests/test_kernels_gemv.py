"""kernels/gemv (the small-M decode linear) against its torch reference under the Triton interpreter:
both forms (FMA, swap-AB dot), plain and block-fp8 weights, N/K off the tiles and the 128-column scale
blocks, split-K, strided x rows; and the model's dispatch to it (longctx/model/linear.py)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels.common import KernelInputError
from longctx.kernels.fp8_gemm import quant_block_fp8_ref
from longctx.kernels.gemv import GemvConfig, gemv, gemv_ref, pick_splits

pytest.importorskip("triton")

FMA = GemvConfig(bn=32, bk=128, dot=False)
DOT = GemvConfig(bn=64, bk=64, dot=True)


def _weights(n: int, k: int, fp8: bool, dtype: torch.dtype, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    if fp8:
        return quant_block_fp8_ref(w)
    return w.to(dtype), None


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: accumulation order only. bf16: one rounding of the output (2^-8 relative), ref rounded too.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(ref.float().abs().max().item(), 1.0), f"max abs err {err:.3g}"


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [FMA, DOT, None], ids=["fma", "dot", "default"])
def test_gemv_matches_ref(m, fp8, dtype, cfg):
    """N = 200 and K = 300: neither a multiple of the row tile, nor of BK, nor of the 128 scale block."""
    gen = torch.Generator().manual_seed(m * 31 + fp8)
    n, k = 200, 300
    w, s = _weights(n, k, fp8, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = gemv(x, w, s, backend="triton", config=cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, gemv_ref(x, w, s), dtype)


@pytest.mark.parametrize("splits", [1, 2, 3, 64])
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_split_k(splits, fp8):
    """Whole 128-column blocks per split, a partial last block, more splits asked for than blocks."""
    gen = torch.Generator().manual_seed(splits)
    w, s = _weights(72, 520, fp8, torch.float32, gen)
    x = torch.randn(3, 520, generator=gen)
    for form in (FMA, DOT):
        cfg = GemvConfig(bn=form.bn, bk=form.bk, dot=form.dot, splits=splits)
        _close(gemv(x, w, s, backend="triton", config=cfg), gemv_ref(x, w, s), torch.float32)


def test_gemv_strided_x_and_out_dtype():
    """x a column slice of a wider tensor (the stacked projections' outputs); fp32 out from bf16 x."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 700, generator=gen).bfloat16()
    x = wide[:, 100:356]  # row stride 700
    w, s = _weights(130, 256, True, torch.bfloat16, gen)
    out = gemv(x, w, s, torch.float32, backend="triton")
    assert out.dtype == torch.float32
    _close(out, gemv_ref(x.contiguous(), w, s, torch.float32), torch.float32)
    wb = torch.randn(40, 256, generator=gen).bfloat16()
    _close(gemv(x, wb, backend="triton"), gemv_ref(x, wb), torch.bfloat16)


def test_gemv_rejects_bad_inputs():
    x = torch.randn(2, 64)
    with pytest.raises(KernelInputError):
        gemv(x, torch.randn(8, 64).bfloat16(), backend="triton")  # plain weight of another dtype
    with pytest.raises(KernelInputError):
        gemv(x, torch.randn(8, 32), backend="triton")  # K mismatch
    q, s = quant_block_fp8_ref(torch.randn(8, 64))
    with pytest.raises(KernelInputError):
        gemv(x, q, s[:, :0], backend="triton")  # wrong scale shape
    with pytest.raises(KernelInputError):
        gemv(torch.randn(64, 2).t(), torch.randn(8, 64), backend="triton")  # x column stride 2


def test_gemv_empty():
    w = torch.randn(8, 64)
    assert gemv(torch.randn(0, 64), w, backend="triton").shape == (0, 8)
    assert not gemv(torch.randn(2, 0), torch.randn(8, 0), backend="triton").any()


def test_pick_splits_fills_the_gpu():
    assert pick_splits(256, 2048, 132) == 1  # q_b: 16384 rows / 64
    assert pick_splits(32, 16384, 132) == 16  # o_proj of small-1m: 2048 rows, K = 16384
    assert pick_splits(1, 2048, 132) == 16  # weights_proj: one slab
    assert pick_splits(1, 300, 132) == 3  # never more splits than 128-column blocks


@pytest.mark.parametrize("fp8", [False, True])
def test_linear_dispatches_small_m_to_gemv(monkeypatch, fp8):
    """Linear on the Triton backend: at most GEMV_MAX_M (FP8: GEMV_MAX_M_FP8) rows go to gemv, more to
    the GEMM path (the limits are 0 by default; set here as LONGCTX_GEMV_MAX_M* would)."""
    from longctx.kernels import gemv as gemv_mod

    from longctx.model import linear as linear_mod

    calls: list[int] = []
    real = gemv_mod.gemv

    def spy(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemv_mod, "gemv", spy)
    limit = 16
    monkeypatch.setattr(linear_mod, "GEMV_MAX_M_FP8" if fp8 else "GEMV_MAX_M", limit)
    gen = torch.Generator().manual_seed(9)
    lin = linear_mod.Linear(256, 72)
    w, s = _weights(72, 256, fp8, torch.float32, gen)
    if fp8:
        assert s is not None
        lin.set_fp8(w, s, (128, 128))
    else:
        lin.weight.data = w
    lin.use_triton = True
    for m in (1, limit, limit + 1):
        x = torch.randn(m, 256, generator=gen)
        _close(lin(x), gemv_ref(x, lin.weight, lin.weight_scale_inv), torch.float32)
    assert calls == [1, limit]


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hnk", [(4, 64, 48), (3, 40, 100)])
def test_head_gemv_matches_ref(t, dtype, hnk):
    """Per-head products (MLA's absorbed W_UK / W_UV) against torch.einsum: N and K off the tiles, x a
    column slice of a wider [T, H, *] tensor (q_nope of q_b's output), several rows."""
    from longctx.kernels.gemv import head_gemv, head_gemv_ref

    h, n, k = hnk
    gen = torch.Generator().manual_seed(t * 100 + n)
    wide = torch.randn(t, h, k + 16, generator=gen).to(dtype)
    x = wide[..., :k]
    w = (torch.randn(h, n, k, generator=gen) / math.sqrt(k)).to(dtype)
    got = head_gemv(x, w, backend="triton")
    ref = head_gemv_ref(x.float(), w.float()).to(dtype)
    assert got.shape == (t, h, n) and got.dtype == dtype
    _close(got, ref, dtype)


def test_head_gemv_refuses_bad_inputs_and_takes_the_reference_for_many_rows(monkeypatch):
    from longctx.kernels import gemv as g

    x = torch.randn(2, 4, 8)
    with pytest.raises(KernelInputError, match="x \\[T, H, K\\] and w \\[H, N, K\\]"):
        g.head_gemv(x, torch.randn(3, 5, 8), backend="triton")
    with pytest.raises(KernelInputError, match="dtypes differ"):
        g.head_gemv(x, torch.randn(4, 5, 8, dtype=torch.bfloat16), backend="triton")
    with pytest.raises(KernelInputError, match="unit last stride"):
        g.head_gemv(x, torch.randn(4, 8, 5).transpose(1, 2), backend="triton")
    assert g.head_gemv(torch.randn(0, 4, 8), torch.randn(4, 5, 8), backend="triton").shape == (0, 4, 5)
    calls = []
    monkeypatch.setattr(g, "HEAD_GEMV_MAX_T", 1)
    monkeypatch.setattr(g, "head_gemv_ref", lambda *a: calls.append(1) or torch.zeros(2, 4, 5))
    g.head_gemv(x, torch.randn(4, 5, 8), backend="triton")
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,s,n,k", [(4, 32, 64, 128), (3, 5, 40, 100), (2, 1, 16, 64)])
def test_merge_head_gemv_matches_ref(dtype, h, s, n, k):
    """One query's split-K attention partials merged by their lse weights into W_UV's per-head GEMV,
    against the combine-then-GEMV reference: an empty split (lse -inf) weighs nothing, a head with every
    split empty gives 0, N and K off the tiles, parts a strided view."""
    from longctx.kernels.gemv import merge_head_gemv, merge_head_gemv_ref

    gen = torch.Generator().manual_seed(h * 100 + s + k)
    parts = torch.randn(h, s + 1, k + 8, generator=gen)[:, :s, :k]  # (strided rows, as o_dst[0])
    lse = torch.randn(h, s, generator=gen) * 3
    lse[0, 0] = float("-inf")
    if h > 2:
        lse[2] = float("-inf")
    w = (torch.randn(h, n, k, generator=gen) / math.sqrt(k)).to(dtype)
    got = merge_head_gemv(parts, lse, w, backend="triton")
    ref = merge_head_gemv_ref(parts, lse, w)
    assert got.shape == (1, h, n) and got.dtype == dtype
    _close(got, ref, dtype)
    if h > 2:
        assert (got[0, 2] == 0).all()


def test_merge_head_gemv_refuses_bad_inputs():
    from longctx.kernels.gemv import merge_head_gemv

    parts, lse, w = torch.randn(2, 4, 8), torch.randn(2, 4), torch.randn(2, 5, 8)
    with pytest.raises(KernelInputError, match="parts \\[H, S, K\\]"):
        merge_head_gemv(parts, lse[:, :3], w, backend="triton")
    with pytest.raises(KernelInputError, match="does not match"):
        merge_head_gemv(parts, lse, torch.randn(2, 5, 7), backend="triton")
    with pytest.raises(KernelInputError, match="fp32"):
        merge_head_gemv(parts.bfloat16(), lse, w, backend="triton")
