"""bf16 activations x block-fp8 weights run as an fp16 MMA on power-of-two-scaled rows
(`kernels.fp8_gemm.fp16_rows`) in gemv, fp8_block_linear and the routed experts. The result must equal
the bf16 MMA's (x.float() @ dequant(w).T) up to fp32 rounding, row by row whatever the row's magnitude:
rows near bf16's largest values and at 2^-100, a zero row, a row whose elements span 2^-27 of its max,
M in {1, 3, 8, 16}, N and K off the tiles and the 128-column scale blocks. Under the Triton interpreter."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels.fp8_gemm import dequant_block_fp8_ref, fp8_block_linear, quant_block_fp8_ref
from longctx.kernels.gemv import GemvConfig, gemv
from longctx.kernels.moe import moe_experts, moe_experts_ref

pytest.importorskip("triton")


def _rows(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 x [m, k]: random rows, then (as m allows) a huge row, a tiny row, a zero row, a wide-range row."""
    x = torch.randn(m, k, generator=gen)
    special = [
        x[0] * 2.0**120,  # near bf16's top (products with |w| <= 448 * scale stay finite in fp32)
        x[0] * 2.0**-100,  # tiny (no bf16 subnormals: the interpreter converts those to fp32 wrongly)
        torch.zeros(k),
        x[0] * 2.0 ** -torch.randint(0, 28, (k,), generator=gen).float(),  # 2^-27.. of the max: exact
    ]
    for i, row in enumerate(special[: max(0, m - 1)]):
        x[1 + i] = row
    return x.bfloat16()


def _exact(out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """|out - ref| <= 2^-17 * (|x| @ |dequant(w)|^T) + 2^-140 element-wise against a float64 reference:
    fp32 rounding of a short sum (and of fp32 subnormal outputs), far under bf16's 2^-8."""
    xf = x.double()
    wd = dequant_block_fp8_ref(q, s).double()  # e4m3 * fp32 scale: exact in fp32
    ref = xf @ wd.T
    bound = (xf.abs() @ wd.abs().T) * 2.0**-17 + 2.0**-140
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max err / bound {(err / bound.clamp(min=1e-300)).max().item():.3g}"
    zero = (x == 0).all(dim=1)
    assert (out[zero] == 0).all()


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_block_fp8_ref(torch.randn(n, k, generator=gen) / math.sqrt(k))


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("splits", [None, 3])
def test_gemv_fp16_mma_is_exact(m, splits):
    gen = torch.Generator().manual_seed(m + 100 * (splits or 0))
    q, s = _weights(200, 300, gen)
    x = _rows(m, 300, gen)
    cfg = GemvConfig(bn=64, bk=128, dot=True, splits=splits)
    _exact(gemv(x, q, s, torch.float32, backend="triton", config=cfg), x, q, s)
    out = gemv(x, q, s, backend="triton", config=cfg)  # bf16 out: the fp32 result rounded once
    assert out.dtype == torch.bfloat16
    ref = gemv(x, q, s, torch.float32, backend="triton", config=cfg).bfloat16()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("m", [1, 3, 8, 16, 40])
def test_fp8_block_linear_fp16_mma_is_exact(m):
    """m = 40 takes the 64-row tiles (still fp16: FP16_MMA_MAX_BM), with split-K for small m."""
    gen = torch.Generator().manual_seed(m)
    q, s = _weights(130, 257, gen)
    x = _rows(m, 257, gen)
    _exact(fp8_block_linear(x, q, s, torch.float32, backend="triton"), x, q, s)
    _exact(fp8_block_linear(x, q, s, torch.float32, backend="triton", split_k=1), x, q, s)


def test_moe_experts_fp16_mma_matches_ref():
    """Routed experts, bf16 x and e4m3 weights: rows of very different magnitudes each within bf16
    rounding of the reference (the hidden state is stored in bf16 between the two GEMMs)."""
    gen = torch.Generator().manual_seed(7)
    e, hd, inter, t, k = 6, 200, 72, 5, 2
    wgu, sgu = quant_block_fp8_ref(torch.randn(e, 2 * inter, hd, generator=gen) / math.sqrt(hd))
    wd, sd = quant_block_fp8_ref(torch.randn(e, hd, inter, generator=gen) / math.sqrt(inter))
    x = torch.randn(t, hd, generator=gen)
    x = (x * torch.tensor([1.0, 2.0**40, 2.0**-40, 0.0, 1.0])[:, None]).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend="triton")
    ref = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd)
    scale = ref.float().abs().amax(dim=1, keepdim=True)
    assert ((y.float() - ref.float()).abs() <= 2e-2 * scale).all()
    assert (y[3] == 0).all()
