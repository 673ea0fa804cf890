"""Layer partition: split L decoder layers into P contiguous pipeline stages, and budget each stage.

Cost model (`CostModel`, one decode step of `batch` requests at `context` tokens, per GPU):

    time = bytes / hbm_bytes_per_s + flops / flops_per_s
    bytes = weights read + batch * (top-k MLA KV read + [full indexer layer] context * indexer key bytes)
    flops = batch * (2 * active params on this rank + sparse MLA core + [full] 2 * idx_heads * idx_dim * context)

A MoE layer reads its attention, router and shared experts plus the expected fraction of its routed
experts that `batch` tokens touch (uniform routing: 1 - (1 - k/n)^batch). The indexer is O(context)
per decoded token, so at 1M a full-indexer layer costs noticeably more than a shared one. Stage 0 adds
the embedding lookup, the last stage the final norm, `lm_head` (a bf16 matrix the size of the
vocabulary, about three layers' worth of reads for GLM-5.3) and sampling.

`balanced_split` minimises the largest stage cost exactly (DP over contiguous splits, O(P*L^2)) and,
among the splits reaching that optimum, picks the one with the smallest sum of squared stage costs,
so stages that are not the bottleneck are balanced too.

Memory per stage: see `StagePlan` and `activation_headroom`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.model.params import (
    PLAN_ITEMSIZE,
    embed_weights,
    head_weights,
    kv_bytes_of_layers,
    kv_kinds,
    layer_weights,
    loaded_weight_bytes,
    n_full_indexer_layers,
    weights_nbytes,
)

PAGE_TOKENS = 64  # KV pages hold 64 tokens: a request's cache is whole pages
DEFAULT_GPU_MEM = 140 * 2**30  # H200: 143,771 MiB reported, less the CUDA context
DEFAULT_CHUNK = 8192
ACT_BYTES = 2  # bf16 activations


@dataclass(frozen=True)
class CostModel:
    """Decode-step time proxy on one GPU (H200 ceilings measured on this machine class)."""

    hbm_bytes_per_s: float = 4.24e12
    flops_per_s: float = 1.372e15  # fp8 GEMM; bf16 is 768e12
    batch: int = 1

    @classmethod
    def for_weights(cls, weight_dtype: str, batch: int = 1) -> CostModel:
        return cls(flops_per_s=1.372e15 if weight_dtype == "fp8" else 768e12, batch=batch)


def _weight_traffic(
    cfg: ModelConfig, layer: int, tp: int, weight_dtype: str, batch: int
) -> tuple[float, float]:
    """(bytes of weights read per decode step, matmul flops per token) on one TP rank."""
    ws = layer_weights(cfg, layer)
    k, n = cfg.num_experts_per_tok, max(cfg.n_routed_experts, 1)
    nbytes = 0.0
    flops = 0.0
    for w in ws:
        b = float(weights_nbytes([w], cfg, weight_dtype, tp))
        p = float(w.params)
        if w.component == "routed_experts":
            b *= 1.0 - (1.0 - k / n) ** batch
            p *= k / n
        if w.shard != "replicated":
            p /= tp
        nbytes += b
        flops += 2.0 * p
    return nbytes, flops


def layer_cost(
    cfg: ModelConfig,
    layer: int,
    context: int,
    *,
    tp: int = 1,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8_e4m3",
    model: CostModel | None = None,
) -> float:
    """Seconds one GPU of the stage spends on `layer` per decode step (see module docstring)."""
    cm = model or CostModel.for_weights(weight_dtype)
    wbytes, wflops = _weight_traffic(cfg, layer, tp, weight_dtype, cm.batch)
    sel = min(cfg.index_topk, context)
    heads = -(-cfg.num_attention_heads // tp)
    # Absorbed sparse MLA: scores over latent+rope, then values over the latent, for `sel` tokens.
    flops = wflops + 2.0 * heads * sel * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    mla, index = kv_bytes_of_layers(cfg, layer, layer + 1, kv_dtype)
    nbytes = sel * mla + context * index
    if cfg.is_full_indexer(layer):  # replicated: every rank scans all keys
        flops += 2.0 * cfg.index_n_heads * cfg.index_head_dim * context
    b = cm.batch
    return (wbytes + b * nbytes) / cm.hbm_bytes_per_s + b * flops / cm.flops_per_s


def embed_cost(cfg: ModelConfig, *, model: CostModel | None = None) -> float:
    """Stage 0 extra: one embedding row per request."""
    cm = model or CostModel()
    return cm.batch * cfg.hidden_size * ACT_BYTES / cm.hbm_bytes_per_s


def head_cost(
    cfg: ModelConfig, *, tp: int = 1, weight_dtype: str = "fp8", model: CostModel | None = None
) -> float:
    """Last-stage extra: final norm + lm_head (its vocabulary rows on this rank) + sampling."""
    cm = model or CostModel.for_weights(weight_dtype)
    wbytes = weights_nbytes(head_weights(cfg), cfg, weight_dtype, tp)
    if cfg.tie_word_embeddings:  # a tied lm_head: no parameter of its own, but its GEMM reads the rows
        wbytes += weights_nbytes(embed_weights(cfg), cfg, weight_dtype, tp)
    vocab = -(-cfg.vocab_size // tp)
    flops = cm.batch * 2.0 * cfg.hidden_size * vocab
    sample_bytes = cm.batch * cfg.vocab_size * 4 * 3  # fp32 logits: softmax, top-p, draw
    # lm_head stays bf16 in fp8 checkpoints, so it runs at the bf16 rate.
    return (wbytes + sample_bytes) / cm.hbm_bytes_per_s + flops / min(cm.flops_per_s, 768e12)


def layer_costs(
    cfg: ModelConfig,
    context: int,
    *,
    tp: int = 1,
    weight_dtype: str = "fp8",
    kv_dtype: str = "fp8_e4m3",
    model: CostModel | None = None,
) -> list[float]:
    return [
        layer_cost(cfg, i, context, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, model=model)
        for i in range(cfg.num_hidden_layers)
    ]


# ---- splitting -------------------------------------------------------------------------------------
def stage_costs(
    costs: Sequence[float],
    bounds: Sequence[tuple[int, int]],
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[float]:
    out = [float(sum(costs[a:b])) for a, b in bounds]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def balanced_split(
    costs: Sequence[float], pp: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[tuple[int, int]]:
    """Contiguous non-empty [a, b) ranges for `pp` stages minimising the largest stage cost.

    `first_extra`/`last_extra` are added to the first/last stage (embedding; norm + lm_head).
    """
    n = len(costs)
    if not 1 <= pp <= n:
        raise ConfigError(f"pp={pp} needs between 1 and {n} stages (one layer at least per stage)")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + float(c))

    def seg(i: int, j: int, s: int) -> float:
        c = pre[j] - pre[i]
        if s == 0:
            c += first_extra
        if s == pp - 1:
            c += last_extra
        return c

    inf = math.inf
    # best[s][j]: least possible max cost of layers [0, j) split into stages 0..s.
    best = [[inf] * (n + 1) for _ in range(pp)]
    for j in range(1, n + 1):
        best[0][j] = seg(0, j, 0)
    for s in range(1, pp):
        for j in range(s + 1, n + 1):
            best[s][j] = min(max(best[s - 1][i], seg(i, j, s)) for i in range(s, j))
    cap = best[pp - 1][n] * (1 + 1e-9) + 1e-300

    # Second pass: least sum of squares among splits whose every stage stays within the optimum.
    sq = [[inf] * (n + 1) for _ in range(pp)]
    back = [[0] * (n + 1) for _ in range(pp)]
    for j in range(1, n + 1):
        c = seg(0, j, 0)
        if c <= cap:
            sq[0][j] = c * c
    for s in range(1, pp):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = seg(i, j, s)
                if c <= cap and sq[s - 1][i] + c * c < sq[s][j]:
                    sq[s][j] = sq[s - 1][i] + c * c
                    back[s][j] = i
    bounds = []
    j = n
    for s in range(pp - 1, 0, -1):
        i = back[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


def split_from_boundaries(layer_split: Sequence[int], pp: int, n_layers: int) -> list[tuple[int, int]]:
    """Stage ranges from a hand-written split: `pp - 1` cut points (e.g. 10,20,30 for pp=4) or all
    `pp + 1` boundaries including 0 and `n_layers`."""
    b = [int(x) for x in layer_split]
    if len(b) == pp - 1:
        b = [0, *b, n_layers]
    elif len(b) != pp + 1:
        raise ConfigError(
            f"layer split for pp={pp} needs {pp - 1} cut points or {pp + 1} boundaries, got {len(b)} values"
        )
    if b[0] != 0 or b[-1] != n_layers:
        raise ConfigError(f"layer split must cover [0, {n_layers}): boundaries {b} do not")
    for s in range(pp):
        if b[s] >= b[s + 1]:
            raise ConfigError(
                f"layer split must be strictly increasing: stage {s} would hold layers [{b[s]}, {b[s + 1]})"
            )
    return [(b[s], b[s + 1]) for s in range(pp)]


# ---- memory --------------------------------------------------------------------------------------
def activation_headroom(
    cfg: ModelConfig, layers: tuple[int, int], context: int, chunk: int, tp: int, *, has_head: bool
) -> int:
    """Bytes of transient memory one GPU of the stage needs to prefill a chunk of T tokens against a
    `context`-token cache (T = min(chunk, context); bf16 activations; layers run one at a time):

        hidden    = 3 T hidden x 2                      residual, layer input, normed input
        attention = T (q_lora + kv_lora + rope) x 2     A-projection outputs
                  + T h (qk_head + (kv_lora + rope) + (kv_lora + v)) x 2
                                                        q, absorbed q, latent + V outputs; h = heads / tp
                  + T index_topk x 4                    top-k indices (int32, kept for shared layers)
                  + [full layer in stage] T idx_heads (idx_dim x 2 + 4) + T context x 4
                                                        indexer q + head weights, fp32 logits over the
                                                        whole context (the term that grows with context)
        mlp       = dense: T 3 ceil(inter / tp) x 2     gate, up, activation
                    MoE:   ceil(T k / tp) (hidden + 3 moe_inter) x 2 + T n_routed x 4
                           + T 3 ceil(shared_inter / tp) x 2
                                                        routed pairs on this rank (balanced routing),
                                                        router logits fp32, shared expert
        logits    = [last stage] T vocab (2 + 4)            the chunk's whole logits (as `score` returns): the
                                                        vocab-parallel lm_head's all-gather leaves them on
                                                        every rank, bf16, then their fp32 copy
        headroom  = hidden + max(attention, mlp) + logits
    """
    t = min(chunk, context)
    a = ACT_BYTES
    start, stop = layers
    h = -(-cfg.num_attention_heads // tp)
    hidden = 3 * t * cfg.hidden_size * a
    attention = t * (cfg.q_lora_rank + cfg.kv_cache_dim) * a
    attention += t * h * (cfg.qk_head_dim + cfg.kv_cache_dim + cfg.kv_lora_rank + cfg.v_head_dim) * a
    attention += t * cfg.index_topk * 4
    if n_full_indexer_layers(cfg, start, stop):
        attention += t * cfg.index_n_heads * (cfg.index_head_dim * a + 4) + t * context * 4
    mlp = 0
    for i in range(start, stop):
        if cfg.is_moe(i):
            pairs = -(-t * cfg.num_experts_per_tok // tp)
            fs = -(-cfg.moe_intermediate_size * cfg.n_shared_experts // tp)
            m = pairs * (cfg.hidden_size + 3 * cfg.moe_intermediate_size) * a
            m += t * cfg.n_routed_experts * 4 + t * 3 * fs * a
        else:
            m = t * 3 * -(-cfg.intermediate_size // tp) * a
        mlp = max(mlp, m)
    logits = t * cfg.vocab_size * (a + 4) if has_head else 0
    return hidden + max(attention, mlp) + logits


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage. Bytes are per GPU (one TP rank) unless they say host; KV/indexer bytes are
    per request at the planned context."""

    stage: int
    layers: tuple[int, int]  # [start, stop)
    full_indexer_layers: int
    node: int
    cost_s: float  # decode-step time proxy (`CostModel`), embedding / head included
    weight_bytes: int  # this rank's weights as the engine loads them (`loaded_weight_bytes`)
    kv_bytes_device: int  # MLA KV on the GPU (all of it, or the HiSparse cap)
    kv_bytes_host: int  # MLA KV in the node's host pool: whole cache, once per node whatever tp
    indexer_bytes: int  # indexer keys, always whole on the GPU
    headroom_bytes: int  # `activation_headroom`
    requests_fit_device: int  # floor((gpu_mem - weights - headroom) / (kv_device + indexer))
    requests_fit_host: int | None  # floor(host_mem / host KV of every stage on this node); None: no limit

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def requests_fit(self) -> int:
        if self.requests_fit_host is None:
            return self.requests_fit_device
        return min(self.requests_fit_device, self.requests_fit_host)


