"""RMSNorm, alone and fused with the residual add that precedes it.

The reference normalises in fp32 and scales in the input dtype, as transformers' GLM/DeepSeek
RMSNorm does: y = w * to_dtype(x * rsqrt(mean(x^2) + eps)). The kernels round at the same
points (the normalised row to x's dtype, then the product with the weight), so they differ from
the reference only by the order of the fp32 sum of squares.

In torch a norm is six kernels (cast, pow, mean, add + rsqrt, mul, cast, mul) and the residual add
one more; a decode step runs four norms per layer, so at batch 1 these launches cost more than
the arithmetic. One program per row here.

    rms_norm(x [T, D], w [D], eps) -> [T, D]
    add_rms_norm(x [T, D], residual [T, D], w [D], eps) -> (rms_norm(x + residual), x + residual)
"""

from __future__ import annotations

import torch

from .common import check, jit, next_pow2, pdl, pdl_wait, round_as, tl, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


@jit
def rms_scale(xf, inv, w, like):
    """RMSNorm's output from fp32 values `xf` of a row, its 1 / rms `inv` and the fp32 weight `w`, rounded
    as the reference rounds: the normalised row to `like`'s dtype, then its product with the weight (fp32
    values of that dtype; kernels fusing a norm after their own work use it too, e.g. the MoE combine)."""
    return round_as(round_as(xf * inv, like) * w, like)


@jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
    D, sx, sr, sy, sh, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    if ADD:
        # the sum rounds to the input dtype first, as `x + residual` does in torch
        r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0)
        x = round_as(x.to(tl.float32) + r.to(tl.float32), x).to(x.dtype)
        tl.store(h_ptr + row * sh + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, rms_scale(xf, inv, w, x).to(x.dtype), mask=m)


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    check(x.dim() == 2, f"{name}: x must be [T, D], got {tuple(x.shape)}")
    check(x.stride(1) == 1, f"{name}: x needs unit column stride")
    check(weight.shape == (x.shape[1],), f"{name}: weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    check(weight.is_contiguous() and weight.device == x.device, f"{name}: weight contiguous on x's device")
    check(x.dtype.is_floating_point, f"{name}: x must be a float tensor")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, d = x.shape
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if t:
        r = residual if residual is not None else x
        hh = h if h is not None else y
        block = next_pow2(d)
        _rms_norm_kernel[(t,)](
            x, r, weight, y, hh, d, x.stride(0), r.stride(0), y.stride(0), hh.stride(0), float(eps),
            ADD=residual is not None, BLOCK=block, num_warps=max(1, min(8, block // 256)), **pdl(x.device),
        )  # fmt: skip
    return y, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """`rms_norm_ref` in one kernel. x [T, D] float (rows may be strided), weight [D]."""
    if not use_triton(backend, x.device) or weight.dtype != x.dtype:
        return rms_norm_ref(x, weight, eps)
    _check(x, weight, "rms_norm")
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` in one kernel: (norm of x + residual, x + residual)."""
    if not use_triton(backend, x.device) or weight.dtype != x.dtype:
        return add_rms_norm_ref(x, residual, weight, eps)
    _check(x, weight, "add_rms_norm")
    check(
        residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1,
        f"add_rms_norm: residual must match x {tuple(x.shape)} {x.dtype} with unit column stride",
    )
    y, h = _launch(x, residual, weight, eps)
    assert h is not None
    return y, h
