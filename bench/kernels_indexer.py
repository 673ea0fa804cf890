"""GPU benchmarks of the indexer path: indexer logits over paged keys, top-k, KV writes, swap-in.

Each bench first checks the Triton kernel against its torch reference on the GPU, then times it
with `triton.testing.do_bench` (median, L2 flushed between calls) and reports the achieved rate
against a ceiling measured in the same run by `measure_ceilings()`:
- indexer logits, KV writes: HBM device-to-device copy rate (read + write bytes counted);
- swap-in: one bulk pinned host-to-device copy of the same bytes;
- top-k: the DESIGN.md target of 100 us for top-2048 of 1M (and torch.topk as a baseline).

Run: `python -m bench.kernels_indexer [--quick] [--out DIR]`; writes kernels_indexer.json and
kernels_indexer.md to DIR (default bench/results). Without CUDA it prints that CUDA is needed
and exits 0. The lead's bench/kernels.py imports the bench_* functions and measure_ceilings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from longctx.kernels import kv_layout as kvl
from longctx.kernels.indexer import indexer_logits_paged, indexer_logits_paged_ref
from longctx.kernels.swap import swap_in_gather, swap_in_gather_ref
from longctx.kernels.topk import topk_indices, topk_indices_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.common import time_fn  # noqa: E402
from bench.kernels_mla_moe import graph_fields as _graph_fields  # noqa: E402

TOPK_TARGET_S = 100e-6  # DESIGN.md: top-2048 of 1M in <= 100 us


def measure_ceilings(hbm_bytes: int = 2 << 30, h2d_bytes: int = 1 << 30) -> dict[str, float]:
    """{"hbm_copy_Bps": d2d copy rate counting read + write, "pinned_h2d_Bps": one bulk pinned H2D copy}."""
    return common.measure_ceilings(hbm_bytes, h2d_bytes, gemm=False, copy_warmup=5, copy_rep=50)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    if not fin.any():
        return 0.0
    return float((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-30))


def _paged_index_pool(ctx: int, batch: int, dim: int, kind: str, dtype: torch.dtype, gen: torch.Generator):
    """`batch` requests of `ctx` keys each, pages scattered at random over the pool."""
    pages_per = (ctx + kvl.PAGE_SIZE - 1) // kvl.PAGE_SIZE
    num_pages = batch * pages_per
    page_table = torch.randperm(num_pages, device="cuda", generator=gen).view(batch, pages_per).int()
    pool = kvl.alloc_index_pool(num_pages * kvl.PAGE_SIZE, dim, kind, dtype, "cuda")
    step = 1 << 20
    for s in range(0, pool.shape[0], step):  # fill in slices to bound the fp32 temporaries
        n = min(step, pool.shape[0] - s)
        k = torch.randn(n, dim, device="cuda", generator=gen, dtype=torch.float32)
        kvl.write_index_k(pool, torch.arange(s, s + n, device="cuda"), k, kind, backend="triton")
    return pool, page_table


def bench_indexer_decode(
    ctx_lens: Sequence[int] = (65536, 1 << 20),
    batches: Sequence[int] = (1, 8),
    kind: str = "fp8_e4m3",
    heads: int = 32,
    dim: int = 128,
    ceilings: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Decode (one query per request at the last position) indexer logits over paged keys."""
    ceilings = ceilings or measure_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for ctx in ctx_lens:
        for batch in batches:
            pool, pt = _paged_index_pool(ctx, batch, dim, kind, torch.bfloat16, gen)
            q = torch.randn(batch, heads, dim, device="cuda", generator=gen).bfloat16()
            w = torch.rand(batch, heads, device="cuda", generator=gen) * (heads * dim) ** -0.5
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
            q_pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
            args = (q, w, pool, pt, seq_lens, q_seq, q_pos, kind, ctx)
            err = _rel_err(indexer_logits_paged(*args, backend="triton"), indexer_logits_paged_ref(*args))
            t = time_fn(partial(indexer_logits_paged, *args, backend="triton"))
            graph = _graph_fields(partial(indexer_logits_paged, *args, backend="triton"))
            if (
                batch in (1, 8) and ctx >= 1 << 20
            ):  # knob sweep on the headline cases, kernel-only (graph) times
                graph["sweep_graph_us"] = _decode_sweep(args, batch)
            nbytes = (
                batch * ctx * (pool.shape[1] * pool.element_size() + 4 + 4 / kvl.PAGE_SIZE)
            )  # keys + logits + page ids
            rate = nbytes / t
            out.append({
                "bench": "indexer_decode", "kind": kind, "ctx": ctx, "batch": batch, "heads": heads, "dim": dim,
                "time_s": t, "bytes": nbytes, "rate_Bps": rate, "ceiling": "hbm_copy_Bps",
                "ceiling_Bps": ceilings["hbm_copy_Bps"], "frac_of_ceiling": rate / ceilings["hbm_copy_Bps"],
                "max_rel_err": err, "ok": err <= 1e-4, **graph,
                "graph_frac_of_ceiling": nbytes / (graph["graph_us"] * 1e-6) / ceilings["hbm_copy_Bps"]
                if graph["graph_us"] else None,
            })  # fmt: skip
            del pool, pt
            torch.cuda.empty_cache()
    return out