def partition(
    cfg: ModelConfig,
    pp: int,
    context: int,
    layer_split: Sequence[int] | None = None,
    *,
    tp: int = 1,
    weight_dtype: str | None = None,
    kv_dtype: str = "fp8_e4m3",
    gpu_mem: int = DEFAULT_GPU_MEM,
    host_mem: int | None = None,
    hisparse_device_tokens: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    decode_batch: int = 1,
    gpus_per_node: int = 8,
) -> list[StagePlan]:
    """Split `cfg`'s layers into `pp` stages of `tp` GPUs each and budget every stage's memory.

    `layer_split` overrides the balanced split (see `split_from_boundaries`). `weight_dtype` defaults
    to fp8 for a block-quantised checkpoint, else bf16. `host_mem` is per node; stage s sits on node
    (s * tp) // gpus_per_node.
    """
    n = cfg.num_hidden_layers
    for name, v in (
        ("pp", pp),
        ("tp", tp),
        ("context", context),
        ("chunk", chunk),
        ("gpus_per_node", gpus_per_node),
        ("gpu_mem", gpu_mem),
    ):
        if v < 1:
            raise ConfigError(f"{name} must be at least 1, got {v}")
    if decode_batch < 1:
        raise ConfigError(f"decode batch must be at least 1, got {decode_batch}")
    if cfg.num_attention_heads % tp:
        raise ConfigError(f"tp={tp} must divide num_attention_heads={cfg.num_attention_heads}")
    if tp > gpus_per_node or gpus_per_node % tp:
        raise ConfigError(f"tp={tp} must divide gpus per node ({gpus_per_node}): a TP group sits on one node")
    if context > cfg.max_position_embeddings:
        raise ConfigError(f"context {context} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    if hisparse_device_tokens is not None and hisparse_device_tokens < 1:
        raise ConfigError(f"hisparse device tokens must be at least 1, got {hisparse_device_tokens}")
    if weight_dtype is None:
        weight_dtype = "fp8" if cfg.quant_block else "bf16"
    kv_kinds(cfg, kv_dtype)  # validates the dtype
    weights_nbytes([], cfg, weight_dtype)  # validates the dtype

    cm = CostModel.for_weights(weight_dtype, decode_batch)
    costs = layer_costs(cfg, context, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype, model=cm)
    first = embed_cost(cfg, model=cm)
    last = head_cost(cfg, tp=tp, weight_dtype=weight_dtype, model=cm)
    if layer_split is None:
        bounds = balanced_split(costs, pp, first, last)
    else:
        bounds = split_from_boundaries(layer_split, pp, n)
    scost = stage_costs(costs, bounds, first, last)

    tokens = -(-context // PAGE_TOKENS) * PAGE_TOKENS
    dev_tokens = tokens if hisparse_device_tokens is None else min(hisparse_device_tokens, tokens)
    rows: list[StagePlan] = []
    for s, (a, b) in enumerate(bounds):
        nfull = n_full_indexer_layers(cfg, a, b)
        kv_tok, index_tok = kv_bytes_of_layers(cfg, a, b, kv_dtype)  # (a token's, over the stage's layers)
        rows.append(
            StagePlan(
                stage=s,
                layers=(a, b),
                full_indexer_layers=nfull,
                node=s * tp // gpus_per_node,
                cost_s=scost[s],
                # the engine's room check's figure: embedding on stage 0, norm + lm_head on the last
                weight_bytes=loaded_weight_bytes(cfg, range(a, b), PLAN_ITEMSIZE, weight_dtype == "fp8", tp),
                kv_bytes_device=dev_tokens * kv_tok,
                kv_bytes_host=tokens * kv_tok,
                indexer_bytes=tokens * index_tok,
                headroom_bytes=activation_headroom(cfg, (a, b), context, chunk, tp, has_head=s == pp - 1),
                requests_fit_device=0,
                requests_fit_host=None,
            )
        )
    host_per_node: dict[int, int] = {}
    for r in rows:
        host_per_node[r.node] = host_per_node.get(r.node, 0) + r.kv_bytes_host
    plans = []
    for r in rows:
        free = gpu_mem - r.weight_bytes - r.headroom_bytes
        fit_dev = max(0, free // (r.kv_bytes_device + r.indexer_bytes))
        fit_host = None if host_mem is None else host_mem // host_per_node[r.node]
        plans.append(replace(r, requests_fit_device=fit_dev, requests_fit_host=fit_host))
    return plans
