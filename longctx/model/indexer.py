"""DSA lightning indexer: picks the top-k earlier tokens each query attends to.

score[q, t] = sum_h w[q, h] * relu(q_h . k_t) * index_head_dim^-0.5,  w = weights_proj(x) * H^-0.5
over every earlier token t <= pos(q) of the same request, then top-`index_topk`. Keys live in the
stage's paged index pool (fp8 132 bytes per token, page-major, or the model dtype); only "full" layers own an indexer,
"shared" layers reuse the previous full layer's selection (IndexShare).

`index_local_window` W > 0 (longctx's own; 0 in GLM-5 / DeepSeek-V3.2): a query at pos > topk - 1 keeps
positions pos - W + 1 .. pos and takes the top (topk - W) of the keys before them; a query with at most
topk keys keeps them all, as without it. At 1M tokens the retrieval model's top 256 held almost none of
the question it was answering (its first byte then came out as haystack prose; with the question's
positions forced in, the answer's space, bench/results/long-parity-h200.md): a million haystack keys
outrank the few dozen tokens every answer has to read.

`index_topk_long` K' > 0 (longctx's own too): a query at pos >= `index_topk_long_from` selects K' (its
window included) instead of index_topk, its row -1 padded to index_topk columns. Rows on both sides of
that position in one pass take both selections and keep theirs per row (a decode step always does when
its bound reaches the position: a CUDA graph's host lengths are its bucket's, not the rows'); where the
logits are materialised the narrow one is the wide one's top (`kernels.topk.narrow_selection`: a gather
and a top-k over index_topk entries), in a fused prefill chunk the fused top-k runs at both widths.

`LONGCTX_TOPK_LONG_DECODE=0` (an evaluation A/B, not a serving setting): decode passes keep the wide
selection past `index_topk_long_from`, so only prompt rows narrow. It goes by pass, not by row: a
generated token that shares a step with another request's prefill chunk narrows as before, so it means
what it says only for requests run one at a time (`bench.retrieval_eval run --concurrency 1`).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from longctx.config import ModelConfig
from longctx.kernels.topk import (  # (the window's bound and composition; their kernel form is topk's)
    local_window_bound,
    narrow_selection,
    pad_selection,
    with_local_window,
    with_narrow_rows,
)
from longctx.model.context import ForwardContext
from longctx.model.linear import Linear
from longctx.model.ops import op

NARROW_DECODE = os.environ.get("LONGCTX_TOPK_LONG_DECODE", "1").strip() != "0"


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.window = cfg.index_local_window
        self.topk_long, self.topk_long_from = cfg.index_topk_long, cfg.index_topk_long_from
        self.interleaved = cfg.model_type == "glm_moe_dsa"
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # kept in fp32 like the reference (`_keep_in_fp32_modules`)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext, x_proj: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, hidden] (after input norm), q_resid [T, q_lora] -> top-k positions [T, K] int32 (-1 pad).

        `x_proj` [T, D + H]: `wk(x)` and `weights_proj(x)` side by side when the caller computed them
        in its stacked GEMM (model dtype, see `MLAttention.x_proj`); else they are computed here,
        weights_proj in fp32 as the reference does."""
        assert ctx.cos_sin is not None
        cos, sin = ctx.cos_sin
        T = x.shape[0]
        rope = op("rope", "apply_rope", ctx.use_triton)
        q = rope(
            self.wq_b(q_resid).view(T, self.n_heads, self.head_dim), cos, sin, self.rope_dim, self.interleaved
        )
        if x_proj is not None:
            k_in, w = x_proj[:, : self.head_dim], x_proj[:, self.head_dim :]
        else:
            k_in, w = self.wk(x), self.weights_proj(x.to(torch.float32))
        kv = ctx.kv
        # k_norm, rope and the write of the key [T, D]: one kernel
        op("kv_fused", "ln_rope_write_index_k", ctx.use_triton)(
            kv.index_pool(self.layer), ctx.slot_mapping, k_in, self.k_norm.weight, self.k_norm.bias,
            self.k_norm.eps, cos, sin, self.rope_dim, self.interleaved, kv.index_kind(self.layer),
        )  # fmt: skip
        w_scale = self.n_heads**-0.5 * self.head_dim**-0.5
        logits: torch.Tensor | None = None
        if ctx.use_triton and not ctx.is_decode:
            # prefill chunk: fused logits + top-k, so the [T, context] logits are never materialised
            fused = op("indexer_topk", "indexer_topk_paged", ctx.use_triton)

            def select(topk: int) -> torch.Tensor:
                top = fused(
                    q,
                    w.float() * w_scale,
                    kv.index_pool(self.layer),
                    ctx.page_table,
                    ctx.seq_lens,
                    ctx.q_seq,
                    local_window_bound(ctx.positions, self.window),
                    kv.index_kind(self.layer),
                    topk - self.window,  # (the rest of the budget is the local window)
                    max_len=max(ctx.seq_lens_cpu),
                )
                return with_local_window(top, ctx.positions, topk, self.window)

        else:
            scores = op("indexer", "indexer_logits_paged", ctx.use_triton)(
                q,
                w,
                kv.index_pool(self.layer),
                ctx.page_table,
                ctx.seq_lens,
                ctx.q_seq,
                ctx.positions,
                kv.index_kind(self.layer),
                max(ctx.seq_lens_cpu),  # the host knows the bound: no device sync
                w_scale=w_scale,  # applied in the kernel: float(w) * w_scale, as `w.float() * w_scale`
            )  # [T, max_len] fp32, -inf where not causal
            logits = scores
            topk_op = op("topk", "topk_indices", ctx.use_triton)

            def select(topk: int) -> torch.Tensor:
                if self.window:  # the top (k - W) and the window in one: the kernels read the positions alone
                    return topk_op(scores, topk - self.window, None, self.window, ctx.positions)
                if ctx.key_lens is None:
                    ctx.key_lens = ctx.positions + 1
                return topk_op(scores, topk, ctx.key_lens)

        which = self._narrowing(ctx)
        if which == "base":
            return select(self.topk)
        if which == "long":
            return pad_selection(select(self.topk_long), self.topk)
        wide = select(self.topk)
        if logits is None:  # (a fused prefill chunk across the position: the selection at both widths)
            narrow = select(self.topk_long)
        else:  # the narrow rows' top from the wide selection's logits (every decode step past the position)
            narrow = narrow_selection(wide, logits, self.topk_long, self.window)
        return with_narrow_rows(wide, narrow, ctx.positions, self.topk_long_from)

    def _narrowing(self, ctx: ForwardContext) -> str:
        """Which selection this pass's rows take: "base" (all below `index_topk_long_from`, or no
        narrowing), "long" (all at or past it) or "both" (per row; a decode pass whenever its bound
        reaches it)."""
        if not self.topk_long or max(ctx.seq_lens_cpu) <= self.topk_long_from:
            return "base"  # (the last position any row can have is below it)
        if ctx.is_decode:
            return "both" if NARROW_DECODE else "base"
        # a prefill pass's rows are each request's newest tokens, and its host lengths are exact
        first = min(n - (ctx.q_start[b + 1] - ctx.q_start[b]) for b, n in enumerate(ctx.seq_lens_cpu))
        return "long" if first >= self.topk_long_from else "both"
