"""Indexer decode launch knobs on the GPU: every kernels.indexer.DecodeKnobs setting in SETTINGS is first
checked against `indexer_logits_paged_ref` on the GPU (batch 1 and 8 at the longest context, and a ragged
batch of 3: contexts not a multiple of the 64-key page, one query short of its request's end, one
one-key request), then timed kernel-only in a CUDA graph (L2 flushed between calls;
bench.kernels_mla_moe.time_graph) at batch 1 and 8 over 1M and 128K fp8 keys (132 bytes each) of
random 64-key pages, for 32 and 64 heads x 128 dims (GLM-5 has 32 index heads, DeepSeek-V3.2 64).
The rate counts keys + logits + page ids (as bench.kernels_indexer does) against the HBM copy rate
measured in the same run. Settings run in priority order until --budget-s has gone (the rest are
listed as skipped); each row also gives the compiled kernel's registers / shared memory, which set how
many programs share an SM. The defaults are the 2026-11-30 sweep's winner; OLD_LAUNCH (the launch before
the knobs) stays in the list as the baseline.

    python -m bench.idx_sweep [--quick] [--budget-s 90] [--out DIR]

--device cpu --quick runs the same path at toy sizes under TRITON_INTERPRET=1 (the test of this script).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.kernels import kv_layout as kvl  # noqa: E402
from longctx.kernels.common import knobs_diff  # noqa: E402
from longctx.kernels.indexer import (  # noqa: E402
    OLD_LAUNCH,
    DecodeKnobs,
    decode_launch_stats,
    indexer_logits_paged,
    indexer_logits_paged_ref,
)

from bench.common import environment, sweep_device, sweep_timer, write_json_md, write_results  # noqa: E402

P = DecodeKnobs.parse
# In priority order (the budget cuts the tail). Static facts from an sm_90a AOT compile (triton 3.9, 4 warps,
# 3 stages, registers / thread, dynamic shared memory): the gather kernel takes 130 regs, 41 KiB at
# 32 heads (3 programs an SM, as per_sm=3 assumes) but 227 regs, 49 KiB at 64 heads (2 an SM: per_sm=3
# then launches 1.5 waves; per_sm=0 sizes the grid by what fits). In its loop only the key tile is
# pipelined (cp.async, 2 tiles in flight); the 128 scales are a plain load waited for in the same
# iteration, one DRAM round trip per tile: sc_ahead=1 loads them a tile ahead (138 regs at 32 heads, keys
# still pipelined). The TMA kernel pipelines the key pages (TMA + mbarriers) and loads the scales a tile
# ahead: 127 regs, 41 KiB at 32 heads, 220 regs, 50 KiB at 64 (2 pages an iteration, 3 stages); 1 page x 4
# stages 33 KiB; x 8 stages 74 KiB; 8 warps 94 regs (32 heads). On the H200 (triton 3.6) the default, 1
# page x 4 stages: 74 regs, 32 KiB, 6 programs an SM at 32 heads; 112 regs, 40 KiB, 4 at 64 heads.
SETTINGS = [
    DecodeKnobs(),
    OLD_LAUNCH,
    P("stages=6"),
    P("block_n=128,stages=3"),
    P("tma=0"),
    P("tma=0,sc_ahead=1"),
    P("stages=8"),
    P("block_n=128"),
    P("waves=2"),
    P("per_sm=4"),
    P("block_n=256,stages=2"),
    P("warps=8"),
    P("tma=0,sc_ahead=1,block_n=64,stages=4"),
]
QUICK = [0, 1, 4, 5]  # indices into SETTINGS
DIM, KIND, PAGE = 128, "fp8_e4m3", kvl.PAGE_SIZE
TOL = 1e-4  # max |err| / max |ref| (bench.kernels_indexer's bar): fp32 sums in another order


def _pool(num_pages: int, dim: int, dev: torch.device, src_pages: int) -> torch.Tensor:
    """An fp8 index pool of num_pages pages: `src_pages` pages of random keys written by the real writer,
    tiled (distinct addresses, repeating content: seconds for GBs)."""
    pool = kvl.alloc_index_pool(num_pages * PAGE, dim, KIND, torch.bfloat16, dev)
    src = min(src_pages, num_pages) * PAGE
    gen = torch.Generator(device=dev).manual_seed(0)
    kvl.write_index_k(
        pool, torch.arange(src, device=dev), torch.randn(src, dim, device=dev, generator=gen), KIND
    )
    for r0 in range(src, pool.shape[0], src):  # whole pages: the page-major layout copies as rows
        n = min(src, pool.shape[0] - r0)
        pool[r0 : r0 + n].copy_(pool[:n])
    return pool


def _case(
    pool: torch.Tensor, pages: torch.Tensor, lens: list[int], pos: list[int], heads: int, gen: torch.Generator
) -> tuple[Any, ...]:
    """Indexer arguments for len(lens) requests (request r owns page row r of `pages`), one query each at
    position pos[r]; max_len = max(lens)."""
    dev = pool.device
    b = len(lens)
    q = torch.randn(b, heads, DIM, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.rand(b, heads, device=dev, generator=gen)  # raw weights; their scale goes in w_scale
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q_seq = torch.arange(b, dtype=torch.int32, device=dev)
    q_pos = torch.tensor(pos, dtype=torch.int64, device=dev)
    return (q, w, pool, pages[:b].contiguous(), seq_lens, q_seq, q_pos, KIND, max(lens))


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)) or not torch.all(got[~fin] == float("-inf")):
        return math.inf
    if not fin.any():
        return 0.0
    return float((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-30))


def _markdown(res: dict[str, Any]) -> str:
    hbm = res["hbm_copy_Bps"]
    lines = [
        f"# Indexer decode launch sweep ({res['env'].get('gpu') or 'cpu'})",
        "",
        f"fp8 keys ({DIM} dims + fp32 scale = {DIM + 4} B), random 64-key pages, bf16 q, one query per request. "
        f"Kernel-only time in a CUDA graph (L2 flushed); fraction of the HBM copy rate {hbm / 1e12:.2f} TB/s "
        f"(read + write) measured in this run, bytes = keys + logits + page ids. Every setting checked against "
        f"the reference first (max rel err over batch 1, 8 and a ragged 3).",
        "",
    ]
    for key, rows in res["by_case"].items():
        if not rows:
            continue
        lines += [
            f"## {key}",
            "",
            "| setting | us | of HBM | vs default | grid | regs | smem KiB | fit / SM | spills | rel err | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            st = r.get("stats") or {}
            smem = f"{st['shared'] / 1024:.0f}" if "shared" in st else ""
            grid = "x".join(map(str, st.get("grid") or ()))
            lines.append(
                f"| {r['spec_short'] or 'default'} | {r['graph_us']:.1f} | {r['frac_hbm']:.3f} | "
                f"{r['speedup_vs_default']:.2f}x | {grid} | {st.get('regs', '')} | {smem} | {st.get('fit', '')} | "
                f"{st.get('spills', '')} | {r['rel_err']:.2g} | {r['ok']} |"
            )
        lines.append("")
    for key, w in res["best"].items():
        lines.append(
            f"{key}: LONGCTX_INDEXER_DECODE={w['env_spec']} ({w['graph_us']:.1f} us, {w['frac_hbm']:.3f} of HBM, "
            f"{w['speedup_vs_default']:.2f}x the default)"
        )
    if res["skipped"]:
        lines.append(f"\nskipped (budget): {', '.join(res['skipped'])}")
    failed = [c for c in res["checks"] if not c["ok"]]
    if failed:
        lines.append(
            "\nfailed: " + "; ".join(f"{c['spec']}: {c.get('error') or c['rel_err']}" for c in failed)
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctxs", default=f"{1 << 20},{1 << 17}", help="keys per request, longest first")
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--budget-s", type=float, default=90.0, help="no new setting is started after this")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t_start = time.time()
    dev, rc = sweep_device(args.device, "bench/idx_sweep.py")
    if rc is not None:
        return rc
    cuda = dev.type == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    ctxs = sorted((int(c) for c in args.ctxs.split(",")), reverse=True)
    heads_list = [int(h) for h in args.heads.split(",")]
    if not cuda:  # toy sizes: the interpreter runs every program in Python
        batches, ctxs, heads_list = [1, 3], [300], [8]
    settings = [SETTINGS[i] for i in QUICK] if args.quick else SETTINGS
    n_req = max(max(batches), 3)
    pages_per = -(-ctxs[0] // PAGE)
    pool = _pool(n_req * pages_per, DIM, dev, 1 << 10)
    gen = torch.Generator(device=dev).manual_seed(1)
    pages = torch.randperm(n_req * pages_per, device=dev, generator=gen).view(n_req, pages_per).int()
    w_scale = DIM**-0.5  # the model's H^-0.5 * D^-0.5 up to the head count: any positive scalar will do
    # ragged batch of 3: not a multiple of the page, a query short of its request's end, a one-key request
    top = ctxs[0]
    rag_lens, rag_pos = [top - 5, top // 3 + 7, 1], [top - 6, top // 5, 0]
    checks_cases: dict[str, tuple[Any, ...]] = {}
    timed: dict[tuple[int, int, int], tuple[Any, ...]] = {}
    for heads in heads_list:
        for b in batches:
            for c in ctxs:
                timed[(heads, b, c)] = _case(pool, pages, [c] * b, [c - 1] * b, heads, gen)
            checks_cases[f"h{heads}_b{b}"] = timed[(heads, b, ctxs[0])]
        checks_cases[f"h{heads}_ragged3"] = _case(pool, pages, rag_lens, rag_pos, heads, gen)
    refs = {k: indexer_logits_paged_ref(*a, w_scale=w_scale) for k, a in checks_cases.items()}
    if cuda:
        from bench.kernels_mla_moe import measure_copy_bw

        hbm = measure_copy_bw()
    else:
        hbm = 4.27e12  # the H200 figure, for the smoke test's arithmetic only
    print(f"HBM copy {hbm / 1e12:.2f} TB/s; setup {time.time() - t_start:.1f} s", flush=True)
    timer = sweep_timer(cuda)
    row_bytes = pool.shape[1]
    checks: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for knobs in settings:
        spec = knobs.spec()
        if time.time() - t_start > args.budget_s:
            skipped.append(knobs_diff(knobs) or "default")
            continue
        t_cfg = time.time()
        errs: dict[str, float] = {}
        call = partial(indexer_logits_paged, backend="triton", knobs=knobs, w_scale=w_scale)
        try:
            for name, a in checks_cases.items():
                errs[name] = _err(call(*a), refs[name])
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile (shared memory) is reported
            print(f"{spec}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            checks.append({"spec": spec, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        ok = all(e <= TOL for e in errs.values())
        checks.append({"spec": spec, "ok": ok, "rel_err": errs})
        for (heads, b, c), a in timed.items():
            try:
                sec = timer(partial(call, *a))
            except Exception as exc:  # noqa: BLE001 - e.g. a capture failure: reported, the sweep goes on
                print(f"  {spec} h{heads} b{b} ctx {c}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                checks[-1].setdefault("timing_errors", []).append(f"h{heads} b{b} c{c}: {type(exc).__name__}")
                continue
            nbytes = b * c * (row_bytes + 4 + 4 / PAGE)
            err = max(errs[f"h{heads}_b{b}"], errs[f"h{heads}_ragged3"])
            rows.append(
                {
                    "heads": heads,
                    "batch": b,
                    "ctx": c,
                    "spec": spec,
                    "spec_short": knobs_diff(knobs),
                    "env_spec": knobs_diff(knobs),
                    "graph_us": sec * 1e6,
                    "bytes": nbytes,
                    "frac_hbm": nbytes / sec / hbm,
                    "rel_err": err,
                    "ok": ok,
                    "stats": decode_launch_stats(),
                }
            )  # fmt: skip  (the timed launch's kernel)
        times = {f"h{r['heads']}_b{r['batch']}_{r['ctx']}": r["graph_us"] for r in rows if r["spec"] == spec}
        print(f"{knobs_diff(knobs) or 'default':40s} ok={ok} max rel err {max(errs.values()):.2g}  "
              + "  ".join(f"{k} {u:.1f}" for k, u in times.items())
              + f"  ({time.time() - t_cfg:.1f} s)", flush=True)  # fmt: skip
    default_spec = DecodeKnobs().spec()
    by_case: dict[str, list[dict[str, Any]]] = {}
    best: dict[str, dict[str, Any]] = {}
    for heads, b, c in timed:
        key = f"{heads} heads, batch {b}, {c} keys"
        mine = [r for r in rows if (r["heads"], r["batch"], r["ctx"]) == (heads, b, c)]
        base = next((r["graph_us"] for r in mine if r["spec"] == default_spec), math.nan)
        for r in mine:
            r["speedup_vs_default"] = base / r["graph_us"] if r["graph_us"] > 0 else math.nan
        by_case[key] = sorted(mine, key=lambda r: r["graph_us"])
        good = [r for r in by_case[key] if r["ok"]]
        if good:
            best[key] = good[0]
    res = {
        "env": environment(),
        "batches": batches,
        "ctxs": ctxs,
        "heads": heads_list,
        "hbm_copy_Bps": hbm,
        "checks": checks,
        "results": rows,
        "by_case": by_case,
        "best": best,
        "skipped": skipped,
        "wall_s": time.time() - t_start,
    }
    md = _markdown(res)
    print(md)
    if cuda:  # bench/results and --out
        for p in write_results(
            f"idx-sweep-{torch.cuda.get_device_name().split()[-1].lower()}", res, md, args.out
        ):
            print("wrote", p)
    elif args.out:  # the smoke test writes only where it is told
        write_json_md(args.out, "idx-sweep-cpu", res, md, default=float)
    return 0 if checks and all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
