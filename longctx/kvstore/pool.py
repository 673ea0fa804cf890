"""Device-resident paged KV pools of one stage (the non-HiSparse `KVCache`).

Per layer of the stage one MLA pool [num_pages * page_size, row] and, for full-indexer layers,
one index-key pool of the same number of rows. Row `page * page_size + offset` holds the token at
`offset` of page `page`. Layouts (see `longctx.kernels.kv_layout`):
- kind "fp8":  656 B per token for GLM-5.3 (512 e4m3 latent + 4 fp32 scales + 64 bf16 rope), uint8;
- kind "bf16": latent + rope in bf16 (1152 B for GLM-5.3);
- kind "auto": latent + rope in the model dtype (exact parity with the reference on CPU).
Index keys: "fp8" (128 e4m3 + fp32 scale = 132 B) when the MLA kind is fp8, else the model dtype.
A `KVKinds` (`longctx.kv_kinds`, with the bytes of a row) gives each layer its kind: one kind for all,
except the layers an fp8 cache keeps in the model dtype (`kv_fp8_skip_layers`: a checkpoint whose one layer
loses to e4m3 rounding keeps that layer's rows and keys exact and the rest in fp8).
The fp8 index pool is page-major (a page's 64 keys, then their 64 scales; `kv_layout`): its rows are
pages' bytes, not tokens, so only the kernels' addressing (`kv_layout.index_k_offsets`) reads it.
"""

from __future__ import annotations

import torch

from longctx.config import ModelConfig
from longctx.kernels.kv_layout import alloc_index_pool, alloc_mla_pool
from longctx.kv_kinds import KVKinds, kv_bytes_per_token, mla_row_bytes
from longctx.kvstore.host_pool import HostKVSpec
from longctx.model.context import ForwardContext


class HasKVKinds:
    """The `KVCache` protocol's `mla_kind` / `index_kind`, read from the cache's `kinds`."""

    kinds: KVKinds

    def mla_kind(self, layer: int) -> str:
        return self.kinds.mla(layer)

    def index_kind(self, layer: int) -> str:
        return self.kinds.index(layer)


def host_kv_spec(
    cfg: ModelConfig, layers: range, num_slots: int, kind: str | KVKinds, dtype: torch.dtype
) -> HostKVSpec:
    """One region of [num_slots, MLA row bytes] per layer of the stage (same slot ids as the device), each
    layer's rows in its kind."""
    kinds = KVKinds.of(kind)
    rows = tuple(mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kinds.mla(i), dtype) for i in layers)
    return HostKVSpec(layers.start, layers.stop, num_slots, rows)


ROWS_OF_TOPK = "rows_of_topk"  # ForwardContext.extras key: (top-k tensor, its pool rows) of this pass


class PagedKVPool(HasKVKinds):
    """All KV of one stage on its device; implements `longctx.model.context.KVCache`."""

    dense_readable = True

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        num_pages: int,
        kind: str | KVKinds,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int = 64,
    ) -> None:
        self.kinds = KVKinds.of(kind)
        self.cfg, self.layers, self.kind = cfg, layers, self.kinds.base
        self.num_pages, self.page_size = num_pages, page_size
        self.num_slots = num_pages * page_size
        L, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
        # zero-filled so never-written rows dequantise to finite values
        self._mla = {
            i: alloc_mla_pool(self.num_slots, L, R, self.kinds.mla(i), dtype, device).zero_() for i in layers
        }
        self._index = {
            i: alloc_index_pool(self.num_slots, D, self.kinds.index(i), dtype, device).zero_()
            for i in layers
            if cfg.is_full_indexer(i)
        }

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, layers: range, kind: str | KVKinds, dtype: torch.dtype) -> int:
        """Device bytes one token costs across `layers` (MLA rows + index keys)."""
        return sum(kv_bytes_per_token(cfg, layers, kind, dtype))

    # ---- KVCache ---------------------------------------------------------------------------
    def mla_pool(self, layer: int) -> torch.Tensor:
        return self._mla[layer]

    def attend_pool(self, layer: int) -> torch.Tensor:
        return self._mla[layer]

    def index_pool(self, layer: int) -> torch.Tensor:
        return self._index[layer]

    def resolve(self, layer: int, topk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # shared (IndexShare) layers pass their full layer's top-k tensor itself: translate it once
        hit = ctx.extras.get(ROWS_OF_TOPK)
        if hit is not None and hit[0] is topk:
            return hit[1]
        rows = ctx.logical_to_rows(topk)
        ctx.extras[ROWS_OF_TOPK] = (topk, rows)
        return rows

    def after_write(self, layer: int, ctx: ForwardContext) -> None:
        pass

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._mla.values(), *self._index.values()))
