"""Swap-in launch knobs on the GPU: every kernels/swap.CopyKnobs setting in SETTINGS times the
zero-copy gather of 64-token pages and of single 656-byte rows scattered over a registered host pool
(a /dev/shm HostPool as the engine maps it, or --pool malloc), against the pinned H2D cudaMemcpy
rate measured in the same run (issue 3: pages >= 0.90 of it).

Each measurement reads --read-gib (1) from random pages / rows of a --pool-gib (4) pool; every
setting is first checked byte for byte against the torch reference. Rows also get the time of a
2048-row copy (HiSparse's decode misses are that small). Then the best page setting and the default
read the same pages in pool order (is the scatter what costs?). Prints a table per case, the
LONGCTX_SWAP_PAGES / _ROWS value of the winners, and writes swap-sweep-<gpu>.{json,md} to
bench/results (and --out). ~2 minutes on an H200.

    python -m bench.swap_sweep [--quick] [--pool shm|malloc] [--pool-gib 4] [--read-gib 1] [--out DIR]

--device cpu runs the same path at toy sizes under TRITON_INTERPRET=1 (the test of this script).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.kernels.swap import (  # noqa: E402
    PAGE_KNOBS,
    ROW_KNOBS,
    CopyKnobs,
    copy_geometry,
    swap_in_gather,
    swap_in_gather_ref,
)

from bench.common import copy_rate, environment, sweep_device, time_cuda, write_results  # noqa: E402
from longctx.kvstore.host_pool import HostPool, HostPoolError  # noqa: E402

ROW_BYTES, PAGE = 656, 64  # the fp8 MLA token row; tokens per page
K = CopyKnobs
# Pages (5248 8-byte words): first the launch before the knobs (K(), PAGE_KNOBS' default again after the
# H200 sweep) and the cut into 41 pieces of 1 KB; then for whole pages the word width at equal bytes, bytes in flight per
# thread (tile / 32 warps), warps, split and persistent grids; then the same around the cut. Counts
# are words (8 bytes unless `word` says otherwise).
PAGE_SETTINGS = [
    K(),
    K(cut=True),
    K(word=4, block=2048, tile=4096),
    K(word=2, block=4096, tile=8192),
    K(word=1, block=8192, tile=16384),
    K(block=1024, tile=1024),
    K(block=2048, tile=2048),
    K(block=4096, tile=4096),
    K(block=2048, tile=4096),
    K(block=1024, tile=4096, warps=8),
    K(block=2048, tile=4096, warps=8),
    K(block=512, tile=512, warps=2),
    K(persist=1),
    K(persist=2),
    K(persist=4),
    K(split=True),
    K(split=True, persist=1),
    K(split=True, persist=2),
    K(split=True, persist=4),
    K(split=True, persist=8),
    K(block=2048, tile=2048, split=True, persist=2),
    K(block=2048, tile=2048, split=True, persist=4),
    K(block=512, tile=2048, split=True, persist=4),
    K(block=1024, tile=4096, warps=8, split=True, persist=2),
    K(block=512, tile=512, warps=2, split=True, persist=8),
    K(cut=True, tile=1024),
    K(cut=True, items=8, tile=1024, warps=2),
    K(cut=True, items=32, tile=4096),
    K(cut=True, items=32, tile=4096, warps=8),
    K(cut=True, items=64, tile=8192, warps=8),
    K(word=4, block=2048, tile=4096, cut=True),
    K(cut=True, persist=2),
    K(cut=True, persist=4),
    K(cut=True, persist=8),
    K(cut=True, items=32, tile=4096, warps=8, persist=4),
]
# Rows: 82 words, one [items, 128] tile each (block >= 128).
ROW_SETTINGS = [
    K(),
    K(items=4, tile=512),
    K(items=8, tile=1024),
    K(items=32, tile=4096),
    K(items=64, tile=8192, warps=8),
    K(word=4, block=256, tile=4096),
    K(warps=2),
    K(warps=8),
    K(items=32, tile=4096, warps=8),
    K(persist=2),
    K(persist=4),
    K(persist=8),
    K(items=8, tile=1024, persist=8),
]
QUICK = {"pages": [0, 1, 18, 32], "rows": [0, 1, 9]}  # indices into the lists above


class Timer:
    """Seconds per call: CUDA events on a GPU, wall time under the interpreter (correctness only)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.dev = torch.device("cuda" if cuda else "cpu")

    def __call__(self, fn: Callable[[], Any], iters: int, warmup: int = 1) -> float:
        if self.cuda:
            return time_cuda(fn, iters=iters, warmup=warmup)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _fill(pool: torch.Tensor, dev: torch.device, chunk: int = 256 << 20) -> None:
    """Distinct 8-byte words everywhere (an odd multiplier of the word index), written in chunks
    from the device: seconds for 4 GiB where a CPU RNG takes a minute."""
    words = pool.view(-1).view(torch.int64)
    per = chunk // 8
    for w0 in range(0, words.numel(), per):
        n = min(per, words.numel() - w0)
        x = torch.arange(w0, w0 + n, dtype=torch.int64, device=dev) * -7046029254386353131 + 12345
        words[w0 : w0 + n].copy_(x)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _measure(
    host: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    dst_pool: torch.Tensor,
    want: torch.Tensor,
    rpi: int,
    knobs: CopyKnobs,
    timer: Timer,
    iters: int,
) -> dict[str, Any]:
    g = copy_geometry(host, dst_pool, rpi, knobs)
    dst_pool.zero_()
    swap_in_gather(host, src, dst_pool, dst, rpi, backend="triton", knobs=knobs)
    ok = bool(torch.equal(dst_pool, want))
    t = timer(lambda: swap_in_gather(host, src, dst_pool, dst, rpi, backend="triton", knobs=knobs), iters)
    nbytes = src.shape[0] * rpi * host.shape[1] * host.element_size()
    return {
        "spec": knobs.spec(), "ok": ok, "time_s": t, "bytes": nbytes, "rate_Bps": nbytes / t,
        "tile": [g.items, g.block_w], "word_bytes": g.word.itemsize, "span_w": g.span_w, "pieces": g.pieces,
        "grid": g.grid(src.shape[0], dst_pool.device), "threads": 32 * g.warps,
        "bytes_per_thread": g.items * g.block_w * g.word.itemsize // (32 * g.warps),
    }  # fmt: skip


