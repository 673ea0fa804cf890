"""Device-resident paged KV pools of one stage (the non-HiSparse `KVCache`).

Per layer of the stage one MLA pool [num_pages * page_size, row] and, for full-indexer layers,
one index-key pool of the same number of rows. Row `page * page_size + offset` holds the token at
`offset` of page `page`. Layouts (see `longctx.kernels.kv_layout`):
- kind "fp8":  656 B per token for GLM-5.3 (512 e4m3 latent + 4 fp32 scales + 64 bf16 rope), uint8;
- kind "bf16": latent + rope in bf16 (1152 B for GLM-5.3);
- kind "auto": latent + rope in the model dtype (exact parity with the reference on CPU).
Index keys: "fp8" (128 e4m3 + fp32 scale = 132 B) when the MLA kind is fp8, else the model dtype.
A `KVKinds` gives each layer its kind: one kind for all, except the layers an fp8 cache keeps in the
model dtype (`kv_fp8_skip_layers`: a checkpoint whose one layer loses to e4m3 rounding keeps that
layer's rows and keys exact and the rest in fp8).
The fp8 index pool is page-major (a page's 64 keys, then their 64 scales; `kv_layout`): its rows are
pages' bytes, not tokens, so only the kernels' addressing (`kv_layout.index_k_offsets`) reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.kernels.kv_layout import alloc_index_pool, alloc_mla_pool, index_row_bytes, mla_row_bytes
from longctx.kvstore.host_pool import HostKVSpec
from longctx.model.context import ForwardContext

KV_KINDS = ("auto", "bf16", "fp8")


def resolve_kv_kind(kv_dtype: str, device: torch.device) -> str:
    """Public `kv_dtype` ("auto" | "model" | "bf16" | "fp8_e4m3") -> pool kind.

    "auto" is fp8 on CUDA and the model dtype elsewhere; "model" is always the model dtype.
    """
    if kv_dtype == "auto":
        return "fp8" if device.type == "cuda" else "auto"
    if kv_dtype == "model":
        return "auto"
    if kv_dtype in ("fp8", "fp8_e4m3"):
        return "fp8"
    if kv_dtype == "bf16":
        return "bf16"
    raise ConfigError.about("kv_dtype", repr(kv_dtype), "must be 'auto', 'model', 'bf16' or 'fp8_e4m3'")


@dataclass(frozen=True)
class KVKinds:
    """The KV kind of every layer: `base`, except `model_layers`, held in the model dtype ("auto")."""

    base: str
    model_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.base not in KV_KINDS:
            raise ValueError(f"unknown KV kind {self.base!r}")

    @classmethod
    def of(cls, kind: str | KVKinds) -> KVKinds:
        return kind if isinstance(kind, KVKinds) else cls(kind)

    def mla(self, layer: int) -> str:
        """Layout of the layer's MLA rows (latent + rope)."""
        return "auto" if layer in self.model_layers else self.base

    def index(self, layer: int) -> str:
        """Layout of the layer's index keys: fp8 beside fp8 rows, else the model dtype."""
        return "fp8" if self.mla(layer) == "fp8" else "auto"


class HasKVKinds:
    """The `KVCache` protocol's `mla_kind` / `index_kind`, read from the cache's `kinds`."""

    kinds: KVKinds

    def mla_kind(self, layer: int) -> str:
        return self.kinds.mla(layer)

    def index_kind(self, layer: int) -> str:
        return self.kinds.index(layer)


def resolve_kv_kinds(kv_dtype: str, device: torch.device, fp8_skip_layers: Iterable[int] = ()) -> KVKinds:
    """`resolve_kv_kind`, with `fp8_skip_layers` kept in the model dtype when the kind is fp8."""
    base = resolve_kv_kind(kv_dtype, device)
    return KVKinds(base, frozenset(fp8_skip_layers) if base == "fp8" else frozenset())


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
        kinds = KVKinds.of(kind)
        L, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
        mla = sum(mla_row_bytes(L, R, kinds.mla(i), dtype) for i in layers)
        idx = sum(index_row_bytes(D, kinds.index(i), dtype) for i in layers if cfg.is_full_indexer(i))
        return mla + idx

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
