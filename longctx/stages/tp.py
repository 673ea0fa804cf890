"""Tensor parallelism inside a pipeline stage, applied to a finished single-device `CausalLM`.

As in gpt-fast's `tp.py`, the model code knows nothing about ranks: this module (1) shrinks the
meta-built modules to one rank's shard, (2) slices the checkpoint tensors as they stream in, so a
rank never holds a whole layer (nor the whole embedding or lm_head), and (3) adds forward hooks that
all-reduce partial outputs and all-gather the logits (`longctx.stages.collectives`).

What each of `tp` ranks holds (heads h = H / tp, rank r):
- attention: q_b_proj rows and kv_b_proj rows of heads [r h, (r+1) h), o_proj columns of the same
  heads; `n_heads = h` (the absorbed W_UK / W_UV come from the sharded kv_b_proj in `finalize`).
  o_proj's output is a partial sum over heads -> all-reduce (hook on o_proj).
- embedding and lm_head, vocab-parallel: the rows of vocabulary [v0, v1) = `shard_range(vocab, r,
  tp)` (shards differ by one row when tp does not divide the vocabulary; a tied lm_head is the
  embedding's shard itself where the stage holds both, else the loader's copy cut to the same rows).
  The embedding looks up its own ids and gives zero rows for the others, then all-reduces (exactly
  one rank adds a non-zero row: the sum is the replicated lookup bit for bit). lm_head computes the
  logits of its rows; a hook all-gathers them (padded to the widest shard) into the whole [n, vocab]
  on every rank, each column exactly as its rank computed it (a BLAS may round a column of a narrower
  product otherwise than the whole matrix's: ~1 ulp of fp32 seen on the CPU). Every rank of the last
  stage therefore runs the same lm_head calls (`StageWorker.finish_async(sample=False)` on all but
  rank 0, which samples and reports).
- replicated: q_a / kv_a projections and their norms, the indexer (every rank needs the same top-k),
  the router, the layer norms and the final norm.
- dense MLP and shared experts: gate/up rows and down columns of intermediate [r I/tp, (r+1) I/tp).
- routed experts: experts [r E/tp, (r+1) E/tp) stacked as local ids 0..; a pre-hook maps the
  router's global ids to local ones (others -1, which the expert kernels skip).
  The MLP/MoE output (routed + shared partials) is a partial sum -> one all-reduce (hook on mlp).

FP8 block-quantised weights are sliced with their scales when the slice falls on 128-blocks;
otherwise that tensor's shard is dequantised to the model dtype (e.g. kv_b_proj with an odd number
of 448-row heads per rank).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from longctx.checkpoint.fp8 import DEFAULT_BLOCK, FP8_DTYPE, dequantize_fp8_block
from longctx.config import ModelConfig, check_layout
from longctx.errors import ConfigError
from longctx.model.layer import DecoderLayer
from longctx.model.linear import Linear
from longctx.model.model import CausalLM
from longctx.model.moe import MLP, MoE
from longctx.stages.collectives import Gather, Reduce

__all__ = ["Gather", "Reduce", "TPShard", "shard_range"]

_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # (tied: lm_head alone on a stage)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def shard_range(n: int, rank: int, tp: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items (sizes differ by at most one)."""
    return n * rank // tp, n * (rank + 1) // tp


