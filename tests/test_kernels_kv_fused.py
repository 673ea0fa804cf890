"""Norm + rope + KV write in one kernel (kernels/kv_fused.py): Triton (interpreter) against the
three kernels it replaces (byte for byte for the MLA row) and against the torch references.

Tolerances: the MLA row's RMSNorm sums squares in another order than torch's mean (fp32 rounding,
1e-5; in bf16 an output may move by one or two bf16 steps, as in test_kernels_norm_rope); the
LayerNorm's mean / variance likewise (one step of the dtype before the rope, then e4m3 rounding
in the fp8 layout: compared after dequantisation within one e4m3 step of the row's scale).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from longctx.kernels import kv_layout as kvl
from longctx.kernels.common import KernelInputError
from longctx.kernels.kv_fused import (
    ln_rope_write_index_k,
    ln_rope_write_index_k_ref,
    norm_rope_write_mla_kv,
    norm_rope_write_mla_kv_ref,
)
from longctx.kernels.norm import rms_norm
from longctx.kernels.rope import apply_rope

from . import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are built)

TRITON = "triton"


def _cos_sin(t: int, r2: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(t, r2, generator=g) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _pool_mla(n: int, lora: int, r: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    pool = kvl.alloc_mla_pool(n, lora, r, kind, dtype, "cpu")
    return pool.zero_()


@pytest.mark.parametrize(
    "t,lora,r,dtype,kind",
    [
        (3, 64, 16, torch.float32, "auto"),
        (2, 256, 64, torch.bfloat16, "fp8_e4m3"),  # two quantisation groups, GLM's rope width
        (4, 48, 6, torch.float32, "fp8_e4m3"),  # a group narrower than 128, not a power of two
        (5, 72, 10, torch.float16, "auto"),
        (1, 512, 64, torch.bfloat16, "bf16"),  # GLM-5.3's row at batch 1
        (3, 40, 8, torch.float32, "bf16"),  # fp32 model, bf16 pool: rounded on the store
    ],
)
def test_norm_rope_write_mla_kv_equals_the_three_kernels(t, lora, r, dtype, kind):
    g = torch.Generator().manual_seed(t * 1000 + lora + r)
    wide = (torch.randn(t, lora + r + 11, generator=g) * 3).to(dtype)
    ckv = wide[:, 5 : 5 + lora + r]  # strided rows, as a slice of the stacked projection's output
    w = (1 + 0.2 * torch.randn(lora, generator=g)).to(dtype)
    cos, sin = _cos_sin(t, r // 2, dtype, g)
    n = 70
    slots = torch.randperm(n, generator=g)[:t]
    fused = _pool_mla(n, lora, r, kind, dtype)
    norm_rope_write_mla_kv(fused, slots, ckv, w, 1e-6, cos, sin, kind, backend=TRITON)
    three = _pool_mla(n, lora, r, kind, dtype)
    c = rms_norm(ckv[:, :lora], w, 1e-6, backend=TRITON)
    rr = apply_rope(ckv[:, lora:], cos, sin, backend=TRITON)
    kvl.write_mla_kv(three, slots, c, rr, kind, backend=TRITON)
    assert torch.equal(fused.view(torch.uint8), three.view(torch.uint8))
    ref = _pool_mla(n, lora, r, kind, dtype)
    norm_rope_write_mla_kv_ref(ref, slots, ckv, w, 1e-6, cos, sin, kind)
    got_c, got_r = kvl.read_mla_kv_ref(fused, slots, kind, torch.float32, lora)
    ref_c, ref_r = kvl.read_mla_kv_ref(ref, slots, kind, torch.float32, lora)
    torch.testing.assert_close(got_r, ref_r, rtol=0, atol=0)  # the rope is bit-exact
    if dtype == torch.float32 and not kvl.is_fp8(kind):
        torch.testing.assert_close(got_c, ref_c, rtol=1e-5, atol=1e-5)
    else:  # a norm output one bf16 / fp16 step apart can land one e4m3 step apart
        step = ref_c.abs().amax(-1, keepdim=True) / 8 if kvl.is_fp8(kind) else 1.6e-2 * ref_c.abs() + 1e-2
        assert ((got_c - ref_c).abs() <= step).all()


@pytest.mark.parametrize(
    "t,d,rope_dim,interleaved,dtype,kind",
    [
        (3, 32, 16, True, torch.float32, "auto"),
        (2, 128, 64, True, torch.bfloat16, "fp8_e4m3"),  # GLM-5.3's indexer key
        (4, 128, 64, False, torch.bfloat16, "fp8_e4m3"),  # DeepSeek-V3.2's half-split rope
        (5, 40, 12, False, torch.float32, "auto"),
        (1, 24, 24, True, torch.float16, "auto"),  # every dim rotated
        (3, 36, 8, True, torch.float32, "fp8_e4m3"),
    ],
)
def test_ln_rope_write_index_k_matches_reference(t, d, rope_dim, interleaved, dtype, kind):
    g = torch.Generator().manual_seed(t * 100 + d + rope_dim)
    wide = (torch.randn(t, d + 7, generator=g) * 2 + 0.5).to(dtype)
    k = wide[:, 3 : 3 + d]
    ln_w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    ln_b = (0.1 * torch.randn(d, generator=g)).to(dtype)
    cos, sin = _cos_sin(t, rope_dim // 2, dtype, g)
    n = 128  # two pages
    slots = torch.randperm(n, generator=g)[:t]
    got = kvl.alloc_index_pool(n, d, kind, dtype, "cpu").zero_()
    ln_rope_write_index_k(
        got, slots, k, ln_w, ln_b, 1e-6, cos, sin, rope_dim, interleaved, kind, backend=TRITON
    )
    ref = kvl.alloc_index_pool(n, d, kind, dtype, "cpu").zero_()
    ln_rope_write_index_k_ref(ref, slots, k, ln_w, ln_b, 1e-6, cos, sin, rope_dim, interleaved, kind)
    written = torch.zeros(n, d, dtype=torch.bool)  # the bytes of the written keys only
    if kvl.is_fp8(kind):
        ko, so = kvl.index_k_offsets(slots, d)
        written = torch.zeros(got.numel(), dtype=torch.bool)
        written[ko[:, None] + torch.arange(d)] = True
        written[so[:, None] + torch.arange(4)] = True
        assert (got.view(-1)[~written] == 0).all()
    else:
        written[slots] = True
        assert (got[~written] == 0).all()
    gk = kvl.read_index_k_ref(got, slots, kind, torch.float32)
    rk = kvl.read_index_k_ref(ref, slots, kind, torch.float32)
    if kvl.is_fp8(kind):
        step = rk.abs().amax(-1, keepdim=True) / 8  # one e4m3 step at the top of the row's range
        assert ((gk - rk).abs() <= step).all()
        # most elements agree exactly: only a norm output near a rounding boundary moves
        assert (gk == rk).float().mean() >= 0.9
    elif dtype == torch.float32:
        torch.testing.assert_close(gk, rk, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(gk, rk, rtol=2e-2, atol=2e-2)
    # the reference is the model's three ops
    want = apply_rope(
        F.layer_norm(k, (d,), ln_w, ln_b, 1e-6), cos, sin, rope_dim, interleaved, backend="torch"
    )
    plain = kvl.alloc_index_pool(n, d, kind, dtype, "cpu").zero_()
    kvl.write_index_k_ref(plain, slots, want, kind)
    assert torch.equal(plain.view(torch.uint8), ref.view(torch.uint8))


def test_kv_fused_rejects_bad_input():
    g = torch.Generator().manual_seed(0)
    pool = _pool_mla(8, 64, 16, "auto", torch.float32)
    ckv = torch.randn(2, 80, generator=g)
    w = torch.ones(64)
    cos, sin = _cos_sin(2, 8, torch.float32, g)
    slots = torch.tensor([1, 2])
    with pytest.raises(KernelInputError, match="slots"):
        norm_rope_write_mla_kv(pool, slots.int(), ckv, w, 1e-6, cos, sin, "auto", backend=TRITON)
    with pytest.raises(KernelInputError, match="cos"):
        norm_rope_write_mla_kv(pool, slots, ckv, w, 1e-6, cos[:, :4], sin, "auto", backend=TRITON)
    with pytest.raises(KernelInputError, match="pool row"):  # a pool laid out for R = 6
        norm_rope_write_mla_kv(_pool_mla(8, 64, 6, "auto", torch.float32), slots, ckv, w, 1e-6, cos, sin, "auto",
                               backend=TRITON)  # fmt: skip
    ipool = kvl.alloc_index_pool(64, 32, "fp8_e4m3", torch.float32, "cpu")
    k = torch.randn(2, 32, generator=g)
    with pytest.raises(KernelInputError, match="rope_dim"):
        ln_rope_write_index_k(ipool, slots, k, torch.ones(32), torch.zeros(32), 1e-6, cos, sin, 12, True,
                              "fp8_e4m3", backend=TRITON)  # fmt: skip
