"""Sparse MLA decode launch knobs on the GPU: every kernels.sparse_mla_heads.HeadsKnobs setting in
SETTINGS (and a few K splits around each one's automatic choice) is first checked against
`sparse_mla_ref` on the GPU (max error at every batch and on a ragged batch with -1 padding), then timed
kernel-only in a CUDA graph (L2 flushed between calls; bench.kernels_mla_moe.time_graph) at batch 1, 8
and 64, GLM-5.3 shapes: 64 heads, latent 512 + rope 64, top-2048 of an fp8 656-byte-token pool. Every
request owns --context tokens in random 64-token pages of one pool (64 x 64K tokens = 2.7 GB by default),
its top-k are distinct random positions of its context, so rows are scattered and distinct as in a real
decode batch. The roofline is max(bytes / HBM copy rate, flops / bf16 dense GEMM peak), both measured
in the same run. Prints a table per batch and the LONGCTX_SPARSE_MLA_HEADS spec of each batch's winner;
writes smla-sweep-<gpu>.{json,md} to --out (and bench/results). Settings are taken in order until
--budget-s of wall time has gone (the rest are listed as skipped): ~2 minutes on an H200.

    python -m bench.smla_sweep [--quick] [--budget-s 85] [--context 65536] [--out DIR]

--device cpu --quick runs the same path at toy sizes under TRITON_INTERPRET=1 (the test of this script).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.kernels.common import knobs_diff, num_sms  # noqa: E402
from longctx.kernels.fp8_gemm import cdiv  # noqa: E402
from longctx.kernels.kv_layout import alloc_mla_pool, mla_row_bytes, write_mla_kv  # noqa: E402
from longctx.kernels.sparse_mla import sparse_mla, sparse_mla_ref  # noqa: E402
from longctx.kernels.sparse_mla_heads import HeadsKnobs, pick_splits_heads  # noqa: E402

from bench.common import environment, gemm_flops, sweep_device, sweep_timer, write_json_md, write_results  # noqa: E402

P = HeadsKnobs.parse
# In priority order (the budget cuts the tail). Static facts from an sm_90a AOT compile (triton 3.9, 4 of
# 4 value blocks = vsplit 1 unless said; smem per CTA, registers/thread, spill bytes): the default at
# block_n 64 / 8 warps takes 190 KB, 255 regs + 416 B spill (1 CTA/SM); vsplit=2 at 4 warps 173 KB, 255
# + 152 B (1/SM). The ones marked 2/SM fit two CTAs per SM (smem <= ~113 KB, regs x threads <= 32K),
# so one CTA's gathers overlap the other's dots: vsplit=4/bn 16 95 KB, 188 regs, 0 spill (wgmma);
# vsplit=2/bn 16 99 KB, 255 + 8 B; block_h=32,vsplit=2/bn 32 74 KB, 244, 0 (mma.sync); block_h=16/bn 32
# 3 stages 64 KB, 188, 0 (mma.sync); block_h=32/bn 16 60 KB, 255 + 16 B.
SETTINGS = [
    HeadsKnobs(),
    P("vsplit=2,warps=4"),
    P("vsplit=4,warps=4,block_n=16"),  # 2/SM
    P("vsplit=2,warps=4,block_n=16"),  # 2/SM
    P("block_h=32,vsplit=2,warps=4,block_n=32"),  # 2/SM
    P("block_h=16,warps=4,block_n=32,stages=3"),  # 2/SM
    P("vsplit=4,warps=4,block_n=32"),  # 115 KB, 188 regs: just over 2/SM
    P("vsplit=2,warps=8"),
    P("block_h=32,warps=4,block_n=16"),  # 2/SM
    P("vsplit=4,warps=8,block_n=32"),  # 115 KB, 250 regs, 0 spill
    P("stages=3"),
    P("vsplit=2,warps=4,block_n=32"),
    P("block_h=32,warps=4"),
    P("vsplit=4,warps=4"),
]
QUICK = [0, 1, 2, 4]  # indices into SETTINGS
HEADS, L, R, KIND, PAGE = 64, 512, 64, "fp8_e4m3", 64
TOL = 2e-2  # max |err| / max |ref|: bf16 rounding of the dequantised tile, P and the output


def _pool(n_tokens: int, dev: torch.device, src_rows: int) -> torch.Tensor:
    """An fp8 pool of n_tokens rows: `src_rows` random tokens written by the real writer, tiled (distinct
    addresses, repeating content: seconds for GBs)."""
    pool = alloc_mla_pool(n_tokens, L, R, KIND, torch.bfloat16, dev)
    src_rows = min(src_rows, n_tokens)
    gen = torch.Generator(device=dev).manual_seed(0)
    lat = torch.randn(src_rows, L, device=dev, generator=gen)
    rope = torch.randn(src_rows, R, device=dev, generator=gen)
    write_mla_kv(pool, torch.arange(src_rows, device=dev), lat, rope, KIND)
    for r0 in range(src_rows, n_tokens, src_rows):
        n = min(src_rows, n_tokens - r0)
        pool[r0 : r0 + n].copy_(pool[:n])
    return pool


def _indices(batch: int, context: int, topk: int, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[batch, topk] physical slots: request i's context lives in its own random pages of the pool; its
    top-k are distinct random positions of that context."""
    ppr = context // PAGE
    pages = torch.randperm(batch * ppr, device=dev, generator=gen).view(batch, ppr)
    pos = torch.rand(batch, context, device=dev, generator=gen).argsort(dim=1)[:, :topk]
    slots = pages.gather(1, pos // PAGE) * PAGE + pos % PAGE
    return slots.to(torch.int32).contiguous()


def _ragged(idx: torch.Tensor) -> torch.Tensor:
    """Three queries with -1 padding: 100 valid entries scattered, one valid entry, none."""
    r = idx[:3].clone()
    keep = torch.zeros_like(r, dtype=torch.bool)
    keep[0, torch.randperm(r.shape[1], device=r.device)[:100]] = True
    keep[1, r.shape[1] // 2] = True
    return torch.where(keep, r, torch.full_like(r, -1))


def _auto_splits(knobs: HeadsKnobs, batch: int, topk: int, dev: torch.device) -> tuple[int, int]:
    """(block_n, K splits) the wrapper picks for `knobs` at this batch (GLM shapes: 4 value blocks)."""
    bn = knobs.block_n or (64 if batch >= 8 else 32)
    programs = batch * cdiv(HEADS, knobs.block_h or 64) * math.gcd(knobs.vsplit, 4)
    return bn, knobs.splits or pick_splits_heads(programs, topk, bn, num_sms(dev))


def _split_choices(knobs: HeadsKnobs, batch: int, topk: int, dev: torch.device, quick: bool) -> list[int]:
    """The automatic split first (it assumes 1 CTA per SM), then half, double and 4x of it (2-CTA/SM
    settings), and 1 (no fp32 partials, no combine)."""
    bn, auto = _auto_splits(knobs, batch, topk, dev)
    if quick:
        return [auto]
    top = max(1, cdiv(topk, 2 * bn))
    return list(dict.fromkeys([auto, max(1, auto // 2), min(top, 2 * auto), min(top, 4 * auto), 1]))


def _err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (out.float() - ref.float()).abs().max().item()
    return d, d / max(ref.float().abs().max().item(), 1e-6)


def _markdown(res: dict[str, Any]) -> str:
    c = res["ceilings"]
    lines = [
        f"# Sparse MLA decode launch sweep ({res['env'].get('gpu') or 'cpu'})",
        "",
        f"64 heads, L=512 + R=64, top-{res['topk']}, fp8 656-byte tokens, {res['context']} tokens of random "
        f"64-token pages per request. Kernel-only time in a CUDA graph (L2 flushed). Roofline = max(bytes / "
        f"{c['hbm_copy_Bps'] / 1e12:.2f} TB/s HBM copy, flops / {c['bf16_gemm_flops'] / 1e12:.0f} TFLOP/s "
        f"bf16 GEMM). Best K split per setting; every row checked against the reference (max rel err).",
        "",
    ]
    for b, rows in res["by_batch"].items():
        if not rows:
            continue
        lines += [
            f"## batch {b} (roofline {rows[0]['roofline_us']:.1f} us)",
            "",
            "| setting | splits | graph us | x roofline | vs default | rel err | ok |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['spec_short'] or 'default'} | {r['splits']} | {r['graph_us']:.1f} | "
                f"{r['x_roofline']:.2f} | {r['speedup_vs_default']:.2f}x | {r['rel_err']:.2g} | {r['ok']} |"
            )
        lines.append("")
    for b, w in res["best"].items():
        lines.append(f"batch {b}: LONGCTX_SPARSE_MLA_HEADS={w['env_spec']} ({w['graph_us']:.1f} us)")
    if res["skipped"]:
        lines.append(f"\nskipped (budget): {', '.join(res['skipped'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--context", type=int, default=65536, help="tokens per request (random pages)")
    ap.add_argument("--budget-s", type=float, default=85.0, help="no new setting is started after this")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t_start = time.time()
    dev, rc = sweep_device(args.device, "bench/smla_sweep.py")
    if rc is not None:
        return rc
    cuda = dev.type == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    topk, context = args.topk, args.context
    if not cuda:  # toy sizes: the interpreter runs every program in Python
        batches, topk, context = [1, 3], 64, 256
    settings = [SETTINGS[i] for i in QUICK] if args.quick else SETTINGS
    check_b = sorted(set(batches) | {3})
    pool = _pool(max(check_b) * context, dev, 1 << 16)
    row_bytes = mla_row_bytes(L, R, KIND, torch.bfloat16)
    scale = (192 + 64) ** -0.5
    gen = torch.Generator(device=dev).manual_seed(1)
    all_idx = _indices(max(check_b), context, topk, dev, gen)
    qgen = torch.Generator(device=dev).manual_seed(2)
    ql_all = torch.randn(max(check_b), HEADS, L, device=dev, generator=qgen).to(torch.bfloat16)
    qr_all = torch.randn(max(check_b), HEADS, R, device=dev, generator=qgen).to(torch.bfloat16)
    cases: dict[str, tuple[torch.Tensor, ...]] = {}
    for b in batches:
        idx = all_idx[:b]
        cases[str(b)] = (
            ql_all[:b],
            qr_all[:b],
            idx,
            sparse_mla_ref(ql_all[:b], qr_all[:b], pool, idx, scale, KIND),
        )
    rag = _ragged(all_idx)
    cases["ragged3"] = (
        ql_all[:3],
        qr_all[:3],
        rag,
        sparse_mla_ref(ql_all[:3], qr_all[:3], pool, rag, scale, KIND),
    )
    if cuda:
        from bench.kernels_mla_moe import measure_copy_bw

        hbm, peak = measure_copy_bw(), gemm_flops(torch.bfloat16)
    else:
        hbm, peak = 4.27e12, 774e12  # the H200 figures, for the smoke test's arithmetic only
    print(
        f"HBM copy {hbm / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s; setup {time.time() - t_start:.1f} s"
    )
    timer = sweep_timer(cuda)
    checks: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for knobs in settings:
        spec = knobs.spec()
        if time.time() - t_start > args.budget_s:
            skipped.append(knobs_diff(knobs) or "default")
            continue
        t_cfg = time.time()
        errs = {}
        try:
            for name, (ql, qr, idx, ref) in cases.items():
                out = sparse_mla(ql, qr, pool, idx, scale, KIND, backend="triton", impl="heads", knobs=knobs)
                errs[name] = _err(out, ref)
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile (shared memory) is reported
            print(f"{spec}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            checks.append({"spec": spec, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        ok = all(rel <= TOL for _, rel in errs.values())
        checks.append({"spec": spec, "ok": ok, "max_abs_err": {k: v[0] for k, v in errs.items()},
                       "rel_err": {k: v[1] for k, v in errs.items()}})  # fmt: skip
        for b in batches:
            ql, qr, idx, _ = cases[str(b)]
            auto = _auto_splits(knobs, b, topk, dev)[1]
            for sp in _split_choices(knobs, b, topk, dev, args.quick):
                call = partial(sparse_mla, ql, qr, pool, idx, scale, KIND, backend="triton", impl="heads")
                try:
                    sec = timer(partial(call, knobs=knobs, num_splits=sp))
                except Exception as exc:  # noqa: BLE001 - e.g. a capture failure: reported, the sweep goes on
                    print(
                        f"  {spec} batch {b} splits {sp}: {type(exc).__name__}: {str(exc)[:160]}", flush=True
                    )
                    checks[-1].setdefault("timing_errors", []).append(f"b{b} s{sp}: {type(exc).__name__}")
                    continue
                nbytes = b * topk * (row_bytes + 4) + b * HEADS * (L + R) * 2 + b * HEADS * L * 2
                flops = 2.0 * b * HEADS * topk * (2 * L + R)
                roof = max(nbytes / hbm, flops / peak)
                rows.append({"batch": b, "spec": spec, "spec_short": knobs_diff(knobs), "splits": sp,
                             "env_spec": replace(knobs, splits=0 if sp == auto else sp).spec(),
                             "graph_us": sec * 1e6, "roofline_us": roof * 1e6, "x_roofline": sec / roof,
                             "bytes": nbytes, "flops": flops, "rel_err": errs[str(b)][1], "ok": ok})  # fmt: skip
        mine = [r for r in rows if r["spec"] == spec]
        best = {b: min((r["graph_us"] for r in mine if r["batch"] == b), default=math.nan) for b in batches}
        print(f"{knobs_diff(knobs) or 'default':34s} ok={ok} max rel err {max(e[1] for e in errs.values()):.2g}  "
              + "  ".join(f"b{b} {u:.1f} us" for b, u in best.items())
              + f"  ({time.time() - t_cfg:.1f} s)", flush=True)  # fmt: skip
    default_spec = HeadsKnobs().spec()
    by_batch: dict[str, list[dict[str, Any]]] = {}
    best_of: dict[str, dict[str, Any]] = {}
    for b in batches:
        mine = [r for r in rows if r["batch"] == b]
        auto = _auto_splits(HeadsKnobs(), b, topk, dev)[1]
        dflt = [r["graph_us"] for r in mine if r["spec"] == default_spec and r["splits"] == auto]
        base = dflt[0] if dflt else math.nan
        for r in mine:
            r["speedup_vs_default"] = base / r["graph_us"] if r["graph_us"] > 0 else math.nan
        per_setting: dict[str, dict[str, Any]] = {}
        for r in sorted(mine, key=lambda r: r["graph_us"]):
            per_setting.setdefault(r["spec"], r)
        by_batch[str(b)] = list(per_setting.values())
        good = [r for r in by_batch[str(b)] if r["ok"]]
        if good:
            best_of[str(b)] = good[0]
    res = {
        "env": environment(),
        "topk": topk,
        "context": context,
        "batches": batches,
        "ceilings": {"hbm_copy_Bps": hbm, "bf16_gemm_flops": peak},
        "checks": checks,
        "results": rows,
        "by_batch": by_batch,
        "best": best_of,
        "skipped": skipped,
        "wall_s": time.time() - t_start,
    }
    md = _markdown(res)
    print(md)
    if cuda:  # bench/results and --out
        for p in write_results(
            f"smla-sweep-{torch.cuda.get_device_name().split()[-1].lower()}", res, md, args.out
        ):
            print("wrote", p)
    elif args.out:  # the smoke test writes only where it is told
        write_json_md(args.out, "smla-sweep-cpu", res, md, default=float)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
