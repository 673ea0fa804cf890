"""All hot-path kernels on the H200 at GLM-5.3 shapes, against ceilings measured in the same run.

Runs, in one process: the ceilings (HBM copy, pinned H2D, bf16/fp8 GEMM), KV writes, indexer decode
logits (batch 1/8/64 x 8K/128K/1M), top-k, swap-in gather, sparse MLA decode, MoE, FP8 GEMM and one
whole GLM-5.3 MoE layer decode step at 1M (bench/layer.py). Every kernel is checked against its
torch reference on the GPU before it is timed. Writes bench/results/kernels-h200.{json,md}.

    python -m bench.kernels [--quick] [--sweep] [--out $OUT]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, measure_ceilings, write_results  # noqa: E402

CTXS = (8192, 131072, 1 << 20)
BATCHES = (1, 8, 64)


def _section(name: str, fn, results: dict[str, Any], errors: dict[str, str]) -> None:
    t0 = time.time()
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc()
    print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
    torch.cuda.empty_cache()


def _pick(rows: list[dict], **match) -> dict | None:
    for r in rows or []:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def summary(res: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
    """The required keys, each with the time, the achieved rate and the ceiling it is compared with."""
    out: dict[str, Any] = {}
    sw = [r for r in res.get("swap_in", []) if r.get("mode") == "registered"]
    if sw:
        best = max(sw, key=lambda r: r["frac_of_ceiling"])
        out["swap_in"] = {
            "time_s": best["time_s"],
            "rate_Bps": best["rate_Bps"],
            "ceiling_Bps": best["ceiling_Bps"],
            "fraction_of_h2d": best["frac_of_ceiling"],
            "rows_per_item": best["rows_per_item"],
            "ok": best["ok"],
        }
    for batch, key in ((1, "indexer_decode_1m"), (8, "indexer_decode_1m_b8")):
        r = _pick(res.get("indexer_decode", []), ctx=1 << 20, batch=batch)
        if r:
            out[key] = {
                "time_s": r["time_s"],
                "rate_Bps": r["rate_Bps"],
                "ceiling_Bps": r["ceiling_Bps"],
                "fraction_of_hbm": r["frac_of_ceiling"],
                "ok": r["ok"],
                "graph_us": r.get("graph_us"),
                "graph_fraction_of_hbm": r.get("graph_frac_of_ceiling"),
            }
    r = _pick(res.get("topk", []), n=1 << 20, batch=1)
    if r:
        out["topk_1m"] = {
            "time_us": r["time_s"] * 1e6,
            "rate_Bps": r["rate_Bps"],
            "target_us": 100.0,
            "torch_topk_us": r["torch_topk_s"] * 1e6,
            "ok": r["ok"],
            "graph_us": r.get("graph_us"),
        }
    mla = res.get("sparse_mla_decode", [])
    if mla:
        r = _pick(mla, batch=1) or mla[0]
        out["sparse_mla_decode"] = {
            "time_s": r["time_us"] / 1e6,
            "roofline_s": r["roofline_us"] / 1e6,
            "roofline_ratio": r["x_roofline"],
            "achieved_Bps": r["achieved_GBps"] * 1e9,
            "bytes": r["bytes"],
            "flops": r["flops"],
            "ok": r["ok"],
            "graph_us": r.get("graph_us"),
            "graph_roofline_ratio": r.get("graph_x_roofline"),
            "by_batch": {
                str(x["batch"]): {
                    "time_us": x["time_us"],
                    "roofline_ratio": x["x_roofline"],
                    "graph_us": x.get("graph_us"),
                    "graph_roofline_ratio": x.get("graph_x_roofline"),
                    # impl="heads" (the default since this run): graph time and its roofline ratio
                    "heads_graph_us": x.get("impl_heads", {}).get("graph_us"),
                    "heads_graph_roofline_ratio": (
                        x["impl_heads"]["graph_us"] / x["roofline_us"]
                        if x.get("impl_heads", {}).get("graph_us")
                        else None
                    ),
                }
                for x in mla
            },
        }
    moe = res.get("moe", [])
    if moe:
        out["moe_decode"] = {
            str(x["batch"]): {
                "time_us": x["time_us"],
                "roofline_us": x["roofline_us"],
                "roofline_ratio": x["x_roofline"],
                "graph_us": x.get("graph_us"),
                "graph_roofline_ratio": x.get("graph_x_roofline"),
            }
            for x in moe
        }
    lay = res.get("layer")
    if lay:
        c = lay[0]
        out["layer_decode_1m"] = {
            "time_s": c["time_s"],
            "roofline_s": c["roofline_s"],
            "roofline_ratio": c["roofline_ratio"],
            "bytes": c["bytes"]["total"],
            "eager_s": c["eager_s"],
            "graph_s": c["graph_s"],
            "ceiling_Bps": ceil["hbm_copy_Bps"],
        }
    return out


def _g(us: float | None) -> str:
    return f"{us:.1f} us" if us else "n/a"


def _r(x: float | None) -> str:
    return f"{x:.2f}x roofline" if x else "n/a"


def table(s: dict[str, Any], ceil: dict[str, float]) -> str:
    rows = [
        "| figure | time (eager call) | achieved | ceiling | ratio | target | kernel time in a CUDA graph |",
        "|---|---|---|---|---|---|---|",
        f"| HBM copy (read+write) | | {ceil['hbm_copy_Bps'] / 1e12:.2f} TB/s | | | | |",
        f"| pinned H2D | | {ceil['pinned_h2d_Bps'] / 1e9:.1f} GB/s | | | | |",
        f"| bf16 GEMM 8192^3 | | {ceil.get('bf16_gemm_flops', 0) / 1e12:.0f} TFLOP/s | | | | |",
        f"| fp8 GEMM 8192^3 | | {ceil.get('fp8_gemm_flops', 0) / 1e12:.0f} TFLOP/s | | | | |",
    ]
    if "swap_in" in s:
        x = s["swap_in"]
        rows.append(
            f"| swap-in, 64-token pages, registered host | {x['time_s'] * 1e6:.0f} us | "
            f"{x['rate_Bps'] / 1e9:.1f} GB/s | {x['ceiling_Bps'] / 1e9:.1f} GB/s | "
            f"{x['fraction_of_h2d']:.2f} of H2D | >= 0.90 | |"
        )
    for key, b in (("indexer_decode_1m", 1), ("indexer_decode_1m_b8", 8)):
        if key not in s:
            continue
        x = s[key]
        rows.append(
            f"| indexer logits, 1M fp8 keys, batch {b} | {x['time_s'] * 1e6:.0f} us | "
            f"{x['rate_Bps'] / 1e12:.2f} TB/s | {x['ceiling_Bps'] / 1e12:.2f} TB/s | "
            f"{x['fraction_of_hbm']:.2f} of HBM | >= 0.80 | {_g(x.get('graph_us'))}"
            + (f", {x['graph_fraction_of_hbm']:.2f} of HBM |" if x.get("graph_fraction_of_hbm") else " |")
        )
    if "topk_1m" in s:
        x = s["topk_1m"]
        rows.append(
            f"| top-2048 of 1M, batch 1 | {x['time_us']:.0f} us | (torch.topk {x['torch_topk_us']:.0f} us) "
            f"| | | <= 100 us | {_g(x.get('graph_us'))} |"
        )
    if "sparse_mla_decode" in s:
        x = s["sparse_mla_decode"]
        rows.append(
            f"| sparse MLA decode, top-2048 fp8, 64 heads, batch 1 | {x.get('time_s', 0) * 1e6:.1f} us | | "
            f"roofline {x.get('roofline_s', 0) * 1e6:.1f} us | {x.get('roofline_ratio', 0):.2f} | <= 1.25 | "
            f"{_g(x.get('graph_us'))} ({_r(x.get('graph_roofline_ratio'))}) |"
        )
        for b, y in x.get("by_batch", {}).items():
            if y.get("heads_graph_us"):
                rows.append(
                    f"| sparse MLA, batch {b}: split / heads (default) in a graph | {_g(y.get('graph_us'))} / "
                    f"{_g(y['heads_graph_us'])} | | | heads {_r(y.get('heads_graph_roofline_ratio'))} | | |"
                )
    for b, x in s.get("moe_decode", {}).items():
        rows.append(
            f"| MoE 256 experts top-8 fp8, batch {b} | {x['time_us']:.0f} us | | "
            f"roofline {x['roofline_us']:.0f} us | {x['roofline_ratio']:.2f} | | "
            f"{_g(x.get('graph_us'))} ({_r(x.get('graph_roofline_ratio'))}) |"
        )
    if "layer_decode_1m" in s:
        x = s["layer_decode_1m"]
        rows.append(
            f"| GLM-5.3 MoE layer decode step, 1M, fp8 | {x['time_s'] * 1e6:.0f} us | "
            f"{x['bytes'] / x['time_s'] / 1e12:.2f} TB/s | roofline {x['roofline_s'] * 1e6:.0f} us | "
            f"{x['roofline_ratio']:.2f} | <= 1.3 | {_g(x['graph_s'] * 1e6 if x.get('graph_s') else None)} |"
        )
    return "\n".join(rows)


def resummarise(path: Path) -> None:
    """Rebuild the summary and table of a results file (after changing what they report)."""
    import json

    d = json.loads(path.read_text())
    d["summary"] = summary(d["results"], d["ceilings"])
    tab = table(d["summary"], d["ceilings"])
    path.write_text(json.dumps(d, indent=2, default=float) + "\n")
    path.with_suffix(".md").write_text(tab + "\n")
    print(tab)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resummarise", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="tile sweeps for sparse MLA")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.resummarise:
        resummarise(args.resummarise)
        return 0
    if not torch.cuda.is_available():
        print("bench/kernels.py needs CUDA; nothing to do on this machine")
        return 0
    from bench import kernels_indexer as ki
    from bench import kernels_mla_moe as km
    from bench import layer as bl

    skip = set(filter(None, args.skip.split(",")))
    ctxs = CTXS[:1] + CTXS[-1:] if args.quick else CTXS
    batches = (1,) if args.quick else BATCHES
    res: dict[str, Any] = {}
    err: dict[str, str] = {}
    ceil = measure_ceilings()
    print({k: f"{v:.3e}" for k, v in ceil.items() if isinstance(v, float)}, flush=True)
    hbm, bf16 = ceil["hbm_copy_Bps"], ceil.get("bf16_gemm_flops")
    sections = {
        "kv_write": lambda: ki.bench_kv_write(ceilings=ceil),
        "indexer_decode": lambda: ki.bench_indexer_decode(ctx_lens=ctxs, batches=batches, ceilings=ceil),
        "topk": lambda: ki.bench_topk(ns=ctxs, batches=batches),
        "swap_in": lambda: ki.bench_swap_in(ceilings=ceil),
        "sparse_mla_decode": lambda: km.bench_sparse_mla_decode(
            batches=BATCHES, hbm_bps=hbm, peak_flops=bf16, sweep=args.sweep
        ),
        "moe": lambda: km.bench_moe(batches=batches, hbm_bps=hbm, peak_flops=bf16, sweep=False),
        "fp8_gemm": lambda: km.bench_fp8_gemm(
            batches=(1, 64, 4096), hbm_bps=hbm, bf16_flops=bf16, fp8_flops=ceil.get("fp8_gemm_flops")
        ),
        "layer": lambda: [bl.run_case(bl.load_cfg(), 1 << 20, 1, ceil)],
    }
    only = set(filter(None, args.only.split(",")))
    for name, fn in sections.items():
        if name not in skip and (not only or name in only):
            _section(name, fn, res, err)
    s = summary(res, ceil)
    tab = table(s, ceil)
    print(tab)
    write_results(
        "kernels-h200",
        {
            "env": environment(),
            "ceilings": ceil,
            "summary": s,
            "errors": err,
            "results": res,
            "command": "python -m bench.kernels " + " ".join(argv or sys.argv[1:]),
        },
        tab,
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
