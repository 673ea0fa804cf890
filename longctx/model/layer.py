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
        y, h = self.post_attention_layernorm.add_forward(self.self_attn(self.input_layernorm(x), ctx), x)
        if isinstance(self.mlp, MoE):
            # padding rows of a captured decode batch get no expert work
            valid = ctx.extras.get("valid")
            if self.mlp.partial_output:  # tensor parallel: the residual goes in after the reduce
                return h + self.mlp(y, valid, side=ctx.side)
            return self.mlp(y, valid, residual=h, side=ctx.side)  # h + experts, as one kernel
        return h + self.mlp(y)
