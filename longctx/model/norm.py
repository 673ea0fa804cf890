"""RMSNorm as the reference computes it: normalise in fp32, scale in the input dtype.

The math is `longctx.kernels.norm.rms_norm_ref`; with the Triton backend one kernel computes it, and
`add_forward` fuses the residual add in front of the norm (DecoderLayer's post-attention norm).
"""

from __future__ import annotations

import torch
from torch import nn

from longctx.model.ops import op


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return op("norm", "rms_norm", self.use_triton and x.dim() == 2)(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return op("norm", "add_rms_norm", self.use_triton and x.dim() == 2)(
            x, residual, self.weight, self.eps
        )
