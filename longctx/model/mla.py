"""Multi-head latent attention (MLA) with DSA sparse selection.

Per token the cache holds only the latent `c` (kv_lora_rank) and the rotated rope key `r`
(qk_rope_head_dim). Two equivalent ways to attend over the selected tokens:
- expanded (prefill): K_nope, V = kv_b_proj(c) per head, score = q_nope.K_nope + q_rope.r;
- absorbed (decode): fold W_UK into the query and W_UV into the output, so the score is
  (q_nope W_UK) . c + q_rope . r in the 512-d latent space and the output is (p @ c) W_UV.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx.config import ModelConfig
from longctx.model.context import ForwardContext
from longctx.model.indexer import Indexer
from longctx.model.linear import Linear, linear, stack_weights
from longctx.model.norm import RMSNorm
from longctx.model.ops import op

# Below this many (query x key) pairs per head a prefill row attends in the expanded form.
EXPANDED_MAX_PAIRS = 1 << 22


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(self.n_heads * self.v_dim, cfg.hidden_size)
        self.indexer = Indexer(cfg, layer) if cfg.is_full_indexer(layer) else None
        self.w_uk: torch.Tensor | None = None  # [H, L, nope] (nope the unit-stride dim, as a GEMV reads it)
        self.w_uv: torch.Tensor | None = None  # [H, v, L]
        self.x_proj: torch.Tensor | None = None  # [q_lora + L + R (+ D + H_idx), hidden], see finalize

    def finalize(self, dtype: torch.dtype) -> None:
        """Split kv_b_proj into the absorbed W_UK / W_UV once the weights are loaded, and stack the
        projections of the input x (`_stack_x_projections`)."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        self.w_uk = w[:, : self.nope].transpose(1, 2).contiguous()
        self.w_uv = w[:, self.nope :].contiguous()
        self._stack_x_projections(dtype)

    def x_projections(self) -> list[Linear]:
        """The projections of the layer's normed input x, in `x_proj`'s row order."""
        lins = [self.q_a_proj, self.kv_a_proj_with_mqa]
        if self.indexer is not None:
            lins += [self.indexer.wk, self.indexer.weights_proj]
        return lins

    def _stack_x_projections(self, dtype: torch.dtype) -> None:
        """q_a, kv_a (and on full layers the indexer's wk and weights_proj) all read x: on the Triton
        path they run as one GEMM over their stacked weights (in a decode step four GEMM launches
        become one, and the indexer's fp32 cast of x goes). weights_proj keeps its fp32 parameter for
        the reference path and enters the stack in the model dtype, so on that path its output is
        rounded to the model dtype (exact in fp32). FP8 weights are left as they are."""
        self.x_proj = stack_weights(self.x_projections(), dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (after input norm) -> [T, hidden]; sets ctx.prev_topk on full layers."""
        assert ctx.cos_sin is not None
        T = x.shape[0]
        cos, sin = ctx.cos_sin
        rope = op("rope", "apply_rope", ctx.use_triton)
        if ctx.use_triton and self.x_proj is not None:
            # one GEMM for every projection of x; the parts are column slices of its output
            xa = linear(x, self.x_proj, use_triton=True)
            n_q, n_kv = self.q_a_proj.out_features, self.kv_lora + self.rope
            q_a, ckv, x_idx = xa[:, :n_q], xa[:, n_q : n_q + n_kv], xa[:, n_q + n_kv :]
        else:
            q_a, ckv, x_idx = self.q_a_proj(x), self.kv_a_proj_with_mqa(x), None
        q_resid = self.q_a_layernorm(q_a)
        kv = ctx.kv
        # beside the query's path on the side stream (overlap.py), joined before the attention: a full
        # layer's indexer, and the new token's MLA row where nothing reads it before then (not under
        # HiSparse, whose after_write copies it at once)
        side = ctx.side if ctx.side is not None and ctx.side.active() else None
        write_aside = side is not None and kv.dense_readable
        pending: torch.Tensor | None = None
        if side is not None and (write_aside or self.indexer is not None):
            with side.fork():
                # the indexer first: its chain (wq_b .. the top-k) is the layer's critical path, and the
                # row's write is needed only at the join
                if self.indexer is not None:
                    pending = self.indexer(x, q_resid, ctx, x_idx)
                if write_aside:
                    self._write_kv(ckv, ctx)
        else:
            side = None
        q = self.q_b_proj(q_resid).view(T, self.n_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        # a decode step (every row absorbed) passes q_pe unrotated: the sparse MLA call rotates it (on
        # the Triton path in its kernel's prologue, one launch fewer a layer); prefill rotates it here
        absorb_all = not kv.dense_readable or all(
            ctx.q_start[b + 1] - ctx.q_start[b] == 1 for b in range(ctx.num_rows)
        )
        q_rope = None if absorb_all else rope(q_pe, cos, sin)
        if not write_aside:
            self._write_kv(ckv, ctx)
            kv.after_write(self.layer, ctx)

        q_lat = None
        if side is not None:
            q_lat = self._q_latent(q_nope, ctx)  # (still beside the side stream's work)
            side.join()
            if write_aside:
                kv.after_write(self.layer, ctx)
            if pending is not None:
                ctx.prev_topk = pending
        elif self.indexer is not None:
            ctx.prev_topk = self.indexer(x, q_resid, ctx, x_idx)
        topk = ctx.prev_topk
        if topk is None:
            raise RuntimeError(f"layer {self.layer} shares top-k but no earlier full indexer layer ran")

        out = x.new_empty(T, self.n_heads, self.v_dim)
        absorbed_rows = []
        for b in range(ctx.num_rows):
            s, e = ctx.q_start[b], ctx.q_start[b + 1]
            n_q, n_k = e - s, ctx.seq_lens_cpu[b]
            form = ctx.prefill_form if kv.dense_readable else "absorbed"
            if form == "auto":
                form = "expanded" if (n_q > 1 and n_q * n_k <= EXPANDED_MAX_PAIRS) else "absorbed"
            if form == "expanded" and n_q > 1:
                assert q_rope is not None  # (a row of several queries: not absorb_all)
                out[s:e] = self._expanded(q_nope[s:e], q_rope[s:e], topk[s:e], b, ctx)
            else:
                absorbed_rows.append((s, e))
        if absorbed_rows and len(absorbed_rows) == ctx.num_rows:  # all rows (decode): no gather/scatter
            rows = kv.resolve(self.layer, topk, ctx)
            if q_rope is None:  # (interleaved, as rope() above)
                out = self._absorbed(q_nope, q_pe, rows, ctx, q_lat, (cos, sin, True))
            else:
                out = self._absorbed(q_nope, q_rope, rows, ctx, q_lat)
        elif absorbed_rows:
            assert q_rope is not None
            idx = torch.cat([torch.arange(s, e, device=x.device) for s, e in absorbed_rows])
            rows = kv.resolve(self.layer, topk, ctx)[idx]
            out[idx] = self._absorbed(q_nope[idx], q_rope[idx], rows, ctx)
        return self.o_proj(out.reshape(T, self.n_heads * self.v_dim))

    def _write_kv(self, ckv: torch.Tensor, ctx: ForwardContext) -> None:
        """kv_a_layernorm of the new tokens' latent, rope of the rest, and the write of both into the
        layer's pool: one kernel."""
        assert ctx.cos_sin is not None
        norm = self.kv_a_layernorm
        op("kv_fused", "norm_rope_write_mla_kv", ctx.use_triton)(
            ctx.kv.mla_pool(self.layer), ctx.slot_mapping, ckv, norm.weight, norm.eps, *ctx.cos_sin,
            ctx.kv.mla_kind(self.layer),
        )  # fmt: skip

    def _q_latent(self, q_nope: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The absorbed query q_nope W_UK [t, H, L] (a decode step's rows: one per-head GEMV kernel)."""
        assert self.w_uk is not None
        return op("gemv", "head_gemv", ctx.use_triton)(q_nope, self.w_uk)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        rows: torch.Tensor,
        ctx: ForwardContext,
        q_lat: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
    ) -> torch.Tensor:
        """Attention in the latent space over `rows`; `q_lat` is `_q_latent(q_nope)` if already made; with
        `rope` (cos, sin, interleaved) q_rope is still unrotated and the sparse MLA call rotates it."""
        assert self.w_uv is not None
        if q_lat is None:
            q_lat = self._q_latent(q_nope, ctx)
        attend = op("sparse_mla", "sparse_mla", ctx.use_triton)
        pool, kind = ctx.kv.attend_pool(self.layer), ctx.kv.mla_kind(self.layer)
        # [t, H, L] attention output times W_UV -> [t, H, v] (at batch 1 the kernel's K splits merge
        # inside that GEMV)
        return attend(q_lat, q_rope, pool, rows, self.scale, kind, rotate=rope, out_proj=self.w_uv)

    def _expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, topk: torch.Tensor, b: int, ctx: ForwardContext
    ) -> torch.Tensor:
        """Dense-masked attention of one prefill row over all its keys (the reference's form)."""
        n_k = ctx.seq_lens_cpu[b]
        pos = torch.arange(n_k, device=q_nope.device)
        slots = ctx.page_table[b].long()[pos // ctx.page_size] * ctx.page_size + pos % ctx.page_size
        c, r = op("kv_layout", "read_mla_kv", False)(
            ctx.kv.mla_pool(self.layer), slots, ctx.kv.mla_kind(self.layer), q_nope.dtype, self.kv_lora
        )
        kvb = self.kv_b_proj(c).view(n_k, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kvb[..., : self.nope], kvb[..., self.nope :]
        scores = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_rope, r)
        scores = scores * self.scale
        n_q = q_nope.shape[0]
        allowed = torch.zeros(n_q, n_k + 1, dtype=torch.bool, device=q_nope.device)
        allowed.scatter_(1, torch.where(topk >= 0, topk.long(), n_k), True)  # -1 pads land in column n_k
        q_pos = ctx.positions[ctx.q_start[b] : ctx.q_start[b + 1]]
        allowed = allowed[:, :n_k] & (pos[None, :] <= q_pos[:, None])
        scores = scores.masked_fill(~allowed[None], torch.finfo(scores.dtype).min)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        return torch.einsum("hts,shv->thv", p, v)
