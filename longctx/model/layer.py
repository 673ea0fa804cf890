"""One decoder layer: x + attn(norm(x)), then h + mlp(norm(h))."""

from __future__ import annotations

import torch
from torch import nn

from longctx.config import ModelConfig
from longctx.model.context import ForwardContext
from longctx.model.mla import MLAttention
from longctx.model.moe import MLP, MoE
from longctx.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.self_attn = MLAttention(cfg, layer)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.step(x, ctx)[0]

    def step(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        x_normed: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the layer's output h, next_norm(h) or None). `x_normed` is this layer's input norm of x when
        the layer before made it. An MoE layer on the Triton path computes `next_norm(h)` in the kernel
        that sums its experts (a norm launch fewer a layer) when `next_norm` is given; otherwise None and
        the caller norms h itself."""
        a_in = x_normed if x_normed is not None else self.input_layernorm(x)
        y, h = self.post_attention_layernorm.add_forward(self.self_attn(a_in, ctx), x)
        if isinstance(self.mlp, MoE):
            # padding rows of a captured decode batch get no expert work
            valid = ctx.extras.get("valid")
            if self.mlp.partial_output:  # tensor parallel: the residual goes in after the reduce
                return h + self.mlp(y, valid, side=ctx.side), None
            fuse = (
                next_norm is not None
                and self.mlp.use_triton
                and next_norm.use_triton
                and y.dim() == 2
                and next_norm.weight.dtype == y.dtype
            )
            if fuse:
                assert next_norm is not None
                normed = torch.empty_like(y)
                out = self.mlp(
                    y, valid, residual=h, side=ctx.side, norm_out=(normed, next_norm.weight, next_norm.eps)
                )
                return out, normed
            return self.mlp(y, valid, residual=h, side=ctx.side), None  # h + experts, as one kernel
        return h + self.mlp(y), None
