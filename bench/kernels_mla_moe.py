"""GPU benchmarks of sparse MLA decode, MoE experts and FP8 block GEMMs at GLM-5.3 shapes.

Each bench first checks the Triton kernel against its torch reference on the GPU, then times it with
`triton.testing.do_bench` (which flushes L2 between repetitions) and reports achieved bytes/s and FLOP/s
against the roofline max(bytes / HBM rate, flops / GEMM peak) for ceilings passed in (or measured here:
`measure_copy_bw`, `measure_gemm_peak`). Run: `python bench/kernels_mla_moe.py [--out DIR] [--quick]`;
writes kernels_mla_moe.json and kernels_mla_moe.md to DIR (default bench/results). Needs CUDA.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import capture_graph, copy_rate, gemm_flops, time_fn, write_json_md  # noqa: E402

# GLM-5.3 linear shapes (out N, in K) used on the GPU path with FP8 checkpoints.
GLM53_LINEARS: dict[str, tuple[int, int]] = {
    "q_a_proj": (2048, 6144),
    "q_b_proj": (64 * (192 + 64), 2048),
    "kv_a_proj_with_mqa": (512 + 64, 6144),
    "o_proj": (6144, 64 * 256),
    "shared_gate_up": (2 * 2048, 6144),
    "shared_down": (6144, 2048),
    "dense_gate_up": (2 * 12288, 6144),
    "indexer_wq_b": (32 * 128, 2048),
}
DEVICE = "cuda"  # a module global only so the bench logic can be smoke-tested on CPU with tiny shapes


def _cuda() -> bool:
    return torch.cuda.is_available()


def time_graph(fn: Callable[[], Any], reps: int = 20, flush_bytes: int = 256 << 20) -> float:
    """Device seconds per call with no host launch overhead: `reps` x (L2 flush + fn) captured in one CUDA
    graph, minus the same graph without fn, over reps. Raises if fn cannot be captured (a host sync or a
    pageable host->device copy in the wrapper), which is itself a finding. do_bench's figure includes the
    Python/Triton launch cost whenever that exceeds its 256 MB cache-flush memset; this one never does."""
    buf = torch.empty(flush_bytes // 4, dtype=torch.int32, device=DEVICE)

    def reps_of(with_fn: bool) -> Callable[[], None]:
        def body() -> None:
            for _ in range(reps):
                buf.zero_()
                if with_fn:
                    fn()

        return body

    # fn warmed twice outside the capture (compiles, caches)
    g_fn, g_flush = capture_graph(reps_of(True), warmup=2, warm=fn), capture_graph(reps_of(False), warmup=0)

    def med(g: torch.cuda.CUDAGraph) -> float:
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return sorted(ts)[len(ts) // 2]

    return max(med(g_fn) - med(g_flush), 0.0) / reps


def graph_fields(fn: Callable[[], Any], reps: int = 20) -> dict[str, Any]:
    """{"graph_us": kernel-only microseconds} or {"graph_us": None, "graph_error": why capture failed}."""
    try:
        return {"graph_us": time_graph(fn, reps=reps) * 1e6}
    except Exception as exc:  # noqa: BLE001 - a capture failure is reported, not fatal
        torch.cuda.synchronize()
        return {"graph_us": None, "graph_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def measure_copy_bw(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting read + write (DESIGN.md's 'HBM copy' ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE)
    return copy_rate(src, torch.empty_like(src), both_ways=True, warmup=25, rep=100)


def measure_gemm_peak(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Dense GEMM FLOP/s at n x n x n: bf16 via torch.mm, fp8 (e4m3) via torch._scaled_mm (per-tensor scales)."""
    return gemm_flops(dtype, n, device=DEVICE)


