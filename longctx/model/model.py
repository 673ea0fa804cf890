"""The decoder stack over a layer range [a, b): embedding (first stage), layers, norm + lm_head (last).

Module names match the checkpoint's (`model.layers.3.self_attn.kv_b_proj.weight`), so loading is a
name lookup; only the per-expert tensors are stacked into the experts' 3-D parameters. No
distributed code lives here: pipeline stages construct a range, tensor parallelism shards weights
from the outside (`longctx/stages/tp.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from longctx.config import ModelConfig
from longctx.errors import CheckpointError
from longctx.model.context import ForwardContext
from longctx.model.layer import DecoderLayer
from longctx.model.linear import Linear
from longctx.model.moe import MLP, MoE, Router
from longctx.model.norm import RMSNorm
from longctx.model.params import KEPT_FP32
from longctx.model.rope import RotaryEmbedding

_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$"
)


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: range, embed: bool, head: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None


class CausalLM(nn.Module):
    """Layers [a, b) of a GLM-MoE-DSA / DeepSeek-V3.2 model.

    `forward(x, ctx)`: x is token ids [T] on the first stage, else hidden states [T, hidden];
    returns hidden states [T, hidden], or on the last stage the final-normed hidden states (call
    `logits()` on the rows that need them, so a long prefill never materialises [T, vocab]).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range | None = None,
        embed: bool | None = None,
        head: bool | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_range = layers if layers is not None else range(cfg.num_hidden_layers)
        self.has_embed = self.layer_range.start == 0 if embed is None else embed
        self.has_head = self.layer_range.stop == cfg.num_hidden_layers if head is None else head
        self.model = _Body(cfg, self.layer_range, self.has_embed, self.has_head)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size) if self.has_head else None
        self.rotary = RotaryEmbedding(cfg)
        self.full_layers = [i for i in self.layer_range if cfg.is_full_indexer(i)]
        self.tie_weights()

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.has_embed:
            assert self.model.embed_tokens is not None
            h = self.model.embed_tokens(x)
        else:
            h = x
        ctx.cos_sin = self.rotary(ctx.positions, h.dtype)
        ctx.key_lens = None  # made afresh by each forward, as cos_sin (a reused context keeps neither)
        layers = [cast(DecoderLayer, m) for m in self.model.layers.values()]
        normed: torch.Tensor | None = None  # the next layer's input norm, when the layer made it
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, normed = layer.step(h, ctx, normed, nxt)
        if self.has_head:
            assert self.model.norm is not None
            h = normed if normed is not None else self.model.norm(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [n, hidden] -> fp32 logits [n, vocab]."""
        assert self.lm_head is not None
        return self.lm_head(h).float()

    def set_backend(self, use_triton: bool) -> None:
        for m in self.modules():
            if isinstance(m, Linear | MoE | RMSNorm | MLP | RotaryEmbedding):
                m.use_triton = use_triton

    # ---- weights -----------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """With `tie_word_embeddings`, a model holding both the embedding and lm_head gives lm_head the
        embedding's parameter itself (one matrix in memory, one set of gradients in training, and the
        checkpoint's names: `named_parameters` lists it once, as the embedding). A stage with lm_head
        alone loads its own copy (`iter_weights` yields it under lm_head's name). Called again wherever
        either parameter is replaced: loading, and tensor parallelism's resize to a vocabulary shard."""
        if self.cfg.tie_word_embeddings and self.model.embed_tokens is not None and self.lm_head is not None:
            w = self.model.embed_tokens.weight
            assert isinstance(w, nn.Parameter)
            self.lm_head.weight = w

    @staticmethod
    def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
        """The reference keeps the router and the indexer's head weights in fp32."""
        return torch.float32 if name.endswith(KEPT_FP32) else dtype

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype
    ) -> None:
        """Materialise the (meta-built) parameters from checkpoint tensors with HF names.

        FP8 tensors stay FP8 (their `_scale_inv` attaches to the owning Linear / experts); all
        others are cast to `dtype` (fp32 for the router and indexer head weights).
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        scales: dict[str, torch.Tensor] = {}
        fp8: dict[str, torch.Tensor] = {}
        for name, t in weights:
            m = _EXPERT.match(name)
            if m:
                self._load_expert(m, t, device, dtype)
                continue
            if name.endswith("_scale_inv"):
                scales[name[: -len("_scale_inv")]] = t.to(device)
                continue
            if name not in params:
                raise CheckpointError(f"unexpected tensor {name} for layers {self.layer_range}")
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{name}: expected shape {tuple(p.shape)}, found {tuple(t.shape)}")
            if t.dtype == torch.float8_e4m3fn:
                fp8[name] = t.to(device)
            else:
                self._set_param(name, t.to(device=device, dtype=self.param_dtype(name, dtype)))
            seen.add(name)
        for name, w in fp8.items():
            if name not in scales:
                raise CheckpointError(f"checkpoint is missing {name}_scale_inv for an fp8 weight")
            mod = self.get_submodule(name.rsplit(".", 1)[0])
            assert isinstance(mod, Linear)
            mod.set_fp8(w, scales.pop(name), self.block)
        self.tie_weights()
        missing = [n for n, p in self.named_parameters() if p.is_meta]
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint is missing {missing[0]}{more}")

    def _set_param(self, name: str, t: torch.Tensor) -> nn.Parameter:
        mod_name, attr = name.rsplit(".", 1)
        p = nn.Parameter(t, requires_grad=False)
        setattr(self.get_submodule(mod_name), attr, p)
        return p

    @property
    def block(self) -> tuple[int, int]:
        qb = self.cfg.quant_block or (128, 128)
        return (int(qb[0]), int(qb[1]))

    def _load_expert(
        self, m: re.Match, t: torch.Tensor, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        prefix, e, which, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        experts: Any = self.get_submodule(prefix)
        I = self.cfg.moe_intermediate_size
        target: Any = experts.down_proj if which == "down_proj" else experts.gate_up_proj
        rows = (
            slice(0, None)
            if which == "down_proj"
            else (slice(0, I) if which == "gate_proj" else slice(I, 2 * I))
        )
        if kind == "weight":
            if target.is_meta:
                attr = "down_proj" if which == "down_proj" else "gate_up_proj"
                st = t.dtype if t.dtype == torch.float8_e4m3fn else dtype
                target = self._set_param(
                    f"{prefix}.{attr}", torch.empty(target.shape, dtype=st, device=device)
                )
            expected = target[e, rows].shape
            if tuple(t.shape) != tuple(expected):
                raise CheckpointError(
                    f"{m.group(0)}: expected shape {tuple(expected)}, found {tuple(t.shape)}"
                )
            target.data[e, rows] = t.to(device=device, dtype=target.dtype)
            return
        # fp8 block scales, stacked like the weights (gate and up scales concatenated by rows)
        blk = self.block[0]
        if which != "down_proj" and I % blk:
            raise CheckpointError(f"{m.group(0)}: fp8 experts need moe_intermediate_size % {blk} == 0")
        attr = "down_scale" if which == "down_proj" else "gate_up_scale"
        sc = getattr(experts, attr)
        if sc is None:
            n_rows = -(-target.shape[1] // blk)
            sc = torch.empty(target.shape[0], n_rows, t.shape[1], dtype=torch.float32, device=device)
            setattr(experts, attr, sc)
        r0 = I // blk if which == "up_proj" else 0
        sc[e, r0 : r0 + t.shape[0]] = t.to(device)

    def finalize(self, dtype: torch.dtype) -> None:
        """Derived tensors (absorbed MLA weights) once all weights are in place."""
        for layer in self.model.layers.values():
            layer.self_attn.finalize(dtype)  # type: ignore[operator, union-attr]
        for m in self.modules():
            if isinstance(m, (MLP, Router)):
                m.finalize()
