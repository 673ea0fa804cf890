"""Decode step of one GLM-5.3-shaped MoE layer at 1M context vs its roofline (H200).

Builds layer 1 of configs/glm-5.3-layers.json (MoE, full indexer; GLM-5.3's exact shapes) with random
FP8 block-quantised weights straight on the GPU (through the normal weight loader), fills a 1M-token
fp8 KV pool (656-byte MLA rows + 132-byte index keys), and times one decode token (batch 1, and
batch 8 at a shorter context) eagerly and as a captured CUDA graph. The roofline is the bytes one
step must read at the HBM copy rate measured in the same run: every weight the token touches (all
attention and indexer projections, the router, the 8 routed + shared experts it picks) plus the
index keys of the whole context and the 2048 selected KV rows.

    python -m bench.layer [--ctx 1048576] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, fmt_bytes, gpu_tag, measure_ceilings, time_cuda, write_results  # noqa: E402

PAGE = 64


def synthetic_weights(cfg, layers: range, device: str, gen: torch.Generator):
    """(name, tensor) pairs like `iter_weights(keep_fp8=True)`, made on the GPU."""
    from longctx.checkpoint.layout import expected_weights, is_fp8_weight, scale_shape

    block = tuple(cfg.quant_block or (128, 128))
    for name, shape in expected_weights(cfg, layers, embed=False, head=False).items():
        if name.endswith("e_score_correction_bias"):
            yield name, 0.05 * torch.randn(shape, device=device, generator=gen)
        elif name.endswith(("layernorm.weight", "k_norm.weight")):
            yield name, 1 + 0.1 * torch.randn(shape, device=device, generator=gen)
        elif name.endswith("k_norm.bias"):
            yield name, 0.1 * torch.randn(shape, device=device, generator=gen)
        elif is_fp8_weight(name) and cfg.quant_block is not None:
            w = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            yield name, w
            yield name + "_scale_inv", torch.full(scale_shape(shape, block), 0.02 / 2.0, device=device)
        else:
            yield name, 0.02 * torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)


def touched_bytes(layer, cfg, ctx_len: int, batch: int, experts_hit: int) -> dict[str, float]:
    """Bytes one decode step of this layer must read."""

    def nb(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    attn = layer.self_attn
    w = 0
    for mod in attn.modules():
        if hasattr(mod, "weight_scale_inv"):
            w += nb(mod.weight) + nb(mod.weight_scale_inv)
    for p in attn.modules():
        if isinstance(p, torch.nn.LayerNorm):
            w += nb(p.weight) + nb(p.bias)
    moe = layer.mlp
    w += nb(moe.gate.weight) + nb(moe.gate.e_score_correction_bias)
    e = cfg.n_routed_experts
    per_expert = (nb(moe.experts.gate_up_proj) + nb(moe.experts.down_proj)) / e
    per_expert += (nb(moe.experts.gate_up_scale) + nb(moe.experts.down_scale)) / e
    w += experts_hit * per_expert
    for mod in moe.shared_experts.modules():
        if hasattr(mod, "weight_scale_inv"):
            w += nb(mod.weight) + nb(mod.weight_scale_inv)
    idx_row = cfg.index_head_dim + 4
    kv_row = cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // 128) + 2 * cfg.qk_rope_head_dim
    kv = batch * (ctx_len * idx_row + min(cfg.index_topk, ctx_len) * kv_row)
    return {"weights": float(w), "kv": float(kv), "total": float(w + kv)}


def build(cfg, ctx_len: int, batch: int, device: str):
    from longctx.kvstore.pool import PagedKVPool
    from longctx.model.model import CausalLM

    layers = range(1, 2)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(cfg, layers, embed=False, head=False)
    model.load_weights(synthetic_weights(cfg, layers, device, gen), device, torch.bfloat16)
    model.finalize(torch.bfloat16)
    model.set_backend(True)
    pages_per_req = -(-ctx_len // PAGE)
    kv = PagedKVPool(cfg, layers, pages_per_req * batch, "fp8", torch.bfloat16, torch.device(device), PAGE)
    # fill every request's context with random KV through the write kernels
    from longctx.kernels.kv_layout import write_index_k, write_mla_kv

    step = 1 << 18
    for b in range(batch):
        for s in range(0, ctx_len, step):
            n = min(step, ctx_len - s)
            slots = torch.arange(
                b * pages_per_req * PAGE + s, b * pages_per_req * PAGE + s + n, device=device
            )
            lat = torch.randn(n, cfg.kv_lora_rank, device=device, dtype=torch.bfloat16, generator=gen)
            rope = torch.randn(n, cfg.qk_rope_head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            write_mla_kv(kv.mla_pool(1), slots, lat, rope, "fp8", backend="triton")
            k = torch.randn(n, cfg.index_head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            write_index_k(kv.index_pool(1), slots, k, "fp8", backend="triton")
    return model, kv, pages_per_req


def decode_context(cfg, kv, batch: int, ctx_len: int, pages_per_req: int, device: str):
    """The batch's decode context, with the engine's decode graphs' side stream (`model/overlap.py`: the
    indexer and the MLA row's write beside the query's path, the shared experts beside the routed ones;
    used while the graph is captured; LONGCTX_SIDE_STREAM=0 leaves it out)."""
    from longctx.model.context import ForwardContext
    from longctx.model.overlap import side_stream

    table = torch.arange(batch * pages_per_req, dtype=torch.int32, device=device).view(batch, pages_per_req)
    pos = torch.full((batch,), ctx_len - 1, dtype=torch.int64, device=device)
    slots = table[:, -1].long() * PAGE + (ctx_len - 1) % PAGE
    return ForwardContext(
        positions=pos,
        q_seq=torch.arange(batch, dtype=torch.int32, device=device),
        q_start=list(range(batch + 1)),
        seq_lens=torch.full((batch,), ctx_len, dtype=torch.int32, device=device),
        seq_lens_cpu=[ctx_len] * batch,
        page_table=table,
        slot_mapping=slots,
        kv=kv,
        use_triton=True,
        prefill_form="absorbed",
        side=side_stream(torch.device(device)),
    )


def run_case(cfg, ctx_len: int, batch: int, ceilings: dict, device: str = "cuda") -> dict:
    model, kv, ppr = build(cfg, ctx_len, batch, device)
    layer = model.model.layers["1"]
    ctx = decode_context(cfg, kv, batch, ctx_len, ppr, device)
    x = torch.randn(batch, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    ctx.cos_sin = model.rotary(ctx.positions, torch.bfloat16)

    def step() -> torch.Tensor:
        return layer(x, ctx)

    with torch.inference_mode():
        y = step()
        ids, _ = layer.mlp.gate(layer.post_attention_layernorm(x))
        hit = int(torch.unique(ids).numel())
        t_eager = time_cuda(step)
        graph_s, graph_err = None, None
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y_g = step()
            g.replay()
            torch.cuda.synchronize()
            same = torch.allclose(y_g.float(), y.float(), rtol=1e-2, atol=1e-2)
            graph_s = time_cuda(g.replay)
            if not same:
                graph_err = "graph output differs from eager"
        except Exception as e:  # noqa: BLE001
            graph_err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    b = touched_bytes(layer, cfg, ctx_len, batch, hit)
    roof = b["total"] / ceilings["hbm_copy_Bps"]
    best = min(t for t in (t_eager, graph_s) if t is not None)
    res = {
        "ctx": ctx_len,
        "batch": batch,
        "experts_hit": hit,
        "bytes": b,
        "roofline_s": roof,
        "eager_s": t_eager,
        "graph_s": graph_s,
        "graph_error": graph_err,
        "time_s": best,
        "roofline_ratio": best / roof,
        "finite": bool(torch.isfinite(y).all()),
    }
    del model, kv
    torch.cuda.empty_cache()
    return res


def load_cfg():
    from longctx.config import ModelConfig

    return ModelConfig.from_json(Path(__file__).resolve().parents[1] / "configs" / "glm-5.3-layers.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=1 << 20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write results here (e.g. $OUT)")
    ap.add_argument("--ceilings", type=str, default=None, help="JSON of measured ceilings to reuse")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/layer.py needs CUDA; nothing to do on this machine")
        return 0
    import json

    cfg = load_cfg()

    ceilings = json.loads(args.ceilings) if args.ceilings else measure_ceilings()
    cases = [(args.ctx, 1)] if args.quick else [(args.ctx, 1), (131072, 8)]
    results = [run_case(cfg, c, b, ceilings) for c, b in cases]
    rows = [
        "| ctx | batch | experts hit | bytes/step | roofline | eager | graph | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g = f"{r['graph_s'] * 1e6:.0f} us" if r["graph_s"] else f"n/a ({r['graph_error']})"
        rows.append(
            f"| {r['ctx']} | {r['batch']} | {r['experts_hit']} | {fmt_bytes(r['bytes']['total'])} | "
            f"{r['roofline_s'] * 1e6:.0f} us | {r['eager_s'] * 1e6:.0f} us | {g} | {r['roofline_ratio']:.2f} |"
        )
    table = "\n".join(rows)
    print(table)
    data = {
        "env": environment(),
        "ceilings": ceilings,
        "cases": results,
        "layer_decode_1m": {
            "time_s": results[0]["time_s"],
            "roofline_s": results[0]["roofline_s"],
            "roofline_ratio": results[0]["roofline_ratio"],
            "hbm_copy_Bps": ceilings["hbm_copy_Bps"],
        },
    }
    write_results(f"layer-{gpu_tag()}", data, table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
