"""The new tokens' KV, from projection output to pool row in one kernel: norm + rope + write.

A decode step's MLA layer normalises the latent (RMSNorm), rotates the rope key and writes both
into the paged pool; a full layer's indexer LayerNorms its key, rotates its first dims and writes
it into the index pool. Separately that is three kernels each (norm, rope, write); here it is one
program per token that normalises, rotates and stores (quantising for the fp8 layouts of
`kv_layout`, whose byte layouts and rounding it reuses).

    norm_rope_write_mla_kv(pool, slots, ckv [T, L + R], norm_w [L], eps, cos, sin, kind)
        == write_mla_kv(pool, slots, rms_norm(ckv[:, :L]), apply_rope(ckv[:, L:]), kind)
    ln_rope_write_index_k(pool, slots, k [T, D], ln_w [D], ln_b [D], eps, cos, sin, rope_dim,
                          interleaved, kind)
        == write_index_k(pool, slots, apply_rope(layer_norm(k), rope_dim, interleaved), kind)

Rounding: the RMSNorm and the rope round where the `norm` and `rope` kernels (and torch's separate
ops) round, so the MLA row is byte-identical to the three-kernel path. The LayerNorm computes in
fp32 and rounds once to k's dtype as torch's does, but its mean and variance are summed in
another order: its output may differ from torch's by one rounding step of k's dtype (then
quantised to e4m3 in the fp8 layout, whose step is 16x coarser than bf16's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check, jit, next_pow2, pdl, pdl_wait, round_as, tl, use_triton
from .kv_layout import (
    AMAX_EPS,
    PAGE_SIZE,
    _bf16_bits,
    _check_index_pool,
    _check_pool,
    _quant_store,
    _store_cast,
    index_fp8_offsets,
    is_fp8,
    mla_group_size,
    mla_row_bytes,
    write_index_k_ref,
    write_mla_kv_ref,
)
from .norm import rms_norm_ref
from .rope import _rotate, apply_rope_ref


def norm_rope_write_mla_kv_ref(
    pool: torch.Tensor,
    slots: torch.Tensor,
    ckv: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: str,
) -> None:
    """The three-op reference: RMSNorm of the latent, interleaved rope of the rest, write."""
    lora = norm_w.shape[0]
    c = rms_norm_ref(ckv[:, :lora], norm_w, eps)
    r = apply_rope_ref(ckv[:, lora:], cos, sin)
    write_mla_kv_ref(pool, slots, c, r, kind)


def ln_rope_write_index_k_ref(
    pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    ln_w: torch.Tensor,
    ln_b: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleaved: bool,
    kind: str,
) -> None:
    """The three-op reference: LayerNorm of the key, rope of its first `rope_dim` dims, write."""
    kn = F.layer_norm(k, (k.shape[1],), ln_w, ln_b, eps)
    write_index_k_ref(pool, slots, apply_rope_ref(kn, cos, sin, rope_dim, interleaved), kind)


@jit
def _norm_rope_mla_kernel(
    x_ptr, sx, w_ptr, cos_ptr, sin_ptr, sc, ss, slots_ptr, pool_ptr, eps,
    ROW: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, R2: tl.constexpr, R2P: tl.constexpr,
    FP8: tl.constexpr, GS: tl.constexpr, GSP: tl.constexpr, EPS8: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    xrow = x_ptr + t * sx
    offs = tl.arange(0, LP)
    x = tl.load(xrow + offs, mask=offs < L, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / L + eps)
    # the rope key: interleaved pairs in, cat(even', odd') out
    j = tl.arange(0, R2P)
    jm = j < R2
    c = tl.load(cos_ptr + t * sc + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * ss + j, mask=jm, other=0.0).to(tl.float32)
    a = tl.load(xrow + L + 2 * j, mask=jm, other=0.0)
    b = tl.load(xrow + L + 2 * j + 1, mask=jm, other=0.0)
    ra, rb = _rotate(a, b, c, s)
    if FP8:
        row8 = pool_ptr.to(tl.pointer_type(tl.float8e4nv)) + slot * ROW
        row32 = pool_ptr.to(tl.pointer_type(tl.float32)) + slot * (ROW // 4)
        go = tl.arange(0, GSP)
        gm = go < GS
        for g in tl.static_range(L // GS):
            xg = tl.load(xrow + g * GS + go, mask=gm, other=0.0)
            wg = tl.load(w_ptr + g * GS + go, mask=gm, other=0.0).to(tl.float32)
            cg = round_as(round_as(xg.to(tl.float32) * inv, xg) * wg, xg)
            scale = tl.fdiv(tl.maximum(tl.max(tl.abs(cg), axis=0), EPS8), 448.0, ieee_rounding=True)
            _quant_store(row8, g * GS + go, cg, gm, scale)
            tl.store(row32 + L // 4 + g, scale)
        row16 = pool_ptr.to(tl.pointer_type(tl.int16)) + slot * (ROW // 2) + (L + 4 * (L // GS)) // 2
        tl.store(row16 + j, _bf16_bits(ra), mask=jm)
        tl.store(row16 + R2 + j, _bf16_bits(rb), mask=jm)
    else:
        w = tl.load(w_ptr + offs, mask=offs < L, other=0.0).to(tl.float32)
        cn = round_as(round_as(xf * inv, x) * w, x)
        prow = pool_ptr + slot * ROW
        _store_cast(prow + offs, cn.to(dt), offs < L)
        _store_cast(prow + L + j, ra.to(dt), jm)
        _store_cast(prow + L + R2 + j, rb.to(dt), jm)


def _check_common(
    pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str
) -> None:
    check(x.dim() == 2 and x.stride(1) == 1, f"{name}: input must be [T, N] with unit column stride")
    check(x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"{name}: float input, got {x.dtype}")
    check(slots.shape == (x.shape[0],) and slots.dtype == torch.int64, f"{name}: slots must be int64 [T]")
    for what, v in (("cos", cos), ("sin", sin)):
        check(
            v.dim() == 2 and v.shape[0] == x.shape[0] and v.stride(1) == 1 and v.dtype == x.dtype,
            f"{name}: {what} must be [T, R/2] in the input's dtype with unit column stride",
        )
    check(len({t.device for t in (pool, slots, x, cos, sin)}) == 1, f"{name}: all tensors on one device")


def norm_rope_write_mla_kv(
    pool: torch.Tensor,
    slots: torch.Tensor,
    ckv: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: str,
    *,
    backend: str = "auto",
) -> None:
    """`norm_rope_write_mla_kv_ref` in one kernel: ckv [T, L + R] (kv_a_proj's output; rows may be
    strided, e.g. a slice of a wider GEMM output), norm_w [L] in ckv's dtype, cos / sin [T, R/2]
    in ckv's dtype, slots int64 [T] (distinct); pool and kind as `kv_layout.write_mla_kv`."""
    if not use_triton(backend, pool.device) or norm_w.dtype != ckv.dtype:
        norm_rope_write_mla_kv_ref(pool, slots, ckv, norm_w, eps, cos, sin, kind)
        return
    _check_common(pool, slots, ckv, cos, sin, "norm_rope_write_mla_kv")
    t, width = ckv.shape
    lora = norm_w.shape[0]
    r = width - lora
    check(
        norm_w.dim() == 1 and norm_w.is_contiguous() and 0 < lora < width, "norm_w must be [L], L < ckv width"
    )
    check(r % 2 == 0 and cos.shape[1] == r // 2, f"rope part of {r} dims needs cos / sin [T, {r // 2}]")
    fp8 = is_fp8(kind)
    _check_pool(pool, kind, mla_row_bytes(lora, r, kind) if fp8 else width)
    if t == 0:
        return
    g = mla_group_size(lora) if fp8 else lora
    _norm_rope_mla_kernel[(t,)](
        ckv, ckv.stride(0), norm_w, cos, sin, cos.stride(0), sin.stride(0), slots, pool, float(eps),
        ROW=pool.shape[1], L=lora, LP=next_pow2(lora), R2=r // 2, R2P=next_pow2(r // 2),
        FP8=fp8, GS=g, GSP=next_pow2(g), EPS8=AMAX_EPS, num_warps=2, **pdl(ckv.device),
    )  # fmt: skip


@jit
def _ln_rope_index_kernel(
    x_ptr, sx, w_ptr, b_ptr, cos_ptr, sin_ptr, sc, ss, slots_ptr, pool_ptr, eps,
    ROW: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, R2: tl.constexpr, R2P: tl.constexpr,
    INTERLEAVED: tl.constexpr, FP8: tl.constexpr, EPS8: tl.constexpr, PAGE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    xrow = x_ptr + t * sx
    offs = tl.arange(0, DP)
    dm = offs < D
    x = tl.load(xrow + offs, mask=dm, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=0) / D
    dev = tl.where(dm, xf - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(dev * dev, axis=0) / D + eps)
    # the rotated dims are normalised at the positions the rotation reads them from
    j = tl.arange(0, R2P)
    jm = j < R2
    if INTERLEAVED:
        ia, ib = 2 * j, 2 * j + 1
    else:
        ia, ib = j, R2 + j
    a = tl.load(xrow + ia, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(xrow + ib, mask=jm, other=0.0).to(tl.float32)
    a = round_as((a - mean) * rstd * tl.load(w_ptr + ia, mask=jm, other=0.0).to(tl.float32)
                 + tl.load(b_ptr + ia, mask=jm, other=0.0).to(tl.float32), x).to(dt)  # fmt: skip
    b = round_as((b - mean) * rstd * tl.load(w_ptr + ib, mask=jm, other=0.0).to(tl.float32)
                 + tl.load(b_ptr + ib, mask=jm, other=0.0).to(tl.float32), x).to(dt)  # fmt: skip
    c = tl.load(cos_ptr + t * sc + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * ss + j, mask=jm, other=0.0).to(tl.float32)
    ra, rb = _rotate(a, b, c, s)
    # the unrotated rest, dims [2 * R2, D)
    rm = dm & (offs >= 2 * R2)
    w = tl.load(w_ptr + offs, mask=rm, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + offs, mask=rm, other=0.0).to(tl.float32)
    rest = round_as(dev * rstd * w + bias, x)
    if FP8:
        amax = tl.maximum(
            tl.max(tl.where(jm, tl.abs(ra), 0.0), axis=0), tl.max(tl.where(jm, tl.abs(rb), 0.0), axis=0)
        )
        amax = tl.maximum(amax, tl.max(tl.where(rm, tl.abs(rest), 0.0), axis=0))
        scale = tl.fdiv(tl.maximum(amax, EPS8), 448.0, ieee_rounding=True)
        key_off, scale_off = index_fp8_offsets(slot, D, PAGE)  # the page-major fp8 index layout
        row8 = pool_ptr.to(tl.pointer_type(tl.float8e4nv)) + key_off
        _quant_store(row8, j, ra, jm, scale)
        _quant_store(row8, R2 + j, rb, jm, scale)
        _quant_store(row8, offs, rest, rm, scale)
        tl.store(pool_ptr.to(tl.pointer_type(tl.float32)) + scale_off, scale)
    else:
        prow = pool_ptr + slot * ROW
        _store_cast(prow + j, ra.to(dt), jm)
        _store_cast(prow + R2 + j, rb.to(dt), jm)
        _store_cast(prow + offs, rest.to(dt), rm)


def ln_rope_write_index_k(
    pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    ln_w: torch.Tensor,
    ln_b: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleaved: bool,
    kind: str,
    *,
    backend: str = "auto",
) -> None:
    """`ln_rope_write_index_k_ref` in one kernel: k [T, D] (wk's output; rows may be strided),
    ln_w / ln_b [D] in k's dtype, cos / sin [T, rope_dim / 2] in k's dtype, slots int64 [T]
    (distinct); pool and kind as `kv_layout.write_index_k`."""
    if not use_triton(backend, pool.device) or ln_w.dtype != k.dtype or ln_b.dtype != k.dtype:
        ln_rope_write_index_k_ref(pool, slots, k, ln_w, ln_b, eps, cos, sin, rope_dim, interleaved, kind)
        return
    _check_common(pool, slots, k, cos, sin, "ln_rope_write_index_k")
    t, d = k.shape
    check(
        ln_w.shape == (d,) and ln_b.shape == (d,) and ln_w.is_contiguous() and ln_b.is_contiguous(),
        f"ln_rope_write_index_k: ln_w and ln_b must be contiguous [{d}]",
    )
    check(
        rope_dim % 2 == 0 and 0 < rope_dim <= d and cos.shape[1] == rope_dim // 2,
        f"ln_rope_write_index_k: rope_dim {rope_dim} must be even, <= {d}, with cos / sin [T, {rope_dim // 2}]",
    )
    fp8 = is_fp8(kind)
    _check_index_pool(pool, kind, d)
    if t == 0:
        return
    _ln_rope_index_kernel[(t,)](
        k, k.stride(0), ln_w, ln_b, cos, sin, cos.stride(0), sin.stride(0), slots, pool, float(eps),
        ROW=pool.shape[1], D=d, DP=next_pow2(d), R2=rope_dim // 2, R2P=next_pow2(rope_dim // 2),
        INTERLEAVED=bool(interleaved), FP8=fp8, EPS8=AMAX_EPS, PAGE=PAGE_SIZE, num_warps=2, **pdl(k.device),
    )  # fmt: skip
