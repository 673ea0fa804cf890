"""GPU benchmark of the fused prefill indexer + top-k (`kernels.indexer_topk`) at a 1M-token context.

For chunks of Q queries (H=32, D=128, k=2048, fp8 keys of one 1,048,576-token request) it:
1. checks the fused result against the unfused path (`indexer_logits_paged` + `topk_indices`,
   both Triton) on a subset of queries: index sets must match exactly, except picks whose logits
   lie within fp32 rounding of the k-th value (the two kernels sum in different orders);
2. times one chunk at the end of the context (every query sees ~1M keys) and reports the
   executed TFLOP/s (sample pass + select pass, 2*H*D flops per scored pair) against the bf16
   and fp8 GEMM peaks measured in the same run, plus the useful rate (one pass's flops);
3. times a chunk at several context lengths, fits time = a + b * pairs, and projects a full
   1M-token prefill: the sum over chunks of the causal triangle, per full-indexer layer and for
   the full layers of configs/small-1m.json;
4. times the unfused path on a chunk small enough to materialise, for comparison.

Run: `python -m bench.kernels_indexer_topk [--quick] [--out DIR]`; writes
kernels_indexer_topk.json and .md to DIR (default bench/results). Without CUDA it prints that CUDA
is needed and exits 0. `run_bench(...)` returns the same dict for the lead's driver.

`--sweep` instead times one 8192-query chunk at the end of a 1M context for each of `SWEEP`'s
(block_q, block_k, num_warps, num_stages) launch settings of the fused kernel (~30 s of GPU time)
and prints them fastest first, with the rows whose selection differs from the default's (only
fp32-rounding ties at the boundary may); writes kernels_indexer_topk_sweep.json and .md. The
winner's values go into `_BLOCK_QH` (= block_q x 32 heads), `_BLOCK_K`, `_WARPS`, `_STAGES` of
kernels/indexer_topk.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from longctx.kernels import kv_layout as kvl
from longctx.kernels.indexer import indexer_logits_paged
from longctx.kernels.indexer_topk import indexer_topk_paged
from longctx.kernels.topk import topk_indices

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import gemm_flops, time_cuda, write_json_md  # noqa: E402

CTX = 1 << 20
H, D, K = 32, 128, 2048
SMALL_1M_FULL_LAYERS = 3  # configs/small-1m.json: indexer_types has 3 "full" layers


def _time(fn: Callable[[], Any], reps: int = 3) -> float:
    """Median seconds of `reps` calls after one warm-up (calls here take 10 ms - 1 s)."""
    return time_cuda(fn, iters=reps, warmup=1)


def gemm_peaks(n: int = 8192) -> dict[str, Any]:
    """Measured dense GEMM FLOP/s: bf16 (torch.matmul) and fp8 e4m3 (torch._scaled_mm), n^3."""
    timer = partial(_time, reps=10)
    out: dict[str, Any] = {"bf16_flops": gemm_flops(torch.bfloat16, n, timer=timer)}
    try:
        out["fp8_flops"] = gemm_flops(torch.float8_e4m3fn, n, timer=timer)
    except Exception as e:  # pragma: no cover - depends on the torch build
        out["fp8_error"] = repr(e)
    return out


def make_context(ctx: int = CTX, seed: int = 0) -> dict[str, torch.Tensor]:
    """One request's fp8 index keys over shuffled pages (+ spare pages), and a generator."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = (ctx + kvl.PAGE_SIZE - 1) // kvl.PAGE_SIZE
    num_pages = pages + 8
    perm = torch.randperm(num_pages, device="cuda", generator=g)[:pages]
    page_table = perm.view(1, pages).int()
    pool = kvl.alloc_index_pool(num_pages * kvl.PAGE_SIZE, D, "fp8_e4m3", torch.bfloat16, "cuda")
    step = 1 << 18
    for s in range(0, ctx, step):
        t = torch.arange(s, min(ctx, s + step), device="cuda")
        keys = torch.randn(t.numel(), D, device="cuda", generator=g, dtype=torch.bfloat16)
        slots = page_table[0, t // kvl.PAGE_SIZE].long() * kvl.PAGE_SIZE + t % kvl.PAGE_SIZE
        kvl.write_index_k(pool, slots, keys, "fp8_e4m3")
    return {"pool": pool, "page_table": page_table}


def _chunk(q_count: int, end: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Q queries at positions [end - Q, end) of request 0 (bf16 q, signed fp32 weights)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(q_count, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(q_count, H, device="cuda", generator=g) * (H**-0.5 * D**-0.5)
    q_seq = torch.zeros(q_count, dtype=torch.int32, device="cuda")
    q_pos = torch.arange(end - q_count, end, device="cuda", dtype=torch.int64)
    seq_lens = torch.tensor([end], dtype=torch.int32, device="cuda")
    return q, w, seq_lens, q_seq, q_pos


def _pairs(q_pos: torch.Tensor) -> int:
    return int((q_pos + 1).sum())


def check_subset(ctx: dict[str, torch.Tensor], q_count: int, end: int, n_check: int = 64) -> dict[str, Any]:
    """Fused vs unfused on `n_check` queries spread over a chunk: exact set equality or rounding-only."""
    q, w, seq_lens, q_seq, q_pos = _chunk(q_count, end, seed=1)
    stats: dict[str, Any] = {}
    fused = indexer_topk_paged(
        q, w, ctx["pool"], ctx["page_table"], seq_lens, q_seq, q_pos, "fp8_e4m3", K, max_len=end, stats=stats
    )
    rows = torch.linspace(0, q_count - 1, n_check, device="cuda").long()
    logits = indexer_logits_paged(
        q[rows], w[rows], ctx["pool"], ctx["page_table"], seq_lens, q_seq[rows], q_pos[rows], "fp8_e4m3", end
    )
    unfused = topk_indices(logits, K, q_pos[rows] + 1)
    exact, worst = 0, 0.0
    for r in range(n_check):
        a, b = fused[rows[r]], unfused[r]
        if torch.equal(a, b):
            exact += 1
            continue
        sa, sb = set(a.tolist()), set(b.tolist())
        diff = torch.tensor(sorted(sa ^ sb), device="cuda")
        kth = logits[r].topk(K).values[-1]
        rel = float((logits[r, diff] - kth).abs().max() / logits[r].abs().max().clamp_min(1e-30))
        worst = max(worst, rel)
    return {
        "q": q_count,
        "ctx": end,
        "checked": n_check,
        "exact_rows": exact,
        "worst_boundary_rel": worst,
        "ok": worst <= 1e-4,
        "fallback_queries": stats.get("fallback_queries"),
    }


def time_chunk(
    ctx: dict[str, torch.Tensor], q_count: int, end: int, peaks: dict[str, float]
) -> dict[str, Any]:
    """Seconds per fused call for Q queries ending at `end`, and its FLOP rates."""
    q, w, seq_lens, q_seq, q_pos = _chunk(q_count, end, seed=2)
    stats: dict[str, Any] = {}

    def run() -> torch.Tensor:
        return indexer_topk_paged(
            q,
            w,
            ctx["pool"],
            ctx["page_table"],
            seq_lens,
            q_seq,
            q_pos,
            "fp8_e4m3",
            K,
            max_len=end,
            stats=stats,
        )

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sec = _time(run)
    pairs = _pairs(q_pos)
    sample_pairs = pairs // max(stats.get("S", 1), 1)
    flops_useful = 2 * H * D * pairs
    flops_exec = 2 * H * D * (pairs + sample_pairs)
    return {
        "q": q_count,
        "ctx": end,
        "seconds": sec,
        "pairs": pairs,
        "useful_tflops": flops_useful / sec / 1e12,
        "executed_tflops": flops_exec / sec / 1e12,
        "pct_bf16_peak": 100 * flops_exec / sec / peaks["bf16_flops"],
        "peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
        "fallback_queries": stats.get("fallback_queries"),
        "S": stats.get("S"),
    }


def time_unfused(ctx: dict[str, torch.Tensor], q_count: int, end: int) -> dict[str, Any]:
    """The unfused path (logits [Q, ctx] fp32 + radix top-k) on a chunk small enough to materialise."""
    q, w, seq_lens, q_seq, q_pos = _chunk(q_count, end, seed=3)
    pt, pool = ctx["page_table"], ctx["pool"]
    t_logits = _time(lambda: indexer_logits_paged(q, w, pool, pt, seq_lens, q_seq, q_pos, "fp8_e4m3", end))
    logits = indexer_logits_paged(q, w, pool, pt, seq_lens, q_seq, q_pos, "fp8_e4m3", end)
    t_topk = _time(lambda: topk_indices(logits, K, q_pos + 1))
    pairs = _pairs(q_pos)
    return {
        "q": q_count,
        "ctx": end,
        "logits_s": t_logits,
        "topk_s": t_topk,
        "seconds_per_pair": (t_logits + t_topk) / pairs,
        "logits_tflops": 2 * H * D * pairs / t_logits / 1e12,
    }


def project_prefill(fits: Sequence[dict[str, Any]], q_count: int, ctx: int = CTX) -> dict[str, float]:
    """Least-squares time = a + b * pairs over the timed chunks, summed over a whole causal prefill."""
    xs = torch.tensor([float(f["pairs"]) for f in fits], dtype=torch.float64)
    ys = torch.tensor([f["seconds"] for f in fits], dtype=torch.float64)
    a_mat = torch.stack([torch.ones_like(xs), xs], dim=1)
    a, b = torch.linalg.lstsq(a_mat, ys[:, None]).solution.flatten().tolist()
    total, chunks = 0.0, 0
    for start in range(0, ctx, q_count):
        n = min(q_count, ctx - start)
        total += a + b * (n * start + n * (n + 1) / 2)
        chunks += 1
    return {
        "chunk_q": q_count,
        "chunks": chunks,
        "fixed_s_per_chunk": a,
        "s_per_pair": b,
        "layer_s": total,
        "small_1m_s": total * SMALL_1M_FULL_LAYERS,
    }


def run_bench(quick: bool = False) -> dict[str, Any]:
    """All sections; returns {"peaks", "checks", "chunks", "sweep", "unfused", "projection"}."""
    torch.manual_seed(0)
    peaks = gemm_peaks(4096 if quick else 8192)
    ctx_len = 1 << 17 if quick else CTX
    t0 = time.time()
    ctx = make_context(ctx_len)
    res: dict[str, Any] = {"peaks": peaks, "ctx": ctx_len, "setup_s": time.time() - t0}
    chunk_sizes = (4096,) if quick else (4096, 8192, 16384)
    res["checks"] = [check_subset(ctx, 4096, ctx_len, 16 if quick else 64)]
    res["chunks"] = [time_chunk(ctx, qc, ctx_len, peaks) for qc in chunk_sizes]
    sweep_q = 8192 if not quick else 4096
    ends = [ctx_len // 8, ctx_len // 4, ctx_len // 2, ctx_len]
    res["sweep"] = [time_chunk(ctx, sweep_q, e, peaks) for e in ends]
    res["unfused"] = [time_unfused(ctx, 256 if quick else 1024, ctx_len)]
    res["projection"] = project_prefill(res["sweep"], sweep_q, ctx_len)
    per_pair_unfused = res["unfused"][0]["seconds_per_pair"]
    res["projection"]["unfused_layer_s_estimate"] = per_pair_unfused * ctx_len * (ctx_len + 1) / 2
    res["ok"] = all(c["ok"] for c in res["checks"])
    return res


# (block_q, block_k, num_warps, num_stages); the first is the default. All compile for sm_90a
# without spills (registers 186-234); 4-warp settings under ~250 registers fit 2 programs per SM.
SWEEP = (
    (4, 128, 8, 3),
    (4, 128, 8, 2),
    (4, 128, 8, 4),
    (4, 64, 4, 2),
    (4, 64, 4, 3),
    (4, 64, 4, 4),
    (4, 64, 8, 3),
    (2, 64, 4, 3),
    (2, 128, 8, 3),
    (8, 64, 8, 3),
    (8, 64, 8, 4),
)


def run_sweep(
    q_count: int = 8192, ctx_len: int = CTX, settings: Sequence[tuple[int, ...]] = SWEEP
) -> dict[str, Any]:
    """Times the fused call per launch setting on one chunk ending at `ctx_len`; fastest first."""
    ctx = make_context(ctx_len)
    q, w, seq_lens, q_seq, q_pos = _chunk(q_count, ctx_len, seed=2)
    rows: list[dict[str, Any]] = []
    base: torch.Tensor | None = None
    for bq, bk, nw, ns in settings:
        knobs = dict(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns)

        def run(knobs: dict[str, int] = knobs) -> torch.Tensor:
            pt, pool = ctx["page_table"], ctx["pool"]
            return indexer_topk_paged(
                q, w, pool, pt, seq_lens, q_seq, q_pos, "fp8_e4m3", K, max_len=ctx_len, **knobs
            )

        row: dict[str, Any] = dict(knobs)
        try:
            out = run()
            row["seconds"] = _time(run, reps=2)
            base = out if base is None else base
            row["rows_differing"] = int((out != base).any(1).sum())
        except Exception as e:  # a setting may not fit the SM (registers / shared memory)
            row["error"] = repr(e)[:200]
        rows.append(row)
    pairs = _pairs(q_pos)
    for r in rows:
        if "seconds" in r:
            r["executed_tflops"] = 2 * H * D * pairs * (1 + 1 / 128) / r["seconds"] / 1e12
    rows.sort(key=lambda r: r.get("seconds", float("inf")))
    return {"q": q_count, "ctx": ctx_len, "settings": rows}


def sweep_markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Fused indexer + top-k launch sweep ({res['q']} queries at {res['ctx']} keys, fastest first)",
        "",
        "| block_q | block_k | warps | stages | ms / chunk | executed TFLOP/s | rows != default |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["settings"]:
        head = f"| {r['block_q']} | {r['block_k']} | {r['num_warps']} | {r['num_stages']} |"
        if "seconds" in r:
            lines.append(
                f"{head} {r['seconds'] * 1e3:.1f} | {r['executed_tflops']:.0f} | {r['rows_differing']} |"
            )
        else:
            lines.append(f"{head} failed: {r['error']} | | |")
    return "\n".join(lines) + "\n"


def markdown(res: dict[str, Any]) -> str:
    p = res["peaks"]
    lines = [
        f"# Fused indexer + top-k, prefill (H={H}, D={D}, k={K}, fp8 keys, ctx {res['ctx']})",
        "",
        f"Measured peaks: bf16 GEMM {p['bf16_flops'] / 1e12:.0f} TFLOP/s, "
        f"fp8 GEMM {p.get('fp8_flops', float('nan')) / 1e12:.0f} TFLOP/s.",
        "",
        "| check | Q | ctx | rows checked | exact rows | worst boundary rel | fallback q | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in res["checks"]:
        lines.append(
            f"| fused vs unfused | {c['q']} | {c['ctx']} | {c['checked']} | {c['exact_rows']} | "
            f"{c['worst_boundary_rel']:.2e} | {c['fallback_queries']} | {c['ok']} |"
        )
    lines += [
        "",
        "| Q | ctx (end) | ms / chunk | useful TFLOP/s | executed TFLOP/s | % bf16 peak | extra GiB | S | fallback q |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["chunks"] + res["sweep"]:
        lines.append(
            f"| {r['q']} | {r['ctx']} | {r['seconds'] * 1e3:.1f} | {r['useful_tflops']:.0f} | "
            f"{r['executed_tflops']:.0f} | {r['pct_bf16_peak']:.0f}% | {r['peak_extra_bytes'] / 2**30:.2f} | "
            f"{r['S']} | {r['fallback_queries']} |"
        )
    u = res["unfused"][0]
    pr = res["projection"]
    lines += [
        "",
        f"Unfused at Q={u['q']}, ctx {u['ctx']}: logits {u['logits_s'] * 1e3:.1f} ms "
        f"({u['logits_tflops']:.0f} TFLOP/s) + top-k {u['topk_s'] * 1e3:.1f} ms.",
        "",
        f"Projected full prefill of {res['ctx']} tokens in chunks of {pr['chunk_q']} "
        f"(fit: {pr['fixed_s_per_chunk'] * 1e3:.1f} ms + {pr['s_per_pair'] * 1e12:.2f} ps/pair): "
        f"**{pr['layer_s']:.1f} s per full-indexer layer**, {pr['small_1m_s']:.1f} s for small-1m's "
        f"{SMALL_1M_FULL_LAYERS} full layers (unfused estimate {pr['unfused_layer_s_estimate']:.1f} s per layer, "
        "ignoring that its logits buffer would not fit at these chunk sizes).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="128K context, one chunk size (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="rank launch settings on one 8192 x 1M chunk")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_indexer_topk: CUDA is needed for this benchmark; nothing to do.", file=sys.stderr)
        return 0
    if args.sweep:
        res = run_sweep(ctx_len=1 << 17 if args.quick else CTX)
        md = sweep_markdown(res)
        write_json_md(args.out, "kernels_indexer_topk_sweep", res, md)
        print(md)
        return 0
    res = run_bench(args.quick)
    md = markdown(res)
    write_json_md(args.out, "kernels_indexer_topk", res, md)
    print(md)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