def _roofline(
    nbytes: float, flops: float, secs: float, hbm_bps: float, peak_flops: float
) -> dict[str, float]:
    roof = max(nbytes / hbm_bps, flops / peak_flops)
    return {
        "time_us": secs * 1e6,
        "bytes": nbytes,
        "flops": flops,
        "achieved_GBps": nbytes / secs / 1e9,
        "achieved_TFLOPs": flops / secs / 1e12,
        "roofline_us": roof * 1e6,
        "x_roofline": secs / roof,
    }


def _record(
    results: list[dict[str, Any]],
    res: dict[str, Any],
    roof: dict[str, float],
    graph: dict[str, Any],
    **extra: Any,
) -> None:
    """Appends res + roofline + graph time (+ extra) and its graph/roofline ratio to results; prints it."""
    res |= roof
    res |= graph
    res |= extra
    if graph["graph_us"]:
        res["graph_x_roofline"] = graph["graph_us"] / res["roofline_us"]
    results.append(res)
    print(_line(res))


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def _ceilings(hbm_bps: float | None, peak_flops: float | None, dtype: torch.dtype) -> tuple[float, float]:
    return hbm_bps or measure_copy_bw(), peak_flops or measure_gemm_peak(dtype)


def _call_mla(fn: Callable[..., Any], *args: Any) -> Any:
    *tensors, cfg = args
    return fn(*tensors, backend="triton", **cfg)


def _call_moe(fn: Callable[..., Any], *args: Any) -> Any:
    x, ids, w, w_gu, w_d, s_gu, s_d, tiles = args
    return fn(x, ids, w, w_gu, w_d, "silu", s_gu, s_d, backend="triton", tiles=tiles)


def _best(run: Callable[[Any], Any], configs: Iterable[Any]) -> tuple[Any, float, dict[str, float]]:
    """Time run(config) for every config (skipping ones that fail to compile); returns
    (best config, its seconds, {str(config): seconds})."""
    times: dict[str, float] = {}
    best, best_t = None, math.inf
    for cfg in configs:
        try:
            t = time_fn(partial(run, cfg))
        except Exception as exc:  # an over-sized tile (out of shared memory) is just skipped
            print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            continue
        times[str(cfg)] = t
        if t < best_t:
            best, best_t = cfg, t
    return best, best_t, times


# ---------------------------------------------------------------------------------------------- MLA
# impl="heads" tiles always timed (a handful: BLOCK_N x warps around the default), the full grid with sweep.
_HEADS_MINI: list[dict[str, Any]] = [
    {"impl": "heads", **c}
    for c in ({}, {"block_n": 64}, {"block_n": 16}, {"num_stages": 3}, {"num_stages": 1})
]
_HEADS_FULL: list[dict[str, Any]] = [
    {"impl": "heads", "block_n": bn, "num_warps": w, "num_stages": st}
    for bn in (16, 32, 64)
    for w in (8, 16)  # 4 warps would need 256 accumulator registers per thread
    for st in (1, 2, 3)
]


def _split_configs(sweep: bool, prefill: bool) -> list[dict[str, Any]]:
    if prefill:  # ~80 ms a call at 8192 queries: the caller's form only
        return [{"num_splits": 1}]
    configs: list[dict[str, Any]] = [{}]
    if sweep:
        configs += [
            {"block_h": bh, "block_n": bn, "num_warps": w, "num_stages": st}
            for bh in (16, 32, 64)
            for bn in (32, 64)
            for w in (4, 8)
            for st in (1, 2)
            if not (bh == 64 and bn == 64)
        ]
        configs += [{"num_splits": sp} for sp in (1, 2, 4, 8, 16, 32, 64)]
        configs += [{"block_h": bh, "num_splits": sp} for bh in (32, 64) for sp in (8, 16, 32, 64)]
        configs += [{"scale_gather": True}]
    return configs


def _heads_configs(sweep: bool, prefill: bool) -> list[dict[str, Any]]:
    configs = [dict(c) for c in (_HEADS_FULL if sweep else _HEADS_MINI)]
    if prefill:
        return [c | {"num_splits": 1} for c in configs]
    if sweep:
        configs += [{"impl": "heads", "num_splits": sp} for sp in (1, 2, 4, 8, 16, 32)]
    return configs


