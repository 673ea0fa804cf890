"""SwiGLU's gate: silu(gate) * up over one [T, 2I] projection (gate columns first), one kernel.

The dense MLP and the shared experts run gate_proj and up_proj as one GEMM over their
concatenated weights, then this: torch would spend a silu and a mul kernel. Each result rounds
to x's dtype where torch's separate ops round.

    silu_mul(x [T, 2I]) -> [T, I]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check, jit, next_pow2, pdl, pdl_wait, round_as, tl, use_triton


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


@jit
def _silu_mul_kernel(x_ptr, y_ptr, I, sx, sy, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    g = tl.load(x_ptr + t * sx + c, mask=m, other=0.0)
    u = tl.load(x_ptr + t * sx + I + c, mask=m, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    s = round_as(gf / (1.0 + tl.exp(-gf)), g)
    tl.store(y_ptr + t * sy + c, round_as(s * u.to(tl.float32), g).to(dt), mask=m)


def silu_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """`silu_mul_ref` in one kernel. x [T, 2I] float with unit column stride."""
    if not use_triton(backend, x.device):
        return silu_mul_ref(x)
    check(x.dim() == 2 and x.shape[1] % 2 == 0, f"silu_mul: x must be [T, 2I], got {tuple(x.shape)}")
    check(x.stride(1) == 1 and x.dtype.is_floating_point, "silu_mul: float x with unit column stride")
    t, i = x.shape[0], x.shape[1] // 2
    y = torch.empty(t, i, dtype=x.dtype, device=x.device)
    if t and i:
        block = min(next_pow2(i), 1024)
        _silu_mul_kernel[(t, -(-i // block))](x, y, i, x.stride(0), y.stride(0), BLOCK=block, **pdl(x.device))
    return y
