"""Per-forward metadata: what the layers need to know about the batch and where its KV lives.

The engine (a stage worker) builds one `ForwardContext` per forward pass; the model only reads it.
Tokens of all requests in the batch are flattened into one dimension `T`; row `b` of the batch owns
tokens `q_start[b]:q_start[b+1]`. Nothing here knows about processes or devices beyond tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from longctx.model.ops import op
from longctx.model.overlap import SideStream


class KVCache(Protocol):
    """What an attention layer needs from the KV store of its stage.

    `mla_pool(layer)`: [num_slots, row] tensor holding the MLA latent + rope rows (layout
    `mla_kind(layer)`: "fp8" | "bf16" | "auto", see `longctx.kernels.kv_layout`).
    `index_pool(layer)`: [num_slots, row] tensor of indexer keys (full-indexer layers only; layout
    `index_kind(layer)`).
    `after_write(layer, ctx)`: new rows were written (HiSparse backs them up to the host pool).
    `resolve(layer, topk, ctx)`: map top-k logical positions [T, K] (-1 = none) to the rows of
    `attend_pool(layer)` to attend to. The paged pool maps through the page table; HiSparse maps
    to its device LRU slots, swapping misses in first.
    """

    dense_readable: bool  # every token's row is in mla_pool (False under HiSparse)

    def mla_kind(self, layer: int) -> str: ...

    def index_kind(self, layer: int) -> str: ...

    def mla_pool(self, layer: int) -> torch.Tensor: ...

    def index_pool(self, layer: int) -> torch.Tensor: ...

    def attend_pool(self, layer: int) -> torch.Tensor: ...

    def resolve(self, layer: int, topk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def after_write(self, layer: int, ctx: ForwardContext) -> None: ...


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64, absolute position of each token in its request
    q_seq: torch.Tensor  # [T] int32, batch row of each token
    q_start: list[int]  # [B + 1] token offsets of each row (host)
    seq_lens: torch.Tensor  # [B] int32, KV length of each row after this pass (device)
    seq_lens_cpu: list[int]  # the same on the host
    page_table: torch.Tensor  # [B, max_pages] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, pool row where each new token's KV is written
    kv: KVCache
    use_triton: bool = False
    prefill_form: str = "auto"  # "expanded" | "absorbed" | "auto" (how prefill rows attend)
    page_size: int = 64
    # filled while running the layers
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    cos_sin_index: tuple[torch.Tensor, torch.Tensor] | None = None
    prev_topk: torch.Tensor | None = None  # [T, K] logical positions from the last full layer
    # [T] keys each query may see (position + 1), made by the forward's first full indexer layer
    # for all of them; `CausalLM.forward` clears it (a decode graph's context is reused)
    key_lens: torch.Tensor | None = None
    # a second stream for a layer's independent parts while a decode graph is captured (overlap.py)
    side: SideStream | None = None
    extras: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.q_start) - 1

    @property
    def is_decode(self) -> bool:
        """Every row has exactly one query token."""
        return all(self.q_start[b + 1] - self.q_start[b] == 1 for b in range(self.num_rows))

    def logical_to_rows(self, topk: torch.Tensor) -> torch.Tensor:
        """Top-k logical positions [T, K] -> physical rows of the paged pool (-1 stays -1)."""
        return op("kv_layout", "logical_to_rows", self.use_triton)(
            topk, self.page_table, self.q_seq, self.page_size
        )