def _mla_impl(
    call: Callable[[dict[str, Any]], Any],
    ref: torch.Tensor,
    rows: int,
    configs: list[dict[str, Any]],
    graph_reps: int,
) -> dict[str, Any]:
    """Error (on the first `rows` queries) of the first config, best config by do_bench, its graph time."""
    err = _err(call(configs[0])[:rows], ref)
    best, t, times = _best(call, configs)
    graph = graph_fields(partial(call, best if best is not None else configs[0]), reps=graph_reps)
    return {
        "rel_err": err,
        "ok": err < 2e-2,
        "config": best,
        "time_us": t * 1e6,
        "default_us": times.get(str(configs[0]), math.nan) * 1e6,
        "sweep_us": {c: v * 1e6 for c, v in times.items()},
    } | graph


def bench_sparse_mla_decode(
    batches: Iterable[int] = (1, 8, 64),
    topk: int = 2048,
    heads: int = 64,
    L: int = 512,
    R: int = 64,
    kind: str = "fp8_e4m3",
    pool_tokens: int = 1 << 20,
    hbm_bps: float | None = None,
    peak_flops: float | None = None,
    sweep: bool = True,
    prefill_queries: Iterable[int] = (8192,),
    prefill_window: int = 1 << 15,
) -> list[dict[str, Any]]:
    """Decode: `batch` queries x `heads` heads, each over its own top-k rows of a `pool_tokens` pool; then a
    prefill chunk of `prefill_queries` queries (bench "sparse_mla_prefill", num_splits=1 as the model runs it).

    Both implementations are timed on every shape: the row's main fields are the default impl="split"
    (comparable with earlier runs); row["impl_heads"] holds impl="heads" (same fields: rel_err, config,
    time_us, graph_us, sweep_us, achieved_TFLOPs) and row["impl_graph_us"] / row["heads_speedup"] compare
    the two kernel-only (CUDA graph) times. Prefill checks the first 64 queries against the reference."""
    from longctx.kernels.kv_layout import alloc_mla_pool, mla_row_bytes, write_mla_kv
    from longctx.kernels.sparse_mla import sparse_mla, sparse_mla_ref

    hbm_bps, peak_flops = _ceilings(hbm_bps, peak_flops, torch.bfloat16)
    dev = torch.device(DEVICE)
    pool = alloc_mla_pool(pool_tokens, L, R, kind, torch.bfloat16, dev)
    for s0 in range(0, pool_tokens, 1 << 16):
        n = min(1 << 16, pool_tokens - s0)
        slots = torch.arange(s0, s0 + n, device=dev)
        write_mla_kv(pool, slots, torch.randn(n, L, device=dev), torch.randn(n, R, device=dev), kind)
    row_bytes = mla_row_bytes(L, R, kind, torch.bfloat16)
    scale = (192 + 64) ** -0.5
    results: list[dict[str, Any]] = []
    shapes = [(b, False) for b in batches] + [(q, True) for q in prefill_queries]
    for b, prefill in shapes:
        ql = torch.randn(b, heads, L, device=dev, dtype=torch.bfloat16)
        qr = torch.randn(b, heads, R, device=dev, dtype=torch.bfloat16)
        if prefill:
            # A chunk's queries select from one shared window (2**15 rows, ~21 MB: mostly L2 hits, as the
            # top-k of neighbouring queries overlap), so this row times the compute side of the kernel.
            lo = max(0, pool_tokens - prefill_window)
            idx = torch.randint(lo, pool_tokens, (b, topk), device=dev, dtype=torch.int32)
        else:
            idx = torch.randint(0, pool_tokens, (b, topk), device=dev, dtype=torch.int32)
        rows = min(b, 64)
        ref = sparse_mla_ref(ql[:rows], qr[:rows], pool, idx[:rows], scale, kind)
        call = partial(_call_mla, sparse_mla, ql, qr, pool, idx, scale, kind)
        reps = 3 if prefill else 20
        split = _mla_impl(call, ref, rows, _split_configs(sweep, prefill), reps)
        try:  # the opt-in kernel failing (compile, shared memory) must not lose the default's numbers
            head = _mla_impl(call, ref, rows, _heads_configs(sweep, prefill), reps)
        except Exception as exc:  # noqa: BLE001
            head = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}", "time_us": math.nan}
            head["graph_us"] = None
        nbytes = b * topk * (row_bytes + 4) + b * heads * (L + R) * 2 + b * heads * L * 2
        flops = 2.0 * b * heads * topk * (2 * L + R)
        bench = "sparse_mla_prefill" if prefill else "sparse_mla_decode"
        res = {"bench": bench, "batch": b, "topk": topk, "heads": heads, "L": L, "R": R, "kind": kind}
        res |= {k: split[k] for k in ("rel_err", "ok", "config", "default_us", "sweep_us")}
        head["achieved_TFLOPs"] = flops / head["time_us"] / 1e6
        if head["graph_us"]:
            head["graph_TFLOPs"] = flops / head["graph_us"] / 1e6
        ig = {"split": split["graph_us"], "heads": head["graph_us"]}
        extra: dict[str, Any] = {"impl_heads": head, "impl_graph_us": ig}
        if ig["split"] and ig["heads"]:
            extra["heads_speedup"] = ig["split"] / ig["heads"]
        graph = {k: split[k] for k in ("graph_us", "graph_error") if k in split}
        roof = _roofline(nbytes, flops, split["time_us"] / 1e6, hbm_bps, peak_flops)
        _record(results, res, roof, graph, **extra)
        print(
            f"  impl=heads config={head['config']} time_us={head['time_us']:.4g} graph_us={head['graph_us']}"
        )
    return results