def _decode_sweep(args: tuple, batch: int) -> dict[str, float | None]:
    """Graph times of the decode kernel's knobs (tile, warps, pipeline stages, programs per SM)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    knobs: list[dict[str, int]] = [
        {"block_n": bn, "num_warps": nw, "num_stages": ns}
        for bn in (64, 128, 256)
        for nw in (4, 8)
        for ns in (2, 3, 4)
    ]
    knobs += [{"splits": -(-p * sms // batch)} for p in (1, 2, 4, 6, 8, 16)]
    return {
        ",".join(f"{k}={v}" for k, v in kn.items()): _graph_fields(
            partial(indexer_logits_paged, *args, backend="triton", **kn)
        )["graph_us"]
        for kn in knobs
    }


def bench_topk(
    ns: Sequence[int] = (65536, 1 << 20), k: int = 2048, batches: Sequence[int] = (1, 8)
) -> list[dict[str, Any]]:
    """Top-k of fp32 logits per query vs the 100 us target; torch.topk timed as a baseline."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for n in ns:
        for batch in batches:
            x = torch.randn(batch, n, device="cuda", generator=gen)
            valid = torch.full((batch,), n, dtype=torch.int32, device="cuda")
            exact = torch.equal(topk_indices(x, k, valid, backend="triton"), topk_indices_ref(x, k, valid))
            t = time_fn(partial(topk_indices, x, k, valid, backend="triton"))
            t_torch = time_fn(partial(torch.topk, x, k, dim=1, sorted=False))
            graph = _graph_fields(partial(topk_indices, x, k, valid, backend="triton"))
            graph["torch_topk_graph_us"] = _graph_fields(partial(torch.topk, x, k, dim=1, sorted=False))[
                "graph_us"
            ]
            out.append({
                "bench": "topk", "n": n, "k": k, "batch": batch, "time_s": t, "rate_Bps": batch * n * 4 / t,
                "ceiling": "target_100us_per_1M_query", "target_s": TOPK_TARGET_S * batch * n / (1 << 20),
                "torch_topk_s": t_torch, "ok": exact, **graph,
            })  # fmt: skip
    return out


