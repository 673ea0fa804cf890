"""Routed experts with fp8 block weights at decode: the current path vs `kernels/moe_stream` (H200).

GLM-5.3's experts (Hd 6144, I 2048, 256 experts, top-8, 128 x 128 e4m3 weight blocks, bf16 x) at
batch 1, 8 and 64: every variant is first checked against `moe_experts_ref` on the same inputs, then
timed kernel-only in a CUDA graph with L2 flushed between calls (`kernels_mla_moe.time_graph`). The
roofline is the hit experts' weight + scale bytes at the HBM copy rate measured in the same run.
Rows: "current" = `moe_experts` as the model calls it today (the grouped GEMMs at batch 1-64), then
stream variants (`moe_stream.StreamConfig` fields that differ from its DEFAULT). The winner's spec is
printed as LONGCTX_MOE_STREAM_TILES=... (and LONGCTX_MOE_STREAM_MAX_PAIRS turns the path on).

    python -m bench.moe8_sweep --out DIR            # ~1-2 min on an H200
    python -m bench.moe8_sweep --device cpu --quick --out DIR   # toy sizes, TRITON_INTERPRET=1 (test)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_json_md  # noqa: E402

GLM53 = {"hidden": 6144, "inter": 2048, "experts": 256, "topk": 8}
TOY = {"hidden": 256, "inter": 128, "experts": 12, "topk": 4}


def variants(batch: int, quick: bool) -> list[tuple[str, Any]]:
    """(name, StreamConfig or None for the current path); fewer at batch 64 (each batch recompiles)."""
    from longctx.kernels.moe_stream import DEFAULT

    knobs: list[dict[str, Any]] = [{}, {"mma": "fp8"}]
    if not quick and batch <= 8:
        knobs += [
            {"programs_per_sm": 0},
            {"bn_gate_up": 32},
            {"programs_per_sm": 3, "stages_gate_up": 3, "stages_down": 3},
            {"mma": "fp8", "programs_per_sm": 3, "stages_gate_up": 3, "stages_down": 3},
            {"mma": "fp8", "bn_gate_up": 128, "bn_down": 128, "warps_gate_up": 8, "warps_down": 8,
             "stages_gate_up": 3, "programs_per_sm": 1},
        ]  # fmt: skip
    return [("current", None)] + [(name_of(replace(DEFAULT, **kw)), replace(DEFAULT, **kw)) for kw in knobs]


def name_of(cfg: Any) -> str:
    from longctx.kernels.moe_stream import DEFAULT

    diff = [
        f"{f.name}={getattr(cfg, f.name)}"
        for f in fields(cfg)
        if getattr(cfg, f.name) != getattr(DEFAULT, f.name)
    ]
    return "stream " + (",".join(diff) or "default")


def weights(shape: dict[str, int], device: str, gen: torch.Generator):
    """Random e4m3 experts with scales ~ 1/sqrt(K), made expert by expert (small fp32 temporaries)."""
    e, hd, inter = shape["experts"], shape["hidden"], shape["inter"]
    f8 = torch.float8_e4m3fn
    w_gu = torch.empty(e, 2 * inter, hd, dtype=f8, device=device)
    w_d = torch.empty(e, hd, inter, dtype=f8, device=device)
    for i in range(e):
        w_gu[i] = torch.randn(2 * inter, hd, device=device, generator=gen).clamp(-8, 8).to(f8)
        w_d[i] = torch.randn(hd, inter, device=device, generator=gen).clamp(-8, 8).to(f8)
    # scales vary per block (a constant scale would hide a wrong block index)
    s_gu = (0.5 + torch.rand(e, 2 * inter // 128, hd // 128, device=device, generator=gen)) * hd**-0.5
    s_d = (0.5 + torch.rand(e, hd // 128, inter // 128, device=device, generator=gen)) * inter**-0.5
    return w_gu, w_d, s_gu, s_d


def run(args: argparse.Namespace) -> dict[str, Any]:
    from longctx.kernels.moe import moe_experts, moe_experts_ref

    from bench import kernels_mla_moe as kmm

    dev = args.device
    cuda = dev == "cuda"
    shape = GLM53 if cuda else TOY
    gen = torch.Generator(device=dev).manual_seed(0)
    hbm = kmm.measure_copy_bw() if cuda else math.nan
    if cuda:
        print(f"HBM copy rate {hbm / 1e12:.3g} TB/s", flush=True)
    w_gu, w_d, s_gu, s_d = weights(shape, dev, gen)
    per_expert = (w_gu[0].numel() + w_d[0].numel()) + 4 * (s_gu[0].numel() + s_d[0].numel())
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    for b in batches:
        x = torch.randn(b, shape["hidden"], device=dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand(b, shape["experts"], device=dev, generator=gen).topk(shape["topk"], dim=-1).indices
        tw = torch.rand(b, shape["topk"], device=dev, generator=gen)
        ref = moe_experts_ref(x, ids, tw, w_gu, w_d, "silu", s_gu, s_d).float()
        hit = int(torch.unique(ids).numel())
        roof_us = hit * per_expert / hbm * 1e6 if cuda else math.nan
        for name, cfg in variants(b, args.quick):
            stream = cfg if cfg is not None else False

            def call(stream: Any = stream, x: Any = x, ids: Any = ids, tw: Any = tw) -> torch.Tensor:
                return moe_experts(x, ids, tw, w_gu, w_d, "silu", s_gu, s_d, backend="triton", stream=stream)

            row: dict[str, Any] = {"batch": b, "variant": name, "experts_hit": hit, "roofline_us": roof_us}
            row["config"] = vars(cfg) if cfg is not None else None
            try:
                out = call().float()
                err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                row |= {"rel_err": err, "ok": err < 3e-2}
                if cuda:
                    row |= kmm.graph_fields(call, reps=args.reps)
                    if b == 1 and (cfg is None or name == "stream default"):
                        row["kernels_us"] = kmm.kernel_us(call)
                else:
                    t0 = time.perf_counter()
                    call()
                    row["graph_us"] = (time.perf_counter() - t0) * 1e6  # CPU smoke: wall time, not a graph
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported
                if cuda:
                    torch.cuda.synchronize()
                row |= {"ok": False, "graph_us": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            if row.get("graph_us") and cuda:
                row["fraction_of_hbm"] = roof_us / row["graph_us"]
            rows.append(row)
            print(line(row), flush=True)
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape, "hbm_copy_Bps": hbm,
            "results": rows}  # fmt: skip


def line(r: dict[str, Any]) -> str:
    us = r.get("graph_us")
    t = f"{us:9.1f} us" if us else f"failed: {r.get('error') or r.get('graph_error')}"
    s = f"batch {r['batch']:>2}  {t}  err {r.get('rel_err', math.nan):.2g}  {r['variant']}"
    if r.get("kernels_us"):
        s += "\n    kernels (profiler, us): " + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items())
    return s


def markdown(d: dict[str, Any]) -> str:
    out = [
        "# fp8 MoE decode: current path vs moe_stream",
        "",
        f"{d['device']}, shape {d['shape']}; graph us = kernel-only time in a CUDA graph, L2 flushed; "
        f"roofline = hit experts' weight + scale bytes at the HBM copy rate {d['hbm_copy_Bps'] / 1e12:.3g} TB/s.",
        "",
        "| batch | variant | graph us | roofline us | fraction of HBM | vs current | rel err | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cur = {r["batch"]: r.get("graph_us") for r in d["results"] if r["variant"] == "current"}
    for r in sorted(d["results"], key=lambda r: (r["batch"], r.get("graph_us") or math.inf)):
        us, frac, c = r.get("graph_us"), r.get("fraction_of_hbm"), cur.get(r["batch"])
        speed = f"{c / us:.2f}x" if us and c else ""
        out.append(
            f"| {r['batch']} | {r['variant']} | {us and f'{us:.1f}'} | {r['roofline_us']:.1f} | "
            f"{frac and f'{frac:.3f}'} | {speed} | {r.get('rel_err', math.nan):.2g} | {r['ok']} |"
        )
    best = best_stream(d["results"])
    out += ["", "Fastest correct stream variant per batch (LONGCTX_MOE_STREAM_TILES spec):", ""]
    out += [f"- batch {b}: {v}" for b, v in best.items()]
    return "\n".join(out) + "\n"


def best_stream(rows: list[dict[str, Any]]) -> dict[int, str]:
    """batch -> the LONGCTX_MOE_STREAM_TILES spec of its fastest correct stream variant."""
    best: dict[int, tuple[float, str]] = {}
    for r in rows:
        us = r.get("graph_us")
        if r["variant"] == "current" or not r["ok"] or not us:
            continue
        if r["batch"] not in best or us < best[r["batch"]][0]:
            spec = ",".join(f"{k}={'none' if v is None else v}" for k, v in r["config"].items())
            best[r["batch"]] = (us, spec)
    return {b: v[1] for b, v in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="two stream variants per batch")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,64 on cuda, 1,3 on cpu)")
    ap.add_argument("--reps", type=int, default=10, help="calls per timed CUDA graph")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("moe8_sweep: no CUDA device (use --device cpu for the smoke run)")
        return 0
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.batches = args.batches or ("1,8,64" if args.device == "cuda" else "1,3")
    t0 = time.time()
    d = run(args)
    d["best_stream"] = best_stream(d["results"])
    d["wall_s"] = time.time() - t0
    md = markdown(d)
    print(md)
    write_json_md(args.out, f"moe8-sweep-{args.device}", d, md, default=str)
    print(f"wrote {args.out}/moe8-sweep-{args.device}.json and .md ({d['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
