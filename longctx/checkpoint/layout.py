"""The on-disk tensor layout: Hugging Face names and shapes of a GLM-MoE-DSA / DeepSeek-V3.2 checkpoint.

This file is the single source of truth for which tensors a checkpoint holds; the random
initialiser writes exactly `expected_weights(cfg)` and the loader checks against it.
Names follow transformers' `GlmMoeDsaForCausalLM` / `DeepseekV32ForCausalLM` on disk, with
routed experts stored one tensor per expert (`mlp.experts.{e}.gate_proj.weight`), which is how
real checkpoints ship and what transformers fuses on load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from longctx.config import ModelConfig
from longctx.errors import ConfigError

Shape = tuple[int, ...]

SCALE_SUFFIX = "_scale_inv"  # `<weight name>_scale_inv`: fp32 block scales of an fp8 weight

# Linear weights that FP8 checkpoints store as float8_e4m3fn with 128x128 block scales.
# Kept in high precision, as DeepSeek-V3/V3.2 FP8 checkpoints do: embed_tokens, lm_head, every
# norm (incl. the indexer's LayerNorm weight+bias), the router (`mlp.gate.weight`,
# `e_score_correction_bias`) and the indexer's `weights_proj`.
_FP8_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
# Tensors the reference keeps in float32 whatever the model dtype (the router).
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def is_fp8_weight(name: str) -> bool:
    """True for the linear weights an FP8 checkpoint stores quantised (with `<name>_scale_inv`)."""
    return name.startswith("model.layers.") and name.endswith(_FP8_SUFFIXES)


def keeps_fp32(name: str) -> bool:
    """True for tensors held in float32 regardless of the model dtype (router weight and bias)."""
    return name.endswith(_FP32_SUFFIXES)


def layer_of(name: str) -> int | None:
    """The decoder layer index in a tensor name, or None for embed/norm/lm_head."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def layer_weights(cfg: ModelConfig, i: int) -> dict[str, Shape]:
    """Names and shapes of decoder layer `i`'s tensors, in checkpoint order."""
    h, p = cfg.hidden_size, f"model.layers.{i}"
    a = f"{p}.self_attn"
    heads = cfg.num_attention_heads
    out: dict[str, Shape] = {
        f"{a}.q_a_proj.weight": (cfg.q_lora_rank, h),
        f"{a}.q_a_layernorm.weight": (cfg.q_lora_rank,),
        f"{a}.q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
        f"{a}.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        f"{a}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        f"{a}.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        f"{a}.o_proj.weight": (h, heads * cfg.v_head_dim),
    }
    if cfg.attention_bias:
        out[f"{a}.q_a_proj.bias"] = (cfg.q_lora_rank,)
        out[f"{a}.kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
        out[f"{a}.o_proj.bias"] = (h,)
    # DeepSeek-V3.2 runs the indexer on every layer; GLM's IndexShare only on "full" layers.
    if cfg.model_type == "deepseek_v32" or cfg.is_full_indexer(i):
        x = f"{a}.indexer"
        out[f"{x}.wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        out[f"{x}.wk.weight"] = (cfg.index_head_dim, h)
        out[f"{x}.k_norm.weight"] = (cfg.index_head_dim,)
        out[f"{x}.k_norm.bias"] = (cfg.index_head_dim,)
        out[f"{x}.weights_proj.weight"] = (cfg.index_n_heads, h)
    if cfg.is_moe(i):
        m, e_inter = f"{p}.mlp", cfg.moe_intermediate_size
        out[f"{m}.gate.weight"] = (cfg.n_routed_experts, h)
        out[f"{m}.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            out.update(_mlp(f"{m}.experts.{e}", h, e_inter))
        out.update(_mlp(f"{m}.shared_experts", h, e_inter * cfg.n_shared_experts))
    else:
        out.update(_mlp(f"{p}.mlp", h, cfg.intermediate_size))
    out[f"{p}.input_layernorm.weight"] = (h,)
    out[f"{p}.post_attention_layernorm.weight"] = (h,)
    return out


def resolve_parts(
    cfg: ModelConfig, layers: Iterable[int] | None, embed: bool | None, head: bool | None
) -> tuple[list[int], bool, bool]:
    """Fill in defaults: all layers; embed when layer 0 is included; head when the last one is."""
    n = cfg.num_hidden_layers
    idx = list(range(n)) if layers is None else list(layers)
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise ConfigError(f"layer {bad[0]} is out of range: the model has {n} layers")
    if embed is None:
        embed = layers is None or 0 in idx
    if head is None:
        head = layers is None or (n - 1) in idx
    return idx, embed, head


def expected_weights(
    cfg: ModelConfig,
    layers: Iterable[int] | None = None,
    embed: bool | None = None,
    head: bool | None = None,
) -> dict[str, Shape]:
    """Checkpoint tensor names -> shapes for `layers` (default: all) in checkpoint order.

    `embed` adds `model.embed_tokens.weight`; `head` adds `model.norm.weight` and `lm_head.weight`
    (absent when `tie_word_embeddings`: the checkpoint then has no lm_head). Both default to
    whether the first / last layer of the model is among `layers`, so a pipeline stage asking
    for its own layer range gets exactly the tensors it owns. FP8 `_scale_inv` tensors are not
    listed; see `scale_shape`.
    """
    idx, embed, head = resolve_parts(cfg, layers, embed, head)
    out: dict[str, Shape] = {}
    if embed:
        out["model.embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in idx:
        out.update(layer_weights(cfg, i))
    if head:
        out["model.norm.weight"] = (cfg.hidden_size,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def scale_shape(shape: Shape, block: tuple[int, int]) -> Shape:
    """Shape of the fp32 block scales of a 2-D weight: one per (block[0] x block[1]) tile, ragged edges."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