def bench_swap_in(
    n_items: Sequence[int] = (2048,),
    rows_per_item: Sequence[int] = (1, 64),
    row_bytes: int = 656,
    host_items: int = 8192,
    ceilings: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Scattered rows / pages from pinned and from cudaHostRegister'ed host memory into device slots."""
    ceilings = ceilings or measure_ceilings()
    out = []
    for rpi in rows_per_item:
        host_rows = host_items * rpi
        for mode in ("pinned", "registered"):
            if mode == "pinned":
                host = torch.empty(host_rows, row_bytes, dtype=torch.uint8, pin_memory=True)
            else:  # what the host pool does with its /dev/shm mapping
                host = torch.empty(host_rows, row_bytes, dtype=torch.uint8)
                rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
                assert int(rc) == 0, f"cudaHostRegister failed: {rc}"
            host.random_(0, 256)
            for n in n_items:
                n = min(n, host_items)
                src = torch.randperm(host_items)[:n].cuda() * rpi
                dst = torch.randperm(n).cuda() * rpi
                dev_a = torch.zeros(n * rpi, row_bytes, dtype=torch.uint8, device="cuda")
                dev_b = torch.zeros_like(dev_a)
                swap_in_gather(host, src, dev_a, dst, rpi, backend="triton")
                swap_in_gather_ref(host, src, dev_b, dst, rpi)
                torch.cuda.synchronize()
                exact = torch.equal(dev_a, dev_b)
                t = time_fn(
                    partial(swap_in_gather, host, src, dev_a, dst, rpi, backend="triton"),
                    warmup=5,
                    rep=50,
                )
                nbytes = n * rpi * row_bytes
                rate = nbytes / t
                out.append({
                    "bench": "swap_in", "mode": mode, "items": n, "rows_per_item": rpi, "row_bytes": row_bytes,
                    "time_s": t, "bytes": nbytes, "rate_Bps": rate, "ceiling": "pinned_h2d_Bps",
                    "ceiling_Bps": ceilings["pinned_h2d_Bps"], "frac_of_ceiling": rate / ceilings["pinned_h2d_Bps"],
                    "ok": exact,
                })  # fmt: skip
            if mode == "registered":
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
            del host
    return out


def bench_kv_write(
    tokens: Sequence[int] = (8192, 65536),
    kinds: Sequence[str] = ("fp8_e4m3", "bf16"),
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    ceilings: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """write_mla_kv of a prefill chunk (bf16 inputs) into scattered slots, vs the HBM copy rate."""
    ceilings = ceilings or measure_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(2)
    out = []
    for kind in kinds:
        for t_n in tokens:
            slots_n = 2 * t_n
            pool_a = kvl.alloc_mla_pool(slots_n, kv_lora_rank, rope_dim, kind, torch.bfloat16, "cuda").zero_()
            pool_b = pool_a.clone()
            latent = torch.randn(t_n, kv_lora_rank, device="cuda", generator=gen).bfloat16()
            rope = torch.randn(t_n, rope_dim, device="cuda", generator=gen).bfloat16()
            slots = torch.randperm(slots_n, device="cuda", generator=gen)[:t_n]
            kvl.write_mla_kv(pool_a, slots, latent, rope, kind, backend="triton")
            kvl.write_mla_kv_ref(pool_b, slots, latent, rope, kind)
            a8, b8 = pool_a.view(torch.uint8), pool_b.view(torch.uint8)
            mismatch = float((a8 != b8).float().mean())  # RNE everywhere: expect 0
            t = time_fn(partial(kvl.write_mla_kv, pool_a, slots, latent, rope, kind, backend="triton"))
            nbytes = t_n * (2 * (kv_lora_rank + rope_dim) + 8 + pool_a.shape[1] * pool_a.element_size())
            rate = nbytes / t
            out.append({
                "bench": "kv_write", "kind": kind, "tokens": t_n, "time_s": t, "bytes": nbytes, "rate_Bps": rate,
                "ceiling": "hbm_copy_Bps", "ceiling_Bps": ceilings["hbm_copy_Bps"],
                "frac_of_ceiling": rate / ceilings["hbm_copy_Bps"], "byte_mismatch_frac": mismatch, "ok": mismatch == 0,
            })  # fmt: skip
    return out


def _markdown(results: list[dict[str, Any]], ceilings: dict[str, float]) -> str:
    lines = [
        "# kernels_indexer",
        "",
        f"HBM d2d copy (read+write): {ceilings['hbm_copy_Bps'] / 1e12:.2f} TB/s; "
        f"pinned H2D bulk: {ceilings['pinned_h2d_Bps'] / 1e9:.1f} GB/s",
        "",
        "| bench | config | time | rate | vs ceiling | ok |",
        "|---|---|---|---|---|---|",
    ]
    skip = {
        "bench",
        "time_s",
        "bytes",
        "rate_Bps",
        "ceiling",
        "ceiling_Bps",
        "frac_of_ceiling",
        "ok",
        "target_s",
        "torch_topk_s",
    }
    for r in results:
        cfg = ", ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        if "frac_of_ceiling" in r:
            vs = f"{100 * r['frac_of_ceiling']:.0f}% of {r['ceiling']}"
        else:
            vs = f"target {r['target_s'] * 1e6:.0f} us; torch.topk {r['torch_topk_s'] * 1e6:.0f} us"
        lines.append(
            f"| {r['bench']} | {cfg} | {r['time_s'] * 1e6:.1f} us | {r['rate_Bps'] / 1e9:.1f} GB/s | {vs} | {r['ok']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_indexer: CUDA is needed for these benchmarks; nothing to do.", file=sys.stderr)
        return 0
    ceilings = measure_ceilings(256 << 20, 256 << 20) if args.quick else measure_ceilings()
    if args.quick:
        results = (
            bench_indexer_decode((8192,), (1,), ceilings=ceilings)
            + bench_topk((65536,), 2048, (1,))
            + bench_swap_in((256,), (1, 64), host_items=1024, ceilings=ceilings)
            + bench_kv_write((4096,), ceilings=ceilings)
        )
    else:
        results = (
            bench_indexer_decode(ceilings=ceilings)
            + bench_topk()
            + bench_swap_in(ceilings=ceilings)
            + bench_kv_write(ceilings=ceilings)
        )
    md = _markdown(results, ceilings)
    common.write_json_md(args.out, "kernels_indexer", {"ceilings": ceilings, "results": results}, md)
    print(md)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
