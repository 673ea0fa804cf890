"""The decode step's projections one by one: each Linear shape of a config at batch M, as bf16
(cuBLAS through F.linear) and as fp8 block-quantised weights (kernels.fp8_gemm), in microseconds
and as a fraction of the HBM read rate measured in the same run.

A batch-1 decode step reads every weight it touches once, so its GEMMs are a memory roofline:
bytes / read rate. This shows which shapes fall short of it (small ones pay a fixed launch and
ramp cost) and what fp8 weights would save. Every call is timed with an L2 flush between calls
(`time_fn`), as in a real step, where the 1.9 GB of weights a small-1m step reads do not fit the
50 MB L2. The per-step total weights each shape by how many times a step runs it.

    python -m bench.gemm_shapes [--config configs/small-1m.json] [--batch 1,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def linear_shapes(cfg) -> Counter[tuple[str, int, int, int]]:
    """(kind, batch B, out N, in K) -> how many a decode step runs, as the GPU path runs them: the
    absorbed MLA's W_UK / W_UV as B=heads batched products instead of kv_b_proj, an MLP's gate and
    up projections as one GEMM over their concatenated weights (experts excluded: the MoE kernels
    run those; the embedding is a row gather)."""
    import re

    from longctx.model.linear import Linear
    from longctx.model.model import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    out: Counter[tuple[str, int, int, int]] = Counter()
    for name, m in model.named_modules():
        if ".experts." in name:
            continue
        kind = re.sub(r"^(model\.)?layers\.\d+\.", "", name)
        if hasattr(m, "kv_b_proj") and hasattr(m, "nope"):
            out[(kind + ".w_uk (absorbed)", m.n_heads, m.kv_lora, m.nope)] += 1
            out[(kind + ".w_uv (absorbed)", m.n_heads, m.v_dim, m.kv_lora)] += 1
        elif hasattr(m, "gate_proj") and hasattr(m, "up_proj"):
            g = m.gate_proj
            out[(kind + ".gate_up", 1, 2 * g.out_features, g.in_features)] += 1
        elif isinstance(m, Linear) and not re.search(r"(kv_b_proj|gate_proj|up_proj)$", name):
            out[(kind, 1, m.out_features, m.in_features)] += 1
    return out


def read_rate(nbytes: int = 2 << 30) -> float:
    """HBM read bytes/s: a sum over a buffer far larger than L2."""
    from bench.common import time_fn

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    return nbytes / time_fn(lambda: x.sum(), warmup=3, rep=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/small-1m.json")
    ap.add_argument("--batch", default="1,8", help="rows M of the activations, comma-separated")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/gemm_shapes.py needs CUDA (or --device cpu for a smoke run)")
        return 0
    batches = [int(b) for b in args.batch.split(",") if b]
    if not batches or min(batches) < 1:
        print("--batch needs positive row counts")
        return 2

    from longctx.kernels.fp8_gemm import fp8_block_linear

    from bench.common import time_fn
    from longctx.config import ModelConfig

    cfg = ModelConfig.from_json(ROOT / args.config)
    shapes = linear_shapes(cfg)
    dev = torch.device(args.device)
    dt = torch.bfloat16 if cuda else torch.float32

    def timer(fn) -> float:
        if cuda:
            return time_fn(fn, warmup=10, rep=50)
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3

    res: dict = {"config": args.config, "read_Bps": read_rate() if cuda else None, "shapes": []}
    rate = res["read_Bps"]
    totals: dict[str, float] = {}
    for (kind, b, n, k), count in sorted(shapes.items()):
        w = torch.randn(b, n, k, device=dev, dtype=dt).squeeze(0) * 0.02
        w8 = sc = None
        if b == 1 and not args.no_fp8:
            w8 = w.to(torch.float8_e4m3fn)
            sc = torch.ones((n + 127) // 128, (k + 127) // 128, device=dev)
        row: dict = {"kind": kind, "batch": b, "n": n, "k": k, "per_step": count}
        for m in batches:
            if b == 1:
                x = torch.randn(m, k, device=dev, dtype=dt)
                t16 = timer(partial(F.linear, x, w))
            else:  # [m, B, K] x [B, N, K] -> [m, B, N], as the absorbed MLA's einsum
                x = torch.randn(m, b, k, device=dev, dtype=dt)
                t16 = timer(partial(torch.einsum, "thk,hnk->thn", x, w))
            row[f"bf16_us_m{m}"] = round(t16 * 1e6, 2)
            totals[f"bf16_m{m}"] = totals.get(f"bf16_m{m}", 0.0) + count * t16
            if rate:
                row[f"bf16_of_read_m{m}"] = round(2 * b * n * k / t16 / rate, 3)
            if w8 is not None:
                t8 = timer(partial(fp8_block_linear, x, w8, sc, dt))
                row[f"fp8_us_m{m}"] = round(t8 * 1e6, 2)
                totals[f"fp8_m{m}"] = totals.get(f"fp8_m{m}", 0.0) + count * t8
                if rate:
                    row[f"fp8_of_read_m{m}"] = round(n * k / t8 / rate, 3)
        res["shapes"].append(row)
    weight_bytes = sum(2 * b * n * k * c for (_, b, n, k), c in shapes.items())
    res["per_step_ms"] = {key: round(v * 1e3, 4) for key, v in totals.items()}
    res["bf16_weight_bytes_per_step"] = weight_bytes
    if rate:
        res["bf16_roofline_ms"] = round(weight_bytes / rate * 1e3, 4)
    m0 = batches[0]
    lines = [
        f"| projection | [B x] N x K | per step | bf16 us (M={m0}) | of read rate | fp8 us | of read rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["shapes"]:
        lines.append(
            f"| {r['kind']} | {str(r['batch']) + ' x ' if r['batch'] > 1 else ''}{r['n']} x {r['k']} | {r['per_step']} | {r[f'bf16_us_m{m0}']} | "
            f"{r.get(f'bf16_of_read_m{m0}', '-')} | {r.get(f'fp8_us_m{m0}', '-')} | {r.get(f'fp8_of_read_m{m0}', '-')} |"
        )
    print("\n".join(lines))
    print(f"per step: {res['per_step_ms']} ms; bf16 roofline {res.get('bf16_roofline_ms', '-')} ms")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemm-shapes.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.out / "gemm-shapes.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
