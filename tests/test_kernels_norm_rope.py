"""RMSNorm (+ residual add) and rotary kernels: Triton (interpreter) vs the model's references."""

from __future__ import annotations

import pytest
import torch
from longctx.kernels.common import KernelInputError
from longctx.kernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from longctx.kernels.rope import apply_rope, apply_rope_ref

from . import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are built)


def _tol(dtype: torch.dtype) -> dict:
    # the kernels sum squares in another order than torch's mean: in bf16 one ulp of the normalised
    # row can become two of the output after the product with the weight
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 64), (5, 384), (3, 2048), (7, 130)])
def test_rms_norm_matches_reference(dtype, t, d):
    g = torch.Generator().manual_seed(t * d)
    x = (torch.randn(t, d + 9, generator=g) * torch.exp(torch.randn(t, 1, generator=g))).to(dtype)
    x = x[:, 3 : 3 + d]  # a strided view, as kv_a_layernorm's input is
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    got = rms_norm(x, w, 1e-5, backend="triton")
    want = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 64), (4, 2048), (9, 200)])
def test_add_rms_norm_matches_reference_and_returns_the_sum(dtype, t, d):
    g = torch.Generator().manual_seed(7 + t + d)
    x = torch.randn(t, d, generator=g).to(dtype)
    res = (10 * torch.randn(t, d, generator=g)).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    y, h = add_rms_norm(x, res, w, 1e-6, backend="triton")
    y_ref, h_ref = add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(h, h_ref)  # the sum is one rounding of x + residual either way
    torch.testing.assert_close(y, y_ref, **_tol(dtype))


def test_norm_wrappers_reject_bad_shapes():
    x = torch.randn(3, 8)
    with pytest.raises(KernelInputError):
        rms_norm(x, torch.ones(7), 1e-5, backend="triton")
    with pytest.raises(KernelInputError):
        rms_norm(x.t(), torch.ones(3), 1e-5, backend="triton")  # columns not unit-stride
    with pytest.raises(KernelInputError):
        add_rms_norm(x, torch.randn(3, 9), torch.ones(8), 1e-5, backend="triton")
    assert rms_norm(torch.empty(0, 8), torch.ones(8), 1e-5, backend="triton").shape == (0, 8)


def _cos_sin(t: int, r: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 1 << 20, (t,), generator=g).float()  # positions up to 1M, as at long contexts
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r))
    f = pos[:, None] * inv[None, :]
    return f.cos().to(dtype), f.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(
    "t,h,d,r",
    [(1, 64, 64, 64), (3, 8, 256, 64), (5, 1, 64, 64), (2, 32, 128, 64), (4, 20, 40, 32), (6, 3, 12, 6)],
)
def test_rope_matches_reference_bit_for_bit(dtype, interleaved, t, h, d, r):
    g = torch.Generator().manual_seed(t * 1000 + h * 10 + d)
    # a strided slice of a wider projection, as MLA's q[..., nope:] is
    base = torch.randn(t, h, d + 16, generator=g).to(dtype)
    x = base[..., 16:]
    cos, sin = _cos_sin(t, r, dtype, g)
    got = apply_rope(x, cos, sin, rope_dim=r, interleaved=interleaved, backend="triton")
    want = apply_rope_ref(x, cos, sin, rope_dim=r, interleaved=interleaved)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_a_2d_key(dtype):
    g = torch.Generator().manual_seed(3)
    ckv = torch.randn(7, 512 + 64, generator=g).to(dtype)
    k = ckv[:, 512:]  # MLA's rope key: the tail of kv_a_proj's output
    cos, sin = _cos_sin(7, 64, dtype, g)
    got = apply_rope(k, cos, sin, backend="triton")
    assert got.shape == (7, 64) and torch.equal(got, apply_rope_ref(k, cos, sin))


def test_rope_rejects_bad_inputs():
    x = torch.randn(2, 4, 16)
    cos, sin = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(KernelInputError):
        apply_rope(x, cos[:, :4], sin, backend="triton")
    with pytest.raises(KernelInputError):
        apply_rope(x, cos, sin, rope_dim=7, backend="triton")
    with pytest.raises(KernelInputError):
        apply_rope(x, cos.double(), sin.double(), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,i", [(1, 512), (3, 96), (5, 1500)])
def test_silu_mul_matches_reference(dtype, t, i):
    from longctx.kernels.activation import silu_mul, silu_mul_ref

    g = torch.Generator().manual_seed(t + i)
    x = (3 * torch.randn(t, 2 * i, generator=g)).to(dtype)
    got = silu_mul(x, backend="triton")
    want = silu_mul_ref(x)
    assert got.shape == (t, i) and got.dtype == dtype
    # exp differs in its last bit between implementations: one ulp in bf16
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(KernelInputError):
        silu_mul(torch.randn(2, 5), backend="triton")


@pytest.mark.parametrize(
    ("t", "r2", "scaling", "dtype"), [(1, 32, 1.0, torch.bfloat16), (37, 4, 1.25, torch.float32)]
)
def test_rope_cos_sin_kernel_matches_reference(t, r2, scaling, dtype):
    """The rotary cos / sin in one kernel: positions up to 1M, yarn's scaling; the math library's cos / sin may
    differ from torch's in the last fp32 bit, so within two fp32 ulps (and one step of bf16)."""
    from longctx.kernels.rope import rope_cos_sin, rope_cos_sin_ref

    gen = torch.Generator().manual_seed(t + r2)
    pos = torch.randint(0, 1 << 20, (t,), generator=gen)
    inv = 1.0 / (1e6 ** (torch.arange(0, 2 * r2, 2, dtype=torch.float32) / (2 * r2)))
    got = rope_cos_sin(pos, inv, scaling, dtype, backend="triton")
    want = rope_cos_sin_ref(pos, inv, scaling, dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == (t, r2)
        tol = 2 * 2.0**-23 * scaling if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=tol)