# ---------------------------------------------------------------------------------------------- MoE
def _moe_weights(
    experts: int, hidden: int, inter: int, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Random expert weights with scales ~ 1/sqrt(K), made on the device expert by expert (fp32
    temporaries stay small): (w_gate_up, w_down, their block scales or None)."""
    from longctx.kernels.fp8_gemm import cdiv

    dev = torch.device(DEVICE)
    wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    w_gu = torch.empty(experts, 2 * inter, hidden, dtype=wdt, device=dev)
    w_d = torch.empty(experts, hidden, inter, dtype=wdt, device=dev)
    for e in range(experts):
        w_gu[e] = torch.randn(2 * inter, hidden, device=dev).clamp(-8, 8).to(wdt)
        w_d[e] = torch.randn(hidden, inter, device=dev).clamp(-8, 8).to(wdt)
    s_gu = s_d = None
    if fp8:
        s_gu = torch.full((experts, cdiv(2 * inter, 128), cdiv(hidden, 128)), hidden**-0.5, device=dev)
        s_d = torch.full((experts, cdiv(hidden, 128), cdiv(inter, 128)), inter**-0.5, device=dev)
    return w_gu, w_d, s_gu, s_d


def _moe_inputs(b: int, hidden: int, experts: int, topk: int) -> tuple[torch.Tensor, ...]:
    """x [b, hidden] bf16, uniform random distinct experts per token [b, topk], weights [b, topk]."""
    x = torch.randn(b, hidden, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.rand(b, experts, device=DEVICE).topk(topk, dim=-1).indices
    return x, ids, torch.rand(b, topk, device=DEVICE)


def bench_moe(
    batches: Iterable[int] = (1, 8, 64),
    hidden: int = 6144,
    experts: int = 256,
    topk: int = 8,
    inter: int = 2048,
    fp8: bool = True,
    hbm_bps: float | None = None,
    peak_flops: float | None = None,
    sweep: bool = True,
) -> list[dict[str, Any]]:
    """Routed experts at GLM-5.3 shapes (fp8 128x128 block weights by default), uniform random routing."""
    from longctx.kernels.moe import moe_experts, moe_experts_ref

    hbm_bps, peak_flops = _ceilings(hbm_bps, peak_flops, torch.bfloat16)
    w_gu, w_d, s_gu, s_d = _moe_weights(experts, hidden, inter, fp8)
    per_expert_bytes = 3 * inter * hidden * w_gu.element_size()
    results: list[dict[str, Any]] = []
    for b in batches:
        x, ids, w = _moe_inputs(b, hidden, experts, topk)
        y = moe_experts(x, ids, w, w_gu, w_d, "silu", s_gu, s_d, backend="triton")
        err = _err(y, moe_experts_ref(x, ids, w, w_gu, w_d, "silu", s_gu, s_d))
        configs: list[Any] = [None]
        if sweep:
            configs += [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 32, 128, 4, 5), (32, 64, 128, 4, 4)]
            configs += [(16, 32, 128, 4, 3), (16, 16, 128, 4, 5), (16, 32, 128, 8, 5), (16, 64, 128, 4, 6)]
            configs += [(64, 128, 64, 4, 3), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3)]
        best, t, times = _best(partial(_call_moe, moe_experts, x, ids, w, w_gu, w_d, s_gu, s_d), configs)
        graph = graph_fields(partial(_call_moe, moe_experts, x, ids, w, w_gu, w_d, s_gu, s_d, best))
        hit = int(torch.unique(ids).numel())
        p = b * topk
        nbytes = hit * per_expert_bytes + b * hidden * 2 * 2 + p * inter * 2 * 2 + p * hidden * 2 * 2
        flops = 2.0 * p * 3 * inter * hidden
        res = {"bench": "moe", "batch": b, "hidden": hidden, "experts": experts, "topk": topk, "inter": inter}
        res |= {"fp8": fp8, "experts_hit": hit, "rel_err": err, "ok": err < 3e-2, "config": best}
        res |= {"default_us": times.get("None", math.nan) * 1e6}
        res |= {"sweep_us": {c: v * 1e6 for c, v in times.items()}}
        _record(results, res, _roofline(nbytes, flops, t, hbm_bps, peak_flops), graph)
    return results


def _decode_configs(sweep: bool) -> list[tuple[str, Any]]:
    """(path, config) pairs: the decode path's default and, with `sweep`, each knob moved alone around it;
    the grouped GEMMs' default tiles (and two of their old sweep's decode tiles)."""
    from longctx.kernels.moe_decode import DEFAULT

    configs: list[tuple[str, Any]] = [("decode", DEFAULT), ("grouped", None)]
    if sweep:
        knobs: list[dict[str, Any]] = [
            {"bn_gate_up": 16}, {"bn_gate_up": 32}, {"bn_gate_up": 32, "stages_gate_up": 3},
            {"warps_gate_up": 8}, {"stages_gate_up": 3}, {"stages_gate_up": 5},
            {"bn_down": 32}, {"bn_down": 128}, {"warps_down": 8}, {"stages_down": 3}, {"stages_down": 5},
            {"splits_down": 1}, {"splits_down": 2}, {"splits_down": 4}, {"splits_down": 8}, {"bk": 64},
        ]  # fmt: skip
        configs += [("decode", replace(DEFAULT, **kw)) for kw in knobs]
        configs += [("grouped", (16, 64, 128, 4, 4)), ("grouped", (16, 32, 128, 4, 3))]
    return configs


def _config_name(path: str, cfg: Any) -> str:
    """'decode' plus the knobs that differ from moe_decode.DEFAULT, or 'grouped' plus its tiles."""
    if path == "grouped":
        return f"grouped tiles={cfg or 'default'}"
    from longctx.kernels.moe_decode import DEFAULT

    diff = [f"{k}={v}" for k, v in vars(cfg).items() if getattr(DEFAULT, k) != v]
    return "decode " + (" ".join(diff) or "default")


def kernel_us(fn: Callable[[], Any], iters: int = 5, flush_bytes: int = 256 << 20) -> dict[str, float]:
    """Mean device microseconds per call of each kernel `fn` launches, by kernel name (torch.profiler;
    L2 flushed before each call, the flush's own kernel left out)."""
    from torch.profiler import ProfilerActivity, profile

    buf = torch.empty(flush_bytes // 4, dtype=torch.int32, device=DEVICE)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            buf.zero_()
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        name = ev.key
        if "Fill" in name or "Memset" in name or "fill" in name:
            continue
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us:
            out[name[:60]] = us / iters
    return out


def bench_moe_decode(
    batches: Iterable[int] = (1, 8),
    hidden: int = 6144,
    experts: int = 256,
    topk: int = 8,
    inter: int = 2048,
    fp8: bool = True,
    hbm_bps: float | None = None,
    sweep: bool = True,
    reps: int = 10,
) -> list[dict[str, Any]]:
    """The MoE decode path (kernels/moe_decode.py, its knobs swept one at a time) against the grouped
    GEMMs (`moe_experts(decode=False)`) at GLM-5.3 shapes: kernel-only time in a CUDA graph (L2 flushed
    between calls) against the roofline of the hit experts' weight bytes at the HBM rate. Every
    config is checked against `moe_experts_ref` first."""
    from longctx.kernels.moe import moe_experts, moe_experts_ref
    from longctx.kernels.moe_decode import DEFAULT

    hbm_bps = hbm_bps or measure_copy_bw()
    w_gu, w_d, s_gu, s_d = _moe_weights(experts, hidden, inter, fp8)
    per_expert_bytes = 3 * inter * hidden * w_gu.element_size()
    results: list[dict[str, Any]] = []
    for b in batches:
        x, ids, w = _moe_inputs(b, hidden, experts, topk)
        ref = moe_experts_ref(x, ids, w, w_gu, w_d, "silu", s_gu, s_d)
        hit = int(torch.unique(ids).numel())
        roof_us = hit * per_expert_bytes / hbm_bps * 1e6
        for path, cfg in _decode_configs(sweep):
            call = partial(
                moe_experts, x, ids, w, w_gu, w_d, "silu", s_gu, s_d, backend="triton",
                decode=cfg if path == "decode" else False, tiles=cfg if path == "grouped" else None,
            )  # fmt: skip
            res: dict[str, Any] = {"bench": "moe_decode", "batch": b, "path": path, "experts_hit": hit}
            res |= {"config": _config_name(path, cfg), "knobs": vars(cfg) if path == "decode" else cfg}
            res["roofline_us"] = roof_us
            try:
                err = _err(call(), ref)
                res |= {"rel_err": err, "ok": err < 3e-2} | graph_fields(call, reps=reps)
                if cfg is None or (path == "decode" and cfg == DEFAULT):  # where the time goes
                    res["kernels_us"] = kernel_us(call)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
                torch.cuda.synchronize()
                res |= {"ok": False, "graph_us": None, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            if res["graph_us"]:
                res["fraction_of_hbm"] = roof_us / res["graph_us"]
            results.append(res)
            print(_decode_line(res), flush=True)
    return results


def _decode_line(r: dict[str, Any]) -> str:
    us, frac = r.get("graph_us"), r.get("fraction_of_hbm")
    t = f"{us:8.1f} us  {frac:5.3f} of HBM" if us else f"  failed: {r.get('error') or r.get('graph_error')}"
    line = f"batch {r['batch']:>2}  {t}  err {r.get('rel_err', math.nan):.2g}  {r['config']}"
    if r.get("kernels_us"):
        line += "\n    kernels (profiler, us per call): " + ", ".join(
            f"{k} {v:.1f}" for k, v in r["kernels_us"].items()
        )
    return line


def _decode_markdown(results: list[dict[str, Any]], hbm_bps: float) -> str:
    lines = [
        "# MoE decode path vs grouped GEMMs (GLM-5.3 experts, fp8, top-8 of 256)",
        "",
        f"Kernel-only time in a CUDA graph, L2 flushed between calls; roofline = hit experts' weight bytes "
        f"at the measured HBM copy rate {hbm_bps / 1e12:.3g} TB/s.",
        "",
        "| batch | config | graph us | roofline us | fraction of HBM | rel err | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["batch"], r.get("graph_us") or math.inf)):
        us, frac = r.get("graph_us"), r.get("fraction_of_hbm")
        lines.append(
            f"| {r['batch']} | {r['config']} | {us and f'{us:.1f}'} | {r['roofline_us']:.1f} | "
            f"{frac and f'{frac:.3f}'} | {r.get('rel_err', math.nan):.2g} | {r['ok']} |"
        )
    lines += ["", "Kernels of the defaults (torch.profiler, us per call, L2 flushed):", ""]
    lines += [
        f"- batch {r['batch']}, {r['config']}: {r['kernels_us']}" for r in results if r.get("kernels_us")
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- FP8 GEMM
def bench_fp8_gemm(
    shapes: dict[str, tuple[int, int]] | None = None,
    batches: Iterable[int] = (1, 8, 64, 4096),
    quantize_act: Iterable[bool] = (False, True),
    hbm_bps: float | None = None,
    bf16_flops: float | None = None,
    fp8_flops: float | None = None,
) -> list[dict[str, Any]]:
    """fp8_block_linear at GLM-5.3 linear shapes; also times torch bf16 matmul on the dequantised weight."""
    from longctx.kernels.fp8_gemm import dequant_block_fp8_ref, fp8_block_linear, fp8_block_linear_ref

    hbm_bps = hbm_bps or measure_copy_bw()
    bf16_flops = bf16_flops or measure_gemm_peak(torch.bfloat16)
    fp8_flops = fp8_flops or measure_gemm_peak(torch.float8_e4m3fn)
    dev = torch.device(DEVICE)
    results: list[dict[str, Any]] = []
    for name, (n, k) in (shapes or GLM53_LINEARS).items():
        w = torch.randn(n, k, device=dev).clamp(-8, 8).to(torch.float8_e4m3fn)
        s = torch.full((-(-n // 128), -(-k // 128)), k**-0.5, device=dev)
        w_bf16 = dequant_block_fp8_ref(w, s).to(torch.bfloat16)
        for t in batches:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            t_torch = time_fn(lambda: x @ w_bf16.T)  # noqa: B023
            for qa in quantize_act:
                err = _err(
                    fp8_block_linear(x, w, s, quantize_act=qa, backend="triton"),
                    fp8_block_linear_ref(x, w, s, quantize_act=qa),
                )
                call = partial(fp8_block_linear, x, w, s, quantize_act=qa, backend="triton")
                secs = time_fn(call)
                graph = graph_fields(call)
                graph_torch = graph_fields(lambda: x @ w_bf16.T)  # noqa: B023
                nbytes = n * k + s.numel() * 4 + t * k * 2 + t * n * 2
                flops = 2.0 * t * n * k
                res = {"bench": "fp8_gemm", "layer": name, "T": t, "N": n, "K": k, "quantize_act": qa}
                res |= {"rel_err": err, "ok": err < 2e-2, "torch_bf16_dequant_us": t_torch * 1e6}
                roof = _roofline(nbytes, flops, secs, hbm_bps, fp8_flops if qa else bf16_flops)
                _record(results, res, roof, graph, torch_bf16_dequant_graph_us=graph_torch["graph_us"])
    return results


# --------------------------------------------------------------------------------------------- main
_COLS = ("time_us", "roofline_us", "x_roofline", "achieved_GBps", "achieved_TFLOPs", "rel_err")


def _line(res: dict[str, Any]) -> str:
    keys = [k for k in ("bench", "layer", "batch", "T", "quantize_act", "config") if k in res]
    head = " ".join(f"{k}={res[k]}" for k in keys)
    return head + " | " + " ".join(f"{c}={res[c]:.4g}" for c in _COLS)


def _markdown(results: list[dict[str, Any]], ceilings: dict[str, float]) -> str:
    lines = [
        "# kernels_mla_moe",
        "",
        "Ceilings measured in the same run: " + ", ".join(f"{k}={v:.4g}" for k, v in ceilings.items()),
        "",
    ]
    lines += ["| bench | case | " + " | ".join(_COLS) + " | ok |", "|" + "---|" * (len(_COLS) + 3)]
    for r in results:
        case = ", ".join(f"{k}={r[k]}" for k in ("layer", "batch", "T", "quantize_act", "config") if k in r)
        lines.append(
            f"| {r['bench']} | {case} | " + " | ".join(f"{r[c]:.4g}" for c in _COLS) + f" | {r['ok']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--quick", action="store_true", help="no tile sweeps, fewer GEMM shapes")
    ap.add_argument(
        "--hbm-bps", type=float, default=None, help="HBM copy ceiling (bytes/s); measured if absent"
    )
    ap.add_argument("--bf16-flops", type=float, default=None)
    ap.add_argument("--fp8-flops", type=float, default=None)
    ap.add_argument(
        "--moe-decode",
        action="store_true",
        help="only the MoE decode sweep (bench_moe_decode, batch 1 and 8): moe_decode.json/.md in --out",
    )
    args = ap.parse_args(argv)
    if not _cuda():
        print("kernels_mla_moe: CUDA is needed for these benchmarks (the CPU tests cover correctness).")
        return 0
    t0 = time.time()
    if args.moe_decode:
        hbm = args.hbm_bps or measure_copy_bw()
        print(f"HBM copy rate {hbm / 1e12:.3g} TB/s")
        rows = bench_moe_decode(hbm_bps=hbm, sweep=not args.quick)
        md = _decode_markdown(rows, hbm)
        print(md)
        payload = {"device": torch.cuda.get_device_name(), "hbm_copy_Bps": hbm, "results": rows}
        write_json_md(args.out, "moe_decode", payload | {"wall_s": time.time() - t0}, md, default=str)
        print(f"wrote {args.out / 'moe_decode.json'} and .md ({time.time() - t0:.0f} s)")
        return 0
    ceil = {
        "hbm_copy_Bps": args.hbm_bps or measure_copy_bw(),
        "bf16_gemm_flops": args.bf16_flops or measure_gemm_peak(torch.bfloat16),
        "fp8_gemm_flops": args.fp8_flops or measure_gemm_peak(torch.float8_e4m3fn),
    }
    print("ceilings:", {k: f"{v:.4g}" for k, v in ceil.items()})
    hbm, bf16, fp8 = ceil["hbm_copy_Bps"], ceil["bf16_gemm_flops"], ceil["fp8_gemm_flops"]
    results = bench_sparse_mla_decode(hbm_bps=hbm, peak_flops=bf16, sweep=not args.quick)
    results += bench_moe(hbm_bps=hbm, peak_flops=bf16, sweep=not args.quick)
    shapes = {k: GLM53_LINEARS[k] for k in ("q_a_proj", "o_proj")} if args.quick else None
    results += bench_fp8_gemm(shapes=shapes, hbm_bps=hbm, bf16_flops=bf16, fp8_flops=fp8)
    payload = {
        "device": torch.cuda.get_device_name(),
        "ceilings": ceil,
        "results": results,
        "wall_s": time.time() - t0,
    }
    write_json_md(args.out, "kernels_mla_moe", payload, _markdown(results, ceil), default=str)
    print(f"wrote {args.out / 'kernels_mla_moe.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
