"""Linear layers that hold either a plain weight or an FP8 block-quantised one.

FP8 checkpoints store `weight` as float8_e4m3fn with `weight_scale_inv` fp32 scales, one per
`block` (128 x 128) tile. On CPU (and with backend="torch") the loader dequantises them; on the GPU
path they stay FP8 and `fp8_block_linear` dequantises tile by tile inside the GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


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
        if self.weight_scale_inv is None:
            return F.linear(x, self.weight)
        from longctx.kernels import fp8_gemm

        fn = fp8_gemm.fp8_block_linear if self.use_triton else fp8_gemm.fp8_block_linear_ref
        shape = x.shape
        y = fn(x.reshape(-1, shape[-1]), self.weight, self.weight_scale_inv, x.dtype)
        return y.view(*shape[:-1], self.out_features)


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
