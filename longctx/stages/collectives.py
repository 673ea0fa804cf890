"""The collectives a stage's TP group runs inside the model's forward, as `longctx.stages.tp`'s hooks take them.

`Reduce` sums partial outputs in place (o_proj, the MLP / MoE, the vocab-parallel embedding); `Gather`
assembles the vocab-parallel lm_head's logits. Both are plain callables over one tensor, so the hooks
know nothing about process groups and a test can hand in its own. `group_reduce` / `group_gather` make
them for a torch.distributed group, the same code for NCCL (GPUs) and gloo (CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Reduce = Callable[[torch.Tensor], None]  # in-place sum over the stage's TP ranks
# every rank's tensor of one shape, stacked in rank order: t [*s] -> [tp, *s]
Gather = Callable[[torch.Tensor], torch.Tensor]

# torch 2.13 renamed all_gather_into_tensor (still there, deprecated); both fill one output tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_reduce(group: Any) -> Reduce:
    """All-reduce (sum) over `group`, in place."""

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    return reduce


def group_gather(group: Any) -> Gather:
    """All-gather over `group`: every rank passes a tensor of the same shape and gets all of them,
    [world, *shape]. One output tensor filled by one collective (the concatenation along dim 0 that
    NCCL and gloo both take), not a list of per-rank tensors to copy together."""
    world = dist.get_world_size(group)

    def gather(t: torch.Tensor) -> torch.Tensor:
        flat = t.contiguous().view(1, t.numel())
        out = torch.empty(world, t.numel(), dtype=t.dtype, device=t.device)
        _all_gather_single(out, flat, group=group)
        return out.view(world, *t.shape)

    return gather