def _case(
    name: str,
    host: torch.Tensor,
    rpi: int,
    n: int,
    settings: list[CopyKnobs],
    timer: Timer,
    iters: int,
    seed: int,
    small: int = 0,
) -> list[dict[str, Any]]:
    """Every setting on n random items of rpi rows (and, with `small`, n = small items too)."""
    dev = timer.dev
    gen = torch.Generator(device=dev).manual_seed(seed)
    items = host.shape[0] // rpi
    src = torch.randperm(items, device=dev, generator=gen)[:n] * rpi
    dst = torch.randperm(n, device=dev, generator=gen) * rpi
    dst_pool = torch.empty(n * rpi, host.shape[1], dtype=host.dtype, device=dev)
    want = torch.zeros_like(dst_pool)
    swap_in_gather_ref(host, src, want, dst, rpi)
    small_case = None
    if small:
        s_src, s_dst = src[:small], torch.randperm(small, device=dev, generator=gen) * rpi
        s_pool = torch.empty(small * rpi, host.shape[1], dtype=host.dtype, device=dev)
        s_want = torch.zeros_like(s_pool)
        swap_in_gather_ref(host, s_src, s_want, s_dst, rpi)
        small_case = (s_src, s_dst, s_pool, s_want)
    out = []
    for k in settings:
        r = {"case": name, "items": n, **_measure(host, src, dst, dst_pool, want, rpi, k, timer, iters)}
        if small_case is not None:
            s = _measure(host, small_case[0], small_case[1], small_case[2], small_case[3], rpi, k, timer, 50)
            r["small_items"], r["small_time_s"], r["ok"] = small, s["time_s"], r["ok"] and s["ok"]
        out.append(r)
        print(_line(r), flush=True)
    return out


def _line(r: dict[str, Any], ceiling: float | None = None) -> str:
    frac = f" | {r['rate_Bps'] / ceiling:.3f}" if ceiling else ""
    small = f" | {r['small_time_s'] * 1e6:.1f} us" if "small_time_s" in r else (" |" if ceiling else "")
    knobs = ROW_KNOBS if r["case"] == "rows" else PAGE_KNOBS
    note = " (before)" if r["spec"] == CopyKnobs().spec() else ""
    note += " (default)" if r["spec"] == knobs.spec() else ""
    cut = f" ({r['pieces']} pieces an item)" if r["pieces"] > 1 else ""
    return (
        f"| {r['case']} | {r['spec']}{note} | {r['tile'][0]}x{r['tile'][1]}x{r['word_bytes']}B{cut}, "
        f"{r['bytes_per_thread']} B/thread, grid {r['grid']} | {r['time_s'] * 1e3:.3f} ms | "
        f"{r['rate_Bps'] / 1e9:.1f} GB/s{frac}{small} | {'ok' if r['ok'] else 'WRONG'} |"
    )