class TPShard:
    """One rank's shard of a stage: which rows/columns/experts it keeps."""

    def __init__(self, cfg: ModelConfig, rank: int, tp: int) -> None:
        check_layout(cfg, 1, tp)  # heads, experts and ranks divide as the shards assume
        if not 0 <= rank < tp:
            raise ConfigError(f"tp rank {rank} outside [0, {tp})")
        self.cfg, self.rank, self.tp = cfg, rank, tp
        self.heads = cfg.num_attention_heads // tp
        self.experts = shard_range(cfg.n_routed_experts, rank, tp)
        self.vocab = shard_range(cfg.vocab_size, rank, tp)  # embedding / lm_head rows [v0, v1)
        self.block: tuple[int, int] = tuple(cfg.quant_block or DEFAULT_BLOCK)  # type: ignore[assignment]

    # ---- which slice of a checkpoint tensor -------------------------------------------------
    def _slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of `name`'s shard, or None if replicated."""
        if name in _VOCAB_ROWS:
            return 0, *self.vocab
        m = _LAYER.match(name)
        if m is None or not name.endswith(".weight"):
            return None
        c, h0 = self.cfg, self.rank * self.heads
        rest = m.group(2)[: -len(".weight")]
        if rest == "self_attn.q_b_proj":
            w = c.qk_head_dim
            return 0, h0 * w, (h0 + self.heads) * w
        if rest == "self_attn.kv_b_proj":
            w = c.qk_nope_head_dim + c.v_head_dim
            return 0, h0 * w, (h0 + self.heads) * w
        if rest == "self_attn.o_proj":
            w = c.v_head_dim
            return 1, h0 * w, (h0 + self.heads) * w
        if rest in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            a, b = shard_range(c.intermediate_size, self.rank, self.tp)
            return (1 if rest == "mlp.down_proj" else 0), a, b
        if rest in (
            "mlp.shared_experts.gate_proj",
            "mlp.shared_experts.up_proj",
            "mlp.shared_experts.down_proj",
        ):
            a, b = shard_range(c.moe_intermediate_size * c.n_shared_experts, self.rank, self.tp)
            return (1 if rest.endswith("down_proj") else 0), a, b
        return None

    def _aligned(self, dim: int, start: int, stop: int, full: int) -> bool:
        blk = self.block[dim]
        return start % blk == 0 and (stop % blk == 0 or stop == full)

    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Filter `iter_weights`: keep this rank's experts (renumbered), slice sharded tensors.

        `iter_weights(keep_fp8=True)` yields an fp8 weight immediately followed by its
        `_scale_inv`; such pairs are sliced together (or dequantised when not block-aligned).
        """
        held: tuple[str, torch.Tensor, tuple[int, int, int]] | None = None
        for name, t in weights:
            if held is not None:
                wname, w, (dim, a, b) = held
                held = None
                if name != wname + "_scale_inv":
                    raise ConfigError(f"fp8 weight {wname} is not followed by its scale")
                if self._aligned(dim, a, b, w.shape[dim]):
                    blk = self.block[dim]
                    yield wname, w.narrow(dim, a, b - a).contiguous()
                    sa, sb = a // blk, -(-b // blk)
                    yield name, t.narrow(dim, sa, sb - sa).contiguous()
                else:
                    dense = dequantize_fp8_block(w, t, self.block, torch.float32)
                    yield wname, dense.narrow(dim, a, b - a).contiguous()
                continue
            m = _EXPERT.match(name)
            if m is not None:
                e = int(m.group(2))
                e0, e1 = self.experts
                if e0 <= e < e1:
                    yield f"{m.group(1)}.{e - e0}.{m.group(3)}", t
                continue
            sl = self._slice_of(name)
            if sl is None:
                yield name, t
            elif t.dtype == FP8_DTYPE:
                held = (name, t, sl)
            else:
                dim, a, b = sl
                yield name, t.narrow(dim, a, b - a).contiguous()
        if held is not None:
            raise ConfigError(f"fp8 weight {held[0]} has no scale")

    # ---- the meta model ----------------------------------------------------------------------
    def shard_model(self, model: CausalLM, reduce: Reduce | None, gather: Gather | None) -> CausalLM:
        """Shrink a meta-built model's modules to this rank's shapes and add the collective hooks.

        Call before loading weights; `reduce` and `gather` are None only for tp == 1 (nothing to do).
        """
        if self.tp == 1:
            return model
        assert reduce is not None and gather is not None
        v0, v1 = self.vocab
        emb = model.model.embed_tokens
        if emb is not None:
            if not emb.weight.is_meta:
                raise ConfigError("embedding: shard_model needs the meta-built model, before loading")
            emb.num_embeddings = v1 - v0
            emb.weight = _meta_param((v1 - v0, emb.embedding_dim), emb.weight.dtype)
            pre, post = _vocab_embedding_hooks(v0, v1, reduce)
            emb.register_forward_pre_hook(pre)
            emb.register_forward_hook(post)
        if model.lm_head is not None:
            if not model.lm_head.weight.is_meta:
                raise ConfigError("lm_head: shard_model needs the meta-built model, before loading")
            _resize(model.lm_head, out=v1 - v0)
            sizes = [b - a for a, b in (shard_range(self.cfg.vocab_size, r, self.tp) for r in range(self.tp))]
            model.lm_head.register_forward_hook(_vocab_gather_hook(sizes, gather))
        model.tie_weights()  # (a tied lm_head: the embedding's shard again, not a second one)
        for i, layer in model.model.layers.items():
            if not any(p.is_meta for p in layer.parameters()):
                raise ConfigError(f"layer {i}: shard_model needs the meta-built model, before loading")
            assert isinstance(layer, DecoderLayer)
            attn = layer.self_attn
            h = self.heads
            _resize(attn.q_b_proj, out=h * self.cfg.qk_head_dim)
            _resize(attn.kv_b_proj, out=h * (attn.nope + attn.v_dim))
            _resize(attn.o_proj, inp=h * attn.v_dim)
            attn.n_heads = h
            attn.o_proj.register_forward_hook(_reduce_hook(reduce))
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                e0, e1 = self.experts
                ex = mlp.experts
                for attr in ("gate_up_proj", "down_proj"):
                    p = getattr(ex, attr)
                    setattr(ex, attr, _meta_param((e1 - e0, *p.shape[1:]), p.dtype))
                ex.register_forward_pre_hook(_local_experts_hook(e0, e1))
                if mlp.shared_experts is not None:
                    _shard_mlp(mlp.shared_experts, self.rank, self.tp)
                mlp.partial_output = True
            else:
                assert isinstance(mlp, MLP)
                _shard_mlp(mlp, self.rank, self.tp)
            mlp.register_forward_hook(_reduce_hook(reduce))
        return model


def _meta_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def _resize(lin: Linear, out: int | None = None, inp: int | None = None) -> None:
    lin.out_features = out if out is not None else lin.out_features
    lin.in_features = inp if inp is not None else lin.in_features
    lin.weight = _meta_param((lin.out_features, lin.in_features), lin.weight.dtype)


def _shard_mlp(mlp: MLP, rank: int, tp: int) -> None:
    a, b = shard_range(mlp.gate_proj.out_features, rank, tp)
    _resize(mlp.gate_proj, out=b - a)
    _resize(mlp.up_proj, out=b - a)
    _resize(mlp.down_proj, inp=b - a)


def _reduce_hook(reduce: Reduce) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        reduce(out)
        return out

    return hook


def _vocab_embedding_hooks(
    v0: int, v1: int, reduce: Reduce
) -> tuple[Callable[..., tuple], Callable[..., torch.Tensor]]:
    """nn.Embedding over vocabulary rows [v0, v1): the pre-hook makes the ids local (those of other
    ranks look up row 0), the hook zeroes those rows and sums the ranks' partial embeddings."""
    outside: list[torch.Tensor] = []  # the pre-hook's mask [T], for the hook of the same call

    def pre(module: nn.Module, args: tuple) -> tuple:
        (ids,) = args
        out = (ids < v0) | (ids >= v1)
        outside[:] = [out]
        return ((ids - v0).masked_fill_(out, 0),)

    def post(module: nn.Module, args: tuple, h: torch.Tensor) -> torch.Tensor:
        h.masked_fill_(outside.pop().unsqueeze(-1), 0)
        reduce(h)
        return h

    return pre, post


def _vocab_gather_hook(sizes: list[int], gather: Gather) -> Callable[..., torch.Tensor]:
    """lm_head over this rank's vocabulary rows -> the whole logits [..., vocab] from every rank's
    columns; a shard narrower than the widest is padded for the gather (all-gathers take one shape)."""
    width = max(sizes)

    def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        if out.shape[-1] < width:
            out = F.pad(out, (0, width - out.shape[-1]))
        parts = gather(out)  # [tp, ..., width]
        return torch.cat([parts[r, ..., :n] for r, n in enumerate(sizes)], dim=-1)

    return hook


def _local_experts_hook(e0: int, e1: int) -> Callable[..., tuple]:
    """Experts.forward(x, w, ids, use_triton): global expert ids -> local ids, -1 if not ours."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, w, ids, *rest = args
        local = torch.where((ids >= e0) & (ids < e1), ids - e0, torch.full_like(ids, -1))
        return (x, w, local, *rest)

    return hook
