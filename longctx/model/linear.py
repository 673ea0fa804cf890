"""Linear layers that hold either a plain weight or an FP8 block-quantised one.

FP8 checkpoints store `weight` as float8_e4m3fn with `weight_scale_inv` fp32 scales, one per
`block` (128 x 128) tile. On CPU (and with backend="torch") the loader dequantises them; on the GPU
path they stay FP8 and `fp8_block_linear` dequantises tile by tile inside the GEMM.

`kernels.gemv` (a weight stream for a few token rows) can serve the decode projections on the
Triton backend: a forward of at most GEMV_MAX_M (plain weights) or GEMV_MAX_M_FP8 (FP8 weights)
rows goes to it. Both limits are 0 by default because it measured no faster on the H200
(bench/results/gemv-h200.md: inside CUDA graphs cuBLAS already reads large bf16 weights at 0.87-1.0
of the HBM rate, and `fp8_block_linear` beat it on FP8 weights); LONGCTX_GEMV_MAX_M /
LONGCTX_GEMV_MAX_M_FP8 set them for a process (A/B benches).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Token rows up to which the Triton backend runs a linear layer as `kernels.gemv` (0: never), for plain
# and FP8 weights; the environment overrides them for a process (A/B benches against cuBLAS).
GEMV_MAX_M = int(os.environ.get("LONGCTX_GEMV_MAX_M", "0"))
GEMV_MAX_M_FP8 = int(os.environ.get("LONGCTX_GEMV_MAX_M_FP8", "0"))


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, use_triton: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] in x's dtype; `scale_inv` makes `weight` FP8 block-scaled.

    Triton backend: `gemv` for at most GEMV_MAX_M (GEMV_MAX_M_FP8) rows, else cuBLAS (plain) or
    `fp8_block_linear`.
    Torch backend: F.linear or the FP8 reference (what the CPU engine and parity tests run)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if use_triton and x2.shape[0] <= (GEMV_MAX_M if scale_inv is None else GEMV_MAX_M_FP8):
        from longctx.kernels import gemv

        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = gemv.gemv(x2, weight, scale_inv, x.dtype, backend="triton")
    elif scale_inv is None:
        return F.linear(x, weight)
    else:
        from longctx.kernels import fp8_gemm

        fn = fp8_gemm.fp8_block_linear if use_triton else fp8_gemm.fp8_block_linear_ref
        y = fn(x2, weight, scale_inv, x.dtype)
    return y.view(*shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """y = x @ W.T (no bias: none of the checkpoint's projections has one)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight_scale_inv: torch.Tensor | None = None
        self.block: tuple[int, int] = (128, 128)
        self.use_triton = False

    def set_fp8(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (self.out_features, self.in_features)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = scale_inv.float()
        self.block = block

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (dequantised if FP8); used by the absorbed-MLA precomputation."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        from longctx.checkpoint.fp8 import dequantize_fp8_block

        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale_inv, self.use_triton)


def stack_weights(lins: Sequence[Linear], dtype: torch.dtype) -> torch.Tensor | None:
    """The weights of `lins` (projections of the same input) stacked [sum of out, in] in `dtype`, for
    one GEMM over all of them. Each weight already in `dtype` becomes a view of its rows (no extra
    memory); one in another dtype keeps its own parameter (the reference path's precision). None
    when any weight is FP8 or not loaded: those run one by one."""
    if any(lin.weight_scale_inv is not None or lin.weight.is_meta for lin in lins):
        return None
    stack = torch.cat([lin.weight.detach().to(dtype) for lin in lins])
    off = 0
    for lin in lins:
        if lin.weight.dtype == dtype:
            lin.weight = nn.Parameter(stack[off : off + lin.out_features], requires_grad=False)
        off += lin.out_features
    return stack
