"""The KV cache's kinds and what a token costs in them: pure arithmetic, no torch.

A `kv_dtype` (`longctx.config.KV_DTYPE_NAMES`) resolves to one pool kind per layer (`KVKinds`);
`mla_row_bytes` / `index_row_bytes` are a token's bytes in a kind (the layouts, byte by byte, are
`longctx.kernels.kv_layout`'s, which allocates with them) and `kv_bytes_per_token` a token's over a range of
layers. The engine sizes its pools (`longctx.kvstore.pool`) and `longctx plan` its budget
(`longctx.model.params`) with these same functions, so the plan's figures are the pools' own. It sits
below both: the model layer, where the planner's accounting lives, does not depend on kvstore, and the
planner does not import torch.

Names: a user's `kv_dtype` is read once, at the boundary (`check_kv_dtype`: any case, any alias), and from there
on a kind is compared by its exact name, here and in the kernels; a name a layout does not spell exactly
("FP8_E4M3", "BF16") is refused (`check_kind`), never taken for another kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longctx.config import (
    DTYPE_ALIASES,
    DTYPE_BYTES,
    DTYPE_NAMES,
    KV_DTYPE_ALIASES,
    ModelConfig,
    canonical_dtype,
    check_kv_dtype,
)
from longctx.errors import KernelInputError

if TYPE_CHECKING:
    import torch

KV_KINDS = ("auto", "bf16", "fp8")  # a pool's kinds: the model dtype, bf16, the 656-byte fp8 row


def resolve_kv_kind(kv_dtype: str, device: torch.device | str) -> str:
    """Public `kv_dtype` (any of its names) -> pool kind.

    "auto" is fp8 on CUDA and the model dtype elsewhere; "model" is always the model dtype.
    """
    name = check_kv_dtype(kv_dtype)
    if name == "auto":
        return "fp8" if str(device).split(":")[0] == "cuda" else "auto"
    return {"model": "auto", "bf16": "bf16", "fp8_e4m3": "fp8"}[name]


@dataclass(frozen=True)
class KVKinds:
    """The KV kind of every layer: `base`, except `model_layers`, held in the model dtype ("auto")."""

    base: str
    model_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.base not in KV_KINDS:
            raise KernelInputError(
                f"unknown KV kind {self.base!r}; expected one of {KV_KINDS} (a kv_dtype is read as one by "
                "resolve_kv_kinds)"
            )

    @classmethod
    def of(cls, kind: str | KVKinds) -> KVKinds:
        return kind if isinstance(kind, KVKinds) else cls(kind)

    def mla(self, layer: int) -> str:
        """Layout of the layer's MLA rows (latent + rope)."""
        return "auto" if layer in self.model_layers else self.base

    def index(self, layer: int) -> str:
        """Layout of the layer's index keys: fp8 beside fp8 rows, else the model dtype."""
        return index_kind(self.mla(layer))


def index_kind(mla_kind: str) -> str:
    """The index keys' kind beside MLA rows of `mla_kind` (a layout's name, `check_kind`): fp8 beside fp8, else
    the model dtype."""
    return "fp8" if is_fp8(mla_kind) else "auto"


def resolve_kv_kinds(
    kv_dtype: str, device: torch.device | str, fp8_skip_layers: Iterable[int] = ()
) -> KVKinds:
    """`resolve_kv_kind`, with `fp8_skip_layers` kept in the model dtype when the kind is fp8."""
    base = resolve_kv_kind(kv_dtype, device)
    return KVKinds(base, frozenset(fp8_skip_layers) if base == "fp8" else frozenset())


# ---- bytes of a row ----------------------------------------------------------------------------
# The layouts' kinds, by every name the config's tables give them: fp8 (`KV_DTYPE_ALIASES`), and dense,
# in the model dtype ("auto", "model") or in a dtype of its own, by any of its names (`DTYPE_ALIASES`).
FP8_KINDS = ("fp8_e4m3", *(a for a, name in KV_DTYPE_ALIASES.items() if name == "fp8_e4m3"))
DENSE_KINDS = ("auto", "model", *DTYPE_NAMES, *DTYPE_ALIASES)


def check_kind(kind: str) -> str:
    """`kind` when it is a layout's name exactly as FP8_KINDS / DENSE_KINDS spell it; else a KernelInputError.
    Kinds are compared by name (in the kernels too), so another spelling is refused rather than read as a
    kind it was not meant to be; a user's name goes through `check_kv_dtype` (any case) first."""
    if kind not in FP8_KINDS and kind not in DENSE_KINDS:
        raise KernelInputError(
            f"unknown KV kind {kind!r}; expected one of {FP8_KINDS + DENSE_KINDS} as written (a user's "
            "kv_dtype is read by longctx.config.check_kv_dtype first)"
        )
    return kind


def is_fp8(kind: str) -> bool:
    """True for the quantised uint8 layouts; raises for an unknown kind (`check_kind`)."""
    return check_kind(kind) in FP8_KINDS


def dense_dtype(kind: str, dtype: object = None) -> str:
    """The torch name of a dense kind's elements: its own dtype, or for "auto" / "model" `dtype` (the
    model dtype, a torch.dtype or a name; default bfloat16). Raises for an fp8 or unknown kind."""
    if is_fp8(kind):
        raise KernelInputError(f"KV kind {kind!r} is quantised: it has no dense dtype")
    name = canonical_dtype(kind) or canonical_dtype("bfloat16" if dtype is None else dtype)
    if name is None:
        raise KernelInputError(f"KV kind {kind!r} of dtype {dtype}: not one of {', '.join(DTYPE_BYTES)}")
    return name


def mla_group_size(kv_lora_rank: int) -> int:
    """Quantisation group of the fp8 latent: 128, or the whole latent when it is smaller."""
    g = min(128, kv_lora_rank)
    if kv_lora_rank % g or kv_lora_rank % 4:
        raise KernelInputError(f"kv_lora_rank {kv_lora_rank} must be a multiple of {g} and 4")
    return g


def mla_row_bytes(kv_lora_rank: int, rope_dim: int, kind: str, dtype: object = None) -> int:
    """Bytes per token of the MLA KV pool. `dtype` is the model dtype for kind "auto" (default bf16)."""
    if is_fp8(kind):
        if rope_dim % 2:
            raise KernelInputError(f"rope_dim {rope_dim} must be even")
        g = mla_group_size(kv_lora_rank)
        return kv_lora_rank + 4 * (kv_lora_rank // g) + 2 * rope_dim
    return (kv_lora_rank + rope_dim) * DTYPE_BYTES[dense_dtype(kind, dtype)]


def index_row_bytes(head_dim: int, kind: str, dtype: object = None) -> int:
    """Bytes per token of the indexer key pool (132 for D=128 fp8)."""
    if is_fp8(kind):
        if head_dim % 4:
            raise KernelInputError(f"index head_dim {head_dim} must be a multiple of 4")
        return head_dim + 4
    return head_dim * DTYPE_BYTES[dense_dtype(kind, dtype)]


def kv_bytes_per_token(
    cfg: ModelConfig, layers: range, kind: str | KVKinds, dtype: object
) -> tuple[int, int]:
    """Bytes one token's KV costs across `layers`: (MLA rows, index keys of the full layers), each layer
    in its kind; `dtype` is the model dtype (a torch.dtype or a name)."""
    kinds = KVKinds.of(kind)
    L, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    mla = sum(mla_row_bytes(L, R, kinds.mla(i), dtype) for i in layers)
    idx = sum(index_row_bytes(D, kinds.index(i), dtype) for i in layers if cfg.is_full_indexer(i))
    return mla, idx
