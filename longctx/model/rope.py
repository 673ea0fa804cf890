"""Rotary position embedding, exactly as the reference applies it.

GLM-MoE-DSA and DeepSeek-V3.2 rotate only the `qk_rope_head_dim` slice. The main attention uses the
*interleaved* layout (pairs (x0, x1), (x2, x3), ... share a frequency) and writes the rotated pairs
back de-interleaved: `cat(even', odd')`. The DSA indexer rotates the first `qk_rope_head_dim` dims of
its 128-d heads: interleaved for glm_moe_dsa, half-split (`rotate_half`) for deepseek_v32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from longctx.config import ModelConfig
from longctx.model.ops import op


def _yarn_inv_freq(rp: dict, dim: int) -> tuple[torch.Tensor, float]:
    base = float(rp["rope_theta"])
    factor = float(rp["factor"])
    orig = int(rp["original_max_position_embeddings"])
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, shared by attention and indexer (both rotate `qk_rope_head_dim`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.qk_rope_head_dim
        rp = cfg.rope_parameters
        kind = rp.get("rope_type", "default")
        if kind == "default":
            inv_freq = 1.0 / (
                float(rp["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
            )
            self.attention_scaling = 1.0
        elif kind == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(rp, dim)
        else:
            raise ValueError(f"unsupported rope_type {kind!r}")
        # a plain attribute, not a buffer: the model is built on the meta device
        self.inv_freq = inv_freq
        self._cached: dict[torch.device, torch.Tensor] = {}
        self.use_triton = False  # (CausalLM.set_backend) one kernel for cos and sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, dim // 2] (one angle per rotated pair)."""
        inv = self._cached.get(positions.device)
        if inv is None:
            inv = self._cached.setdefault(positions.device, self.inv_freq.to(positions.device).contiguous())
        return op("rope", "rope_cos_sin", self.use_triton)(positions, inv, self.attention_scaling, dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., R]; cos/sin [T, R/2]. Output is de-interleaved: cat(even', odd')."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved (half-split, `rotate_half`) rope, as DeepSeek-V3.2's indexer applies it."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (2 * cos.shape[-1],)
    c = torch.cat([cos, cos], dim=-1).view(shape)
    s = torch.cat([sin, sin], dim=-1).view(shape)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * c + rot * s
