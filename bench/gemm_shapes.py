"""The decode step's projections one by one: each Linear shape of a config at batch M, in
microseconds and as a fraction of the HBM read rate measured in the same run, for
  cublas     bf16 weights through F.linear,
  gemv       bf16 weights through kernels.gemv (what the Triton backend runs for M <= 16),
  fp8_gemm   fp8 block-quantised weights through kernels.fp8_gemm.fp8_block_linear,
  gemv_fp8   the same fp8 weights through kernels.gemv.

A batch-1 decode step reads every weight it touches once, so its GEMMs are a memory roofline:
bytes / read rate. Each figure is one call's share of many back-to-back calls captured in one CUDA
graph (as the engine replays a decode step), over enough copies of the weights (>= ROTATE_BYTES in
all) that no call finds its weight in the 50 MB L2. The per-step totals weight each shape by how many
times a step runs it. `--sweep` also times kernels.gemv's tile alternatives (GEMV_SWEEP) per shape
and prints the best; the defaults are kernels/gemv.py's TILES_* constants.

    python -m bench.gemm_shapes [--config configs/small-1m.json] [--batch 1,8] [--sweep] [--out DIR]
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


# Bytes of weight copies each timed shape rotates through (several times the L2).
ROTATE_BYTES = 256 << 20
MAX_COPIES = 256
MIN_CALLS = 32


def gemv_sweep():  # type: ignore[no-untyped-def]
    """kernels.gemv tile alternatives: (name, config, fp8 weights?, largest M it is for)."""
    from longctx.kernels.gemv import GemvConfig as C

    out = []
    for fp8 in (False, True):
        bk = 128 if fp8 else 64
        out += [
            ("fma bn32 w4", C(32, 128, 4, 1, False), fp8, 2),
            ("fma bn64 w8", C(64, 128, 8, 1, False), fp8, 2),
            ("fma bn16 w4", C(16, 128, 4, 1, False), fp8, 2),
            (f"dot bn64 bk{bk} w4 s4", C(64, bk, 4, 4, True), fp8, 16),
            (f"dot bn64 bk{bk} w4 s6", C(64, bk, 4, 6, True), fp8, 16),
            (f"dot bn64 bk{bk} w4 s2", C(64, bk, 4, 2, True), fp8, 16),
            (f"dot bn128 bk{bk} w8 s4", C(128, bk, 8, 4, True), fp8, 16),
            (f"dot bn64 bk{bk // 2} w4 s8", C(64, bk // 2, 4, 8, True), fp8, 16),
        ]
    return out


def graph_time(calls: list, replays: int = 10) -> float:  # type: ignore[type-arg]
    """Median seconds per call of `calls` (thunks) run back to back inside one captured CUDA graph,
    repeated to at least MIN_CALLS calls per replay."""
    from bench.common import capture_graph

    seq = calls * max(1, -(-MIN_CALLS // len(calls)))
    g = capture_graph(lambda: [f() for f in seq], warm=lambda: [f() for f in calls])
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(seq))
    del g
    return sorted(times)[len(times) // 2]


def read_rate(nbytes: int = 2 << 30) -> float:
    """HBM read bytes/s: a sum over a buffer far larger than L2."""
    from bench.common import time_fn

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    return nbytes / time_fn(lambda: x.sum(), warmup=3, rep=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/small-1m.json", help="comma-separated config paths")
    ap.add_argument("--batch", default="1,8", help="rows M of the activations, comma-separated")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time kernels.gemv's tile alternatives")
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
    rate = read_rate() if cuda else None
    results, lines = [], []
    for config in [c for c in args.config.split(",") if c]:
        res, md = run_config(config, batches, args, cuda, rate)
        results.append(res)
        lines += md
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemm-shapes.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "gemm-shapes.md").write_text("\n".join(lines) + "\n")
    return 0


def run_config(config: str, batches: list[int], args, cuda: bool, rate: float | None):  # type: ignore[no-untyped-def]
    from longctx.kernels.fp8_gemm import fp8_block_linear, quant_block_fp8_ref
    from longctx.kernels.gemv import gemv

    from longctx.config import ModelConfig

    cfg = ModelConfig.from_json(ROOT / config)
    shapes = linear_shapes(cfg)
    dev = torch.device(args.device)
    dt = torch.bfloat16 if cuda else torch.float32
    backend = "triton" if cuda else "torch"
    sweep = gemv_sweep() if args.sweep and cuda else []

    def timer(calls) -> float:  # type: ignore[no-untyped-def]
        if cuda:
            return graph_time(calls)
        t = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t) / len(calls)

    res: dict = {"config": config, "read_Bps": rate, "shapes": [], "sweep": []}
    totals: dict[str, float] = {}
    for (kind, b, n, k), count in sorted(shapes.items()):
        row: dict = {"kind": kind, "batch": b, "n": n, "k": k, "per_step": count}
        bytes16, bytes8 = 2 * b * n * k, n * k + 4 * -(-n // 128) * -(-k // 128)
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // bytes16))) if cuda else 1
        ws = [torch.randn(b, n, k, device=dev, dtype=dt).squeeze(0) * 0.02 for _ in range(copies)]
        w8s = [] if (b > 1 or args.no_fp8) else [quant_block_fp8_ref(w) for w in ws]
        for m in batches:
            cols: dict[str, tuple[list, int]] = {}  # type: ignore[type-arg]
            if b == 1:
                x = torch.randn(m, k, device=dev, dtype=dt)
                cols["cublas"] = ([partial(F.linear, x, w) for w in ws], bytes16)
                cols["gemv"] = ([partial(gemv, x, w, None, dt, backend=backend) for w in ws], bytes16)
                if w8s:
                    cols["fp8_gemm"] = ([partial(fp8_block_linear, x, q, s, dt) for q, s in w8s], bytes8)
                    cols["gemv_fp8"] = ([partial(gemv, x, q, s, dt, backend=backend) for q, s in w8s], bytes8)
            else:  # [m, B, K] x [B, N, K] -> [m, B, N], as the absorbed MLA's einsum
                x = torch.randn(m, b, k, device=dev, dtype=dt)
                cols["cublas"] = ([partial(torch.einsum, "thk,hnk->thn", x, w) for w in ws], bytes16)
            for name, (calls, nbytes) in cols.items():
                t = timer(calls)
                row[f"{name}_us_m{m}"] = round(t * 1e6, 2)
                totals[f"{name}_m{m}"] = totals.get(f"{name}_m{m}", 0.0) + count * t
                if rate:
                    row[f"{name}_of_read_m{m}"] = round(nbytes / t / rate, 3)
            for label, gc, fp8, max_m in sweep:
                if b > 1 or m > max_m or (fp8 and not w8s):
                    continue
                if fp8:
                    calls = [partial(gemv, x, q, s, dt, backend=backend, config=gc) for q, s in w8s]
                else:
                    calls = [partial(gemv, x, w, None, dt, backend=backend, config=gc) for w in ws]
                t = timer(calls)
                res["sweep"].append(
                    {"kind": kind, "n": n, "k": k, "m": m, "fp8": fp8, "tiles": label, "us": round(t * 1e6, 2),
                     "of_read": round((bytes8 if fp8 else bytes16) / t / rate, 3) if rate else None}
                )  # fmt: skip
        res["shapes"].append(row)
        del ws, w8s
    weight_bytes = sum(2 * b * n * k * c for (_, b, n, k), c in shapes.items())
    res["per_step_ms"] = {key: round(v * 1e3, 4) for key, v in totals.items()}
    res["bf16_weight_bytes_per_step"] = weight_bytes
    if rate:
        res["bf16_roofline_ms"] = round(weight_bytes / rate * 1e3, 4)
        res["fp8_roofline_ms"] = round(weight_bytes / 2 / rate * 1e3, 4)
    names = ["cublas", "gemv", "fp8_gemm", "gemv_fp8"]
    lines = [
        f"## {config}: us per call (fraction of the read rate), CUDA graph of back-to-back calls",
        "",
        "| projection | [B x] N x K | per step | M | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for r in res["shapes"]:
        for m in batches:
            cells = [
                f"{r[f'{c}_us_m{m}']} ({r.get(f'{c}_of_read_m{m}', '-')})" if f"{c}_us_m{m}" in r else "-"
                for c in names
            ]
            shape = f"{str(r['batch']) + ' x ' if r['batch'] > 1 else ''}{r['n']} x {r['k']}"
            lines.append(f"| {r['kind']} | {shape} | {r['per_step']} | {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"per step (ms): {res['per_step_ms']}; roofline bf16 {res.get('bf16_roofline_ms', '-')} ms, "
        f"fp8 {res.get('fp8_roofline_ms', '-')} ms (every projection's weight once)",
        "",
    ]
    if res["sweep"]:
        lines += sweep_summary(res["sweep"])
    return res, lines


def sweep_summary(rows: list[dict]) -> list[str]:
    """Per (weight kind, M): each tile choice's count-unweighted sum of us over the shapes, best first,
    and the best choice per shape."""
    lines = ["| weights | M | tiles | sum of us over shapes | shapes where best |", "|---|---|---|---|---|"]
    groups: dict[tuple[bool, int], dict[str, float]] = {}
    best: dict[tuple[bool, int, str], tuple[float, str]] = {}
    for r in rows:
        key = (r["fp8"], r["m"])
        groups.setdefault(key, {})
        groups[key][r["tiles"]] = groups[key].get(r["tiles"], 0.0) + r["us"]
        sk = (r["fp8"], r["m"], r["kind"])
        if sk not in best or r["us"] < best[sk][0]:
            best[sk] = (r["us"], r["tiles"])
    for (fp8, m), tiles in sorted(groups.items()):
        wins = Counter(t for (f, mm, _), (_, t) in best.items() if (f, mm) == (fp8, m))
        for label, tot in sorted(tiles.items(), key=lambda kv: kv[1]):
            lines.append(f"| {'fp8' if fp8 else 'bf16'} | {m} | {label} | {tot:.1f} | {wins.get(label, 0)} |")
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
