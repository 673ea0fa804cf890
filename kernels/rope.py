"""Rotary embedding of the first `rope_dim` dims of every head, the rest copied: one kernel.

The references are the model's own `apply_rope_interleaved` (GLM: pairs (2i, 2i+1) in, the
rotated halves out as cat(even', odd')) and `apply_rope_half` (DeepSeek-V3.2's indexer:
rotate_half). In torch one application is seven to nine kernels (two strided slices multiplied by
cos and sin, a sub, an add, a cat, and a cat with the unrotated rest); a decode step applies it
four times per layer. The kernel rounds each product and each sum to x's dtype, as torch does, so
it matches the reference bit for bit.

    apply_rope(x [T, H, D] or [T, D], cos [T, R/2], sin [T, R/2], rope_dim=R, interleaved) -> same shape
"""

from __future__ import annotations

import torch

from .common import check, jit, next_pow2, pdl, pdl_wait, round_as, tl, use_triton


def apply_rope_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int | None = None,
    interleaved: bool = True,
) -> torch.Tensor:
    from longctx.model.rope import apply_rope_half, apply_rope_interleaved

    fn = apply_rope_interleaved if interleaved else apply_rope_half
    r = x.shape[-1] if rope_dim is None else rope_dim
    if r == x.shape[-1]:
        return fn(x, cos, sin)
    return torch.cat([fn(x[..., :r], cos, sin), x[..., r:]], dim=-1)


@jit
def _rotate(a, b, c, s):
    # (a, b) pairs in x's dtype, c / s fp32 (broadcastable) -> the rotated halves in fp32; each
    # product and each sum rounds to x's dtype, as the torch reference's separate ops do
    af, bf = a.to(tl.float32), b.to(tl.float32)
    ac = round_as(af * c, a)
    bs = round_as(bf * s, a)
    bc = round_as(bf * c, a)
    as_ = round_as(af * s, a)
    return round_as(ac - bs, a), round_as(bc + as_, a)


@jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr,
    H, D, sxt, sxh, sct, sst, syt, syh,
    R2: tl.constexpr, INTERLEAVED: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hs < H
    j = tl.arange(0, BR)
    jm = j < R2
    c = tl.load(cos_ptr + t * sct + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sst + j, mask=jm, other=0.0).to(tl.float32)
    xrow = x_ptr + t * sxt + hs[:, None] * sxh
    yrow = y_ptr + t * syt + hs[:, None] * syh
    m = hm[:, None] & jm[None, :]
    if INTERLEAVED:
        a = tl.load(xrow + 2 * j[None, :], mask=m, other=0.0)
        b = tl.load(xrow + 2 * j[None, :] + 1, mask=m, other=0.0)
    else:
        a = tl.load(xrow + j[None, :], mask=m, other=0.0)
        b = tl.load(xrow + R2 + j[None, :], mask=m, other=0.0)
    dt = a.dtype
    ra, rb = _rotate(a, b, c[None, :], s[None, :])
    tl.store(yrow + j[None, :], ra.to(dt), mask=m)
    tl.store(yrow + R2 + j[None, :], rb.to(dt), mask=m)
    # the unrotated rest of each head
    k = 2 * R2 + tl.arange(0, BD)
    km = hm[:, None] & (k < D)[None, :]
    tl.store(yrow + k[None, :], tl.load(xrow + k[None, :], mask=km, other=0.0), mask=km)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int | None = None,
    interleaved: bool = True,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """`apply_rope_ref` in one kernel. x [T, H, D] or [T, D] float with unit last stride (heads and
    tokens may be strided, e.g. a slice of a projection's output); cos/sin [T, R/2], R even <= D.
    Returns a new contiguous tensor of x's shape and dtype."""
    if not use_triton(backend, x.device):
        return apply_rope_ref(x, cos, sin, rope_dim, interleaved)
    check(x.dim() in (2, 3), f"apply_rope: x must be [T, D] or [T, H, D], got {tuple(x.shape)}")
    x3 = x if x.dim() == 3 else x[:, None, :]
    t, h, d = x3.shape
    r = d if rope_dim is None else rope_dim
    check(r % 2 == 0 and 0 < r <= d, f"apply_rope: rope_dim {r} must be even and in (0, {d}]")
    check(x3.stride(2) == 1, "apply_rope: x needs unit last stride")
    for name, v in (("cos", cos), ("sin", sin)):
        check(
            v.shape == (t, r // 2) and v.stride(1) == 1 and v.device == x.device and v.dtype == x.dtype,
            f"apply_rope: {name} must be [{t}, {r // 2}] in x's dtype with unit column stride, "
            f"got {tuple(v.shape)} {v.dtype}",
        )
    y3 = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t and h:
        bh = min(next_pow2(h), 16)
        _rope_kernel[(t, -(-h // bh))](
            x3, cos, sin, y3, h, d, x3.stride(0), x3.stride(1), cos.stride(0), sin.stride(0),
            y3.stride(0), y3.stride(1),
            R2=r // 2, INTERLEAVED=interleaved, BH=bh, BR=next_pow2(r // 2), BD=next_pow2(max(d - r, 1)),
            **pdl(x.device),
        )  # fmt: skip
    return y3 if x.dim() == 3 else y3[:, 0, :]


def rope_cos_sin_ref(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary angles' cos / sin [T, R/2] in `dtype` for positions [T] (`model.rope.RotaryEmbedding`'s
    math: fp32 angles position * inv_freq, times `scaling` (yarn) unless it is 1)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scaling != 1.0:  # x * 1.0 == x: default rope skips the two multiplies
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


@jit
def _cos_sin_kernel(
    pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, R2, scaling,
    SCALE: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    j = tl.arange(0, BR)
    rm = rows < T
    jm = j < R2
    p = tl.load(pos_ptr + rows, mask=rm, other=0).to(tl.float32)
    inv = tl.load(inv_ptr + j, mask=jm, other=0.0)
    f = p[:, None] * inv[None, :]
    c = tl.cos(f)
    s = tl.sin(f)
    if SCALE:
        c = c * scaling
        s = s * scaling
    m = rm[:, None] & jm[None, :]
    off = rows.to(tl.int64)[:, None] * R2 + j[None, :]
    tl.store(cos_ptr + off, c.to(cos_ptr.dtype.element_ty), mask=m)
    tl.store(sin_ptr + off, s.to(sin_ptr.dtype.element_ty), mask=m)


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    dtype: torch.dtype,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin_ref` in one kernel (a decode step's six small torch kernels before its first layer).
    positions [T] int, inv_freq [R/2] fp32 contiguous on positions' device. The cos / sin are the device
    math library's (the interpreter's: numpy's), which may differ from torch's in the last fp32 bit."""
    if not use_triton(backend, positions.device):
        return rope_cos_sin_ref(positions, inv_freq, scaling, dtype)
    check(
        positions.dim() == 1 and not positions.is_floating_point(), "rope_cos_sin: positions must be int [T]"
    )
    check(
        inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
        and inv_freq.device == positions.device,
        "rope_cos_sin: inv_freq must be a contiguous fp32 [R/2] on positions' device",
    )  # fmt: skip
    t, r2 = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(t, r2, dtype=dtype, device=positions.device)
    sin = torch.empty(t, r2, dtype=dtype, device=positions.device)
    if t and r2:
        bt = 16
        _cos_sin_kernel[(-(-t // bt),)](
            positions.contiguous(), inv_freq, cos, sin, t, r2, float(scaling),
            SCALE=scaling != 1.0, BT=bt, BR=next_pow2(r2), **pdl(positions.device),
        )  # fmt: skip
    return cos, sin
