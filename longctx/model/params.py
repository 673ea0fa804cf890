"""Parameter and byte accounting from a `ModelConfig`: pure arithmetic, no torch.

Every weight of the model is listed once, as a `Weight` carrying its checkpoint name, shape, whether
the FP8 checkpoint block-quantises it, and how tensor parallelism splits it. Parameter counts, weight
bytes per dtype (with the FP8 block scales) and per-TP-rank bytes all derive from that one list, so
they cannot disagree. Cache bytes (MLA KV, indexer keys) are here too, the other half of what
`longctx plan` budgets: the engine's pools' own, from `longctx.kv_kinds`.

Conventions (GLM-5.3 / DeepSeek-V3.2 FP8 checkpoints):
- FP8 (`e4m3`, one fp32 scale per 128x128 block): the attention projections, the indexer's `wq_b` and
  `wk`, dense MLPs, shared and routed experts.
- Kept in bf16: embeddings, `lm_head`, every norm, the router weight, the indexer's `weights_proj`.
- Kept in fp32: the router's `e_score_correction_bias`.
- The MTP (next-token prediction) layer is not part of `ModelConfig` and is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from longctx.config import ModelConfig, kv_dtype_name
from longctx.errors import ConfigError
from longctx.kv_kinds import (
    KVKinds,
    index_kind,
    index_row_bytes,
    kv_bytes_per_token,
    mla_row_bytes,
    resolve_kv_kinds,
)

WEIGHT_DTYPES = ("fp8", "bf16")
# The model dtype the engine serves in on CUDA, which `longctx plan` budgets: its caches' rows and the
# weights it keeps out of fp8 (`loaded_weight_bytes`) take this dtype.
PLAN_DTYPE = "bfloat16"
PLAN_ITEMSIZE = 2  # bytes of an element of PLAN_DTYPE
# Kept in fp32 by the engine's model whatever its dtype (`CausalLM.param_dtype`): the router and the
# indexer's head weights.
KEPT_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
# How tensor parallelism splits a weight: replicated on every rank, split along the output rows or
# the input columns, routed experts dealt out whole to ranks, or the vocabulary split into rows.
SHARDS = ("replicated", "out", "in", "experts", "vocab")
# Components, in the order reports list them.
COMPONENTS = (
    "attention",
    "indexer",
    "layer_norms",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router",
    "embed",
    "final_norm",
    "lm_head",
)


@dataclass(frozen=True)
class Weight:
    """One checkpoint tensor (or `count` identically shaped ones, e.g. the routed experts).

    `shape` is (out, in) for a linear weight, (n,) for a vector.
    """

    name: str
    shape: tuple[int, ...]
    component: str
    shard: str = "replicated"
    quant: bool = False  # block-quantised to fp8 in an fp8 checkpoint
    fp32: bool = False  # fp32 in every checkpoint
    count: int = 1

    @property
    def params(self) -> int:
        return self.count * math.prod(self.shape)

    def rank_shape(self, tp: int) -> tuple[tuple[int, ...], int]:
        """(shape, count) held by the most loaded of `tp` ranks."""
        if self.shard == "out" or self.shard == "vocab":
            return (-(-self.shape[0] // tp), *self.shape[1:]), self.count
        if self.shard == "in":
            return (*self.shape[:-1], -(-self.shape[-1] // tp)), self.count
        if self.shard == "experts":
            return self.shape, -(-self.count // tp)
        return self.shape, self.count

    def nbytes(
        self, weight_dtype: str = "bf16", tp: int = 1, block: tuple[int, int] = (128, 128), itemsize: int = 2
    ) -> int:
        """Bytes on the most loaded of `tp` ranks; fp8 adds one fp32 scale per `block` of the shard. A weight
        not in fp8 takes `itemsize` bytes an element (the model dtype's; 2 in a checkpoint)."""
        shape, count = self.rank_shape(tp)
        n = math.prod(shape)
        if self.fp32:
            return count * n * 4
        if weight_dtype == "fp8" and self.quant:
            out, inp = shape
            scales = -(-out // block[0]) * -(-inp // block[1])
            return count * (n + 4 * scales)
        return count * n * itemsize


def _linear(name: str, out: int, inp: int, component: str, shard: str, quant: bool = True) -> Weight:
    return Weight(name, (out, inp), component, shard, quant)


def _vector(name: str, n: int, component: str) -> Weight:
    return Weight(name, (n,), component)


def layer_weights(cfg: ModelConfig, layer: int) -> list[Weight]:
    """The weights of decoder layer `layer`, named as in the Hugging Face checkpoint."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    a = "self_attn."
    w = [
        _vector("input_layernorm.weight", h, "layer_norms"),
        _vector("post_attention_layernorm.weight", h, "layer_norms"),
        # A-projections and their norms are replicated: every rank needs the whole latent.
        _linear(a + "q_a_proj.weight", cfg.q_lora_rank, h, "attention", "replicated"),
        _vector(a + "q_a_layernorm.weight", cfg.q_lora_rank, "attention"),
        _linear(a + "kv_a_proj_with_mqa.weight", cfg.kv_cache_dim, h, "attention", "replicated"),
        _vector(a + "kv_a_layernorm.weight", cfg.kv_lora_rank, "attention"),
        # Up- and output projections split by heads.
        _linear(a + "q_b_proj.weight", nh * cfg.qk_head_dim, cfg.q_lora_rank, "attention", "out"),
        _linear(
            a + "kv_b_proj.weight",
            nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank,
            "attention",
            "out",
        ),
        _linear(a + "o_proj.weight", h, nh * cfg.v_head_dim, "attention", "in"),
    ]
    if cfg.attention_bias:
        w += [
            _vector(a + "q_a_proj.bias", cfg.q_lora_rank, "attention"),
            _vector(a + "kv_a_proj_with_mqa.bias", cfg.kv_cache_dim, "attention"),
            _vector(a + "o_proj.bias", h, "attention"),
        ]
    if cfg.is_full_indexer(layer):
        i, ni, di = a + "indexer.", cfg.index_n_heads, cfg.index_head_dim
        w += [  # replicated: every rank computes the same top-k
            _linear(i + "wq_b.weight", ni * di, cfg.q_lora_rank, "indexer", "replicated"),
            _linear(i + "wk.weight", di, h, "indexer", "replicated"),
            _vector(i + "k_norm.weight", di, "indexer"),
            _vector(i + "k_norm.bias", di, "indexer"),
            _linear(i + "weights_proj.weight", ni, h, "indexer", "replicated", quant=False),
        ]
    if cfg.is_moe(layer):
        m, f = "mlp.", cfg.moe_intermediate_size
        fs = f * cfg.n_shared_experts
        n = cfg.n_routed_experts
        w += [
            Weight(m + "gate.weight", (n, h), "router"),
            Weight(m + "gate.e_score_correction_bias", (n,), "router", fp32=True),
            Weight(m + "experts.{e}.gate_proj.weight", (f, h), "routed_experts", "experts", True, count=n),
            Weight(m + "experts.{e}.up_proj.weight", (f, h), "routed_experts", "experts", True, count=n),
            Weight(m + "experts.{e}.down_proj.weight", (h, f), "routed_experts", "experts", True, count=n),
        ]
        if fs:
            s = m + "shared_experts."
            w += [
                _linear(s + "gate_proj.weight", fs, h, "shared_experts", "out"),
                _linear(s + "up_proj.weight", fs, h, "shared_experts", "out"),
                _linear(s + "down_proj.weight", h, fs, "shared_experts", "in"),
            ]
    else:
        f = cfg.intermediate_size
        w += [
            _linear("mlp.gate_proj.weight", f, h, "dense_mlp", "out"),
            _linear("mlp.up_proj.weight", f, h, "dense_mlp", "out"),
            _linear("mlp.down_proj.weight", h, f, "dense_mlp", "in"),
        ]
    return [replace(x, name=f"model.layers.{layer}.{x.name}") for x in w]


def embed_weights(cfg: ModelConfig) -> list[Weight]:
    """What the first pipeline stage holds besides its layers."""
    return [Weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "embed", "vocab")]


def head_weights(cfg: ModelConfig) -> list[Weight]:
    """What the last pipeline stage holds besides its layers (a tied lm_head adds no parameters)."""
    w = [_vector("model.norm.weight", cfg.hidden_size, "final_norm")]
    if not cfg.tie_word_embeddings:
        w.append(Weight("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "lm_head", "vocab"))
    return w


def all_weights(cfg: ModelConfig) -> list[Weight]:
    out = embed_weights(cfg)
    for i in range(cfg.num_hidden_layers):
        out += layer_weights(cfg, i)
    return out + head_weights(cfg)


def _sum_params(ws: Iterable[Weight]) -> dict[str, int]:
    d = dict.fromkeys(COMPONENTS, 0)
    for x in ws:
        d[x.component] += x.params
    return d


def params_by_component(cfg: ModelConfig) -> dict[str, int]:
    """Total parameters per component (keys: `COMPONENTS`)."""
    return _sum_params(all_weights(cfg))


def layer_params(cfg: ModelConfig, layer: int) -> dict[str, int]:
    """Parameters of one decoder layer per component."""
    return _sum_params(layer_weights(cfg, layer))


def params_total(cfg: ModelConfig) -> int:
    """All parameters of the checkpoint's main model (MTP layer excluded)."""
    return sum(params_by_component(cfg).values())


def params_active(cfg: ModelConfig, *, full_embedding: bool = False) -> int:
    """Parameters one token uses: everything except the routed experts it is not sent to.

    A MoE layer contributes its router, shared experts and `num_experts_per_tok` of its routed
    experts; attention, the indexer (full layers only), norms, dense MLPs and `lm_head` (a full
    matmul per token) count whole. The embedding counts one row, the only part a token reads: this
    gives 40.3B for GLM-5.3 ("744B-A40B") and 37.5B for DeepSeek-V3.2 ("37B activated").
    `full_embedding=True` counts the whole embedding matrix as the source articles do (41.25B).
    """
    d = params_by_component(cfg)
    routed = d.pop("routed_experts")
    active = sum(d.values())
    if cfg.n_routed_experts:
        active += routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    if not full_embedding:
        active -= d["embed"] - cfg.hidden_size
    return active


def weight_dtype_name(text: str) -> str:
    """A weight dtype under its name in `WEIGHT_DTYPES`, read as the KV cache's names are
    (`kv_dtype_name`: fp8 by fp8_e4m3 too, bf16 by every name of bfloat16); anything else as given."""
    name = kv_dtype_name(text)
    return "fp8" if name == "fp8_e4m3" else name


def _check_weight_dtype(weight_dtype: str) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"weight dtype {weight_dtype!r}: choose one of {', '.join(WEIGHT_DTYPES)}")


def weights_nbytes(ws: Iterable[Weight], cfg: ModelConfig, weight_dtype: str, tp: int = 1) -> int:
    """Bytes of `ws` on the most loaded of `tp` ranks."""
    _check_weight_dtype(weight_dtype)
    block = cfg.quant_block or (128, 128)
    return sum(x.nbytes(weight_dtype, tp, block) for x in ws)


def model_weight_bytes(cfg: ModelConfig, weight_dtype: str = "fp8") -> int:
    """Bytes of the whole unsharded checkpoint on disk (MTP layer excluded); what a GPU holds once loaded is
    `loaded_weight_bytes`."""
    return weights_nbytes(all_weights(cfg), cfg, weight_dtype)


def _blocks_split(w: Weight, tp: int, block: tuple[int, int]) -> bool:
    """Whether every TP cut of `w` falls on a quantisation block: `longctx.stages.tp.TPShard` keeps such
    shards in fp8 and dequantises the others."""
    dim = 0 if w.shard == "out" else 1
    n = w.shape[dim]
    return all(n * r // tp % block[dim] == 0 for r in range(1, tp))


def loaded_weight_bytes(cfg: ModelConfig, layers: range, itemsize: int, fp8: bool, tp: int = 1) -> int:
    """Bytes of weights one of `tp` ranks holds for decoder layers `layers` (with the embedding when they
    start the model, the final norm and lm_head when they end it) as the engine loads them
    (`longctx.engine.worker.build_model`): in the model dtype of `itemsize` bytes, or with `fp8` the
    block-quantised weights kept in fp8 with their scales (a TP shard cut inside a block dequantised);
    `KEPT_FP32` in fp32; the embedding and lm_head vocab-parallel (`longctx.stages.tp`: ceil(vocab / tp)
    rows on the most loaded rank, the last, which also holds the widest of every other shard; a tied
    lm_head is the embedding's own rows where the range holds both, else a copy of them); and what
    `CausalLM.finalize` derives: the absorbed W_UK / W_UV (kv_b_proj's rows again in the model dtype)
    and, in the stacked x projections, a model-dtype copy of the fp32 weights_proj."""
    ws = [w for i in layers for w in layer_weights(cfg, i)]
    if layers.start == 0:
        ws += embed_weights(cfg)
    if layers.stop == cfg.num_hidden_layers:
        ws += head_weights(cfg)
        if cfg.tie_word_embeddings and layers.start != 0:  # (with the embedding: the same parameter)
            ws.append(Weight("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "lm_head", "vocab"))
    block = cfg.quant_block or (128, 128)
    kind = "fp8" if fp8 else "bf16"
    total = 0
    for w in ws:
        quant = w.quant and (w.shard not in ("out", "in") or _blocks_split(w, tp, block))
        w = replace(w, quant=quant, fp32=w.fp32 or w.name.endswith(KEPT_FP32))
        total += w.nbytes(kind, tp, block, itemsize)
    heads = -(-cfg.num_attention_heads // tp)
    for i in layers:
        total += heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * itemsize
        if not fp8 and itemsize != 4 and cfg.is_full_indexer(i):
            total += cfg.index_n_heads * cfg.hidden_size * itemsize
    return total


# ---- caches ------------------------------------------------------------------------------------
# Bytes as the engine's pools hold them (`longctx.kv_kinds`, what the kvstore allocates with), on CUDA and in
# the model dtype the engine serves there (`PLAN_DTYPE`).


def kv_kinds(cfg: ModelConfig, kv_dtype: str = "fp8_e4m3") -> KVKinds:
    """Each layer's pool kind in a CUDA cache of `kv_dtype` (any of its names): "auto" is fp8, and an fp8
    cache keeps the config's `kv_fp8_skip_layers` in the model dtype."""
    return resolve_kv_kinds(kv_dtype, "cuda", cfg.kv_fp8_skip_layers)


def kv_bytes_per_token_per_layer(cfg: ModelConfig, kv_dtype: str = "fp8_e4m3") -> int:
    """MLA cache bytes per token of a layer in the cache's own kind (not one kept out of fp8): 656 in fp8
    for GLM-5.3 (`longctx.kernels.kv_layout`), 1152 in bf16."""
    return mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_kinds(cfg, kv_dtype).base, PLAN_DTYPE)


def indexer_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "fp8_e4m3") -> int:
    """Indexer key bytes per token of a full-indexer layer in the cache's own kind: e4m3 key + one fp32
    scale (132 for GLM-5.3); beside bf16 rows the keys are bf16 too (256)."""
    return index_row_bytes(cfg.index_head_dim, index_kind(kv_kinds(cfg, kv_dtype).base), PLAN_DTYPE)


def kv_bytes_of_layers(
    cfg: ModelConfig, start: int, stop: int, kv_dtype: str = "fp8_e4m3"
) -> tuple[int, int]:
    """Bytes per token over layers [start, stop), each in its kind (`kv_kinds`): (MLA rows, index keys of
    the full-indexer layers)."""
    return kv_bytes_per_token(cfg, range(start, stop), kv_kinds(cfg, kv_dtype), PLAN_DTYPE)


def n_full_indexer_layers(cfg: ModelConfig, start: int = 0, stop: int | None = None) -> int:
    stop = cfg.num_hidden_layers if stop is None else stop
    return sum(cfg.is_full_indexer(i) for i in range(start, stop))