def table(res: dict[str, Any]) -> str:
    c = res["ceilings"]
    h2d = c["pinned_h2d_Bps"]
    lines = [
        f"Swap-in knob sweep: {res['env'].get('gpu')}, {res['pool']} pool of {res['pool_bytes'] / 2**30:.1f} GiB, "
        f"{res['read_bytes'] / 2**30:.2f} GiB read per measurement. Pinned H2D cudaMemcpy {h2d / 1e9:.1f} GB/s; "
        f"H2D cudaMemcpy from the pool {c['pool_h2d_Bps'] / 1e9:.1f} GB/s.",
        "",
        "| case | knobs (LONGCTX_SWAP_PAGES / _ROWS) | tile, in flight, grid | time | rate | of pinned H2D "
        "| 2048 rows | check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in ("pages", "rows", "pages-in-order"):
        rows = sorted((r for r in res["results"] if r["case"] == case), key=lambda r: -r["rate_Bps"])
        lines += [_line(r, h2d) for r in rows]
    lines.append("")
    for case, spec in res["best"].items():
        var = "LONGCTX_SWAP_PAGES" if case == "pages" else "LONGCTX_SWAP_ROWS"
        lines.append(f"best {case}: {var}={spec}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few settings per case (smoke run)")
    ap.add_argument("--pool", choices=("shm", "malloc"), default="shm")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--read-gib", type=float, default=1.0)
    ap.add_argument("--cases", default="pages,rows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    dev, rc = sweep_device(args.device, "bench/swap_sweep.py")
    if rc is not None:
        return rc
    cuda = dev.type == "cuda"
    t0 = time.time()
    row_bytes_total = int(args.pool_gib * 2**30) // (ROW_BYTES * PAGE) * ROW_BYTES * PAGE
    pool_obj = None
    if args.pool == "shm":
        try:
            pool_obj, _ = HostPool.create(row_bytes_total, "swapsweep")
        except HostPoolError as e:  # e.g. a container's small /dev/shm
            print(f"no shm pool ({e}); using malloc'd memory")
            args.pool = "malloc"
    if pool_obj is not None:
        pool_obj.unlink()
        pool_obj.register_cuda()
        host = pool_obj.as_tensor(torch.uint8, (row_bytes_total // ROW_BYTES, ROW_BYTES))
    else:
        host = torch.empty(row_bytes_total // ROW_BYTES, ROW_BYTES, dtype=torch.uint8)
        if cuda:
            rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            assert int(rc) == 0, f"cudaHostRegister failed: {rc}"
    _fill(host, dev)
    print(
        f"pool: {args.pool} {host.numel() / 2**30:.2f} GiB registered and filled in {time.time() - t0:.1f}s"
    )

    read = int(args.read_gib * 2**30)
    ceil: dict[str, float] = {}
    if cuda:
        pinned = torch.empty(read, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(read, dtype=torch.uint8, device=dev)
        ceil["pinned_h2d_Bps"] = copy_rate(pinned, gpu, both_ways=False, warmup=25, rep=250)
        ceil["pool_h2d_Bps"] = copy_rate(host.view(-1)[:read], gpu, both_ways=False, warmup=25, rep=250)
        del pinned, gpu
        torch.cuda.empty_cache()
    else:
        ceil = {"pinned_h2d_Bps": 1.0, "pool_h2d_Bps": 1.0}
    print({k: f"{v / 1e9:.1f} GB/s" for k, v in ceil.items()}, flush=True)

    timer = Timer(cuda)
    iters = 5 if cuda else 1
    cases = set(filter(None, args.cases.split(",")))
    results: list[dict[str, Any]] = []
    best: dict[str, str] = {}
    page_bytes = ROW_BYTES * PAGE
    for name, rpi, settings, item_bytes, small in (
        ("pages", PAGE, PAGE_SETTINGS, page_bytes, 0),
        ("rows", 1, ROW_SETTINGS, ROW_BYTES, 2048 if cuda else 40),
    ):
        if name not in cases:
            continue
        if args.quick:
            settings = [settings[i] for i in QUICK[name]]
        n = min(-(-read // item_bytes), host.shape[0] // rpi)
        rows = _case(name, host, rpi, n, settings, timer, iters, seed=len(results), small=small)
        results += rows
        good = [r for r in rows if r["ok"]]
        if good:
            best[name] = max(good, key=lambda r: r["rate_Bps"])["spec"]
        if cuda:
            torch.cuda.empty_cache()
    if "pages" in best:  # the same kernel over pages in pool order: what the scatter costs
        n = min(-(-read // page_bytes), host.shape[0] // PAGE)
        src = torch.arange(n, device=dev) * PAGE
        dst_pool = torch.empty(n * PAGE, ROW_BYTES, dtype=torch.uint8, device=dev)
        want = host[: n * PAGE].to(dev)
        for spec in dict.fromkeys([CopyKnobs().spec(), PAGE_KNOBS.spec(), best["pages"]]):
            k = CopyKnobs.parse(spec)
            r = _measure(host, src, src, dst_pool, want, PAGE, k, timer, iters)
            results.append(r := {"case": "pages-in-order", "items": n, **r})
            print(_line(r), flush=True)
        del dst_pool, want
    res = {
        "env": environment(),
        "pool": args.pool,
        "pool_bytes": host.numel(),
        "read_bytes": read,
        "ceilings": ceil,
        "results": results,
        "best": best,
        "seconds": time.time() - t0,
        "command": "python -m bench.swap_sweep " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    tab = table(res)
    print(tab)
    name = "swap-sweep-" + (res["env"].get("gpu") or "cpu").split()[-1].lower()  # swap-sweep-h200
    if cuda:
        write_results(name, res, tab, args.out)
    elif args.out:
        from bench.common import write_json_md

        write_json_md(args.out, "swap-sweep-cpu", res, tab, default=float)
    if pool_obj is not None:
        del host
        pool_obj.close()
    print(f"done in {time.time() - t0:.0f}s")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
