"""Dense MLP and the MoE block (noaux_tc sigmoid router + routed experts + shared experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from longctx.config import ModelConfig
from longctx.model.linear import Linear, linear, stack_weights
from longctx.model.ops import op
from longctx.model.overlap import SideStream

if TYPE_CHECKING:
    from longctx.kernels.moe import NormOut


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). Dense layers and the shared experts.

    After loading (`finalize`), plain (non-fp8) gate and up weights become two halves of one
    [2I, H] tensor, so the Triton path runs one GEMM and one `silu_mul` kernel instead of two GEMMs,
    a silu and a mul (no extra memory: the parameters are views of it)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.use_triton = False
        self._gate_up: torch.Tensor | None = None

    def finalize(self) -> None:
        self._gate_up = stack_weights([self.gate_proj, self.up_proj], self.gate_proj.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton and self._gate_up is not None and x.dim() == 2:
            return self.down_proj(
                op("activation", "silu_mul", True)(linear(x, self._gate_up, use_triton=True))
            )
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores + correction bias for the choice, group-limited top-k, scaled weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
        )
        self.done: torch.Tensor | None = None  # `kernels.moe.moe_router`'s counter (finalize)

    def finalize(self) -> None:
        """The one-launch router's counter (`kernels.moe.moe_router(done=)`), on the weight's device; this
        layer's router calls run one at a time (a stream's order, or a graph replayed in order)."""
        self.done = torch.zeros(1, dtype=torch.int32, device=self.weight.device)

    def forward(
        self, x: torch.Tensor, use_triton: bool = False, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_ids int64 [T, k], topk_w fp32 [T, k]); rows where `valid` [T] bool is
        False get ids -1 and weights 0 (in the router's own kernel on the Triton path)."""
        c = self.cfg
        return op("moe", "moe_router", use_triton)(
            x,
            self.weight,
            self.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            valid=valid,
            done=self.done,
        )


class Experts(nn.Module):
    """Routed experts stacked as transformers packs them: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)
        self.gate_up_scale: torch.Tensor | None = None  # fp8 block scales [E, 2I/128, H/128]
        self.down_scale: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor,
        use_triton: bool,
        *,
        shared: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        join: Callable[[], None] | None = None,
        norm_out: NormOut | None = None,
    ) -> torch.Tensor:
        """residual + (routed experts' sum + shared); the addends are optional [T, hidden] tensors
        (the Triton path adds them in the kernel that sums the k slots), `join` is called before
        `shared` is read; `norm_out` gets the result's RMSNorm (`kernels.moe.NormOut`)."""
        return op("moe", "moe_experts", use_triton)(
            x, ids, w, self.gate_up_proj, self.down_proj, "silu", self.gate_up_scale, self.down_scale,
            shared=shared, residual=residual, join=join, norm_out=norm_out,
        )  # fmt: skip


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        self.use_triton = False
        # True once tensor parallelism reduces this block's output (a partial sum) after it: the
        # decoder layer must then add its residual after the reduce, not pass it in.
        self.partial_output = False

    def forward(
        self,
        x: torch.Tensor,
        valid: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        side: SideStream | None = None,
        norm_out: NormOut | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> routed + shared experts [T, hidden], plus `residual` if given (the decoder
        layer's residual, added in the same kernel). `valid` [T] bool masks rows out of the routed
        experts (ids -> -1). With an active `side` stream the shared experts run there, beside the
        router and the routed experts, until the combine (overlap.py). `norm_out` (`kernels.moe.NormOut`):
        the combine also writes the result's RMSNorm into its buffer (the next layer's input norm)."""
        if self.shared_experts is not None and side is not None and side.active():
            with side.fork():
                shared = self.shared_experts(x)
            ids, w = self.gate(x, self.use_triton, valid)
            return self.experts(
                x,
                w,
                ids,
                self.use_triton,
                shared=shared,
                residual=residual,
                join=side.join,
                norm_out=norm_out,
            )
        ids, w = self.gate(x, self.use_triton, valid)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return self.experts(x, w, ids, self.use_triton, shared=shared, residual=residual, norm_out=norm_out)
