"""Time the HiSparse placements of a decode step (kernels/lru_place.py): the Triton kernel against the
torch reference (the sort / scatter path it replaces), with its single-program select, with the
parallel passes, and from the step's victim candidates, at decode sizes with a full slot buffer.

A step places each of the L layers once, one call per layer as a decode step does (`cand`: one
`lru_candidates` launch for all L layers first; `cand_par`: the same with the candidates' select made
by the parallel passes at any slot count). Each case fills N slots per (row, layer) with decode
steps of M (2048) top-k positions (ascending, -1 padded) drawn from a growing context, then times
`steps` further steps (clock tick + placements; hits, evictions and misses as they come, ~`hit` of
the requests resident) with CUDA events around each step (host time in), each path on its own copy
of the tables, and the Triton paths' kernels alone as `steps` steps replayed from one CUDA graph (per
step); the paths' tables after the event-timed steps must agree (`tables_match`). Prints a table and
writes JSON + markdown.
With `--hit 1.0` (in the default set) every position hits: the Triton path is then the all-hit pass
(M >= 512) plus a full placement that finds no misses.

    python -m bench.place_bench [--out DIR] [--steps 50] [--hit 0.9 1.0] [--block-n 1024 2048 4096]
                                [--m 2048] [--n 13107 104857]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (N, B, L): the trained model's 128K decode places six layers a step (three full, three shared)
CASES = [(13_107, 1, 1), (13_107, 1, 6), (13_107, 8, 1), (104_857, 1, 1), (104_857, 1, 6), (104_857, 8, 2)]


def _case(
    n: int, batch: int, layers: int, steps: int, hit: float, block_n: int | None = None, M: int = 2048
) -> dict:
    """One case: the torch reference, the Triton path with the single program's select
    (`serial`) and with the parallel passes (`parallel`), each on its own tables. Each is timed with
    events around one call per step (host time in: the wrapper's allocations and launches) and,
    for the Triton paths, as the kernels alone: `steps` placements captured in one CUDA graph
    and replayed once (`graph_us`: per placement, the clock tick included)."""
    from longctx.kernels.lru_place import lru_candidates, lru_place, lru_place_ref

    dev = "cuda"
    ctx_max = int(n / 0.1)  # the cap is 10% of the context, as in the one-million runs
    P = ctx_max + 1
    blk = torch.arange(1, batch + 1, device=dev)
    trow = blk[:, None] * layers + torch.arange(layers, device=dev)
    table = torch.arange(batch * (P // 64 + 1), dtype=torch.int32, device=dev).view(batch, -1)
    minus1 = torch.full((), -1, dtype=torch.int32, device=dev)
    nf = torch.full((batch,), ctx_max - 64, dtype=torch.int64, device=dev)
    p_at, s_at, base = trow * P, trow * (n + 1), 1 + (blk - 1) * n
    res = {}
    snaps: dict[str, list[torch.Tensor]] = {}
    paths: tuple[tuple[str, Any, dict], ...] = (
        ("torch", lru_place_ref, {}),
        ("serial", lru_place, {"backend": "triton", "parallel": False}),
        ("parallel", lru_place, {"backend": "triton", "parallel": True}),
        ("cand", lru_place, {"backend": "triton", "cand": True}),
        # the candidates' select by the parallel passes whatever the slot count (CAND_PAR_MIN_BLOCKS)
        ("cand_par", lru_place, {"backend": "triton", "cand": True, "cand_parallel": True}),
    )
    for name, fn, kw in paths:
        g = torch.Generator(device=dev).manual_seed(0)  # the same requests on every path
        p2s = torch.full((batch + 1, layers, P), -1, dtype=torch.int32, device=dev)
        s2p = torch.full((batch + 1, layers, n + 1), -1, dtype=torch.int64, device=dev)
        st = torch.full_like(s2p, -1)
        acc = torch.zeros(5, dtype=torch.int64, device=dev)
        now = torch.zeros((), dtype=torch.int64, device=dev)
        if block_n is not None and fn is lru_place:
            kw = {**kw, "block_n": block_n}
        prev = torch.randperm(ctx_max, generator=g, device=dev)[:M].expand(batch, M)

        use_cand = kw.get("cand", False)
        cand_kw = {"parallel": True} if kw.get("cand_parallel") else {}
        kw = {k: v for k, v in kw.items() if k not in ("cand", "cand_parallel")}

        def place(sel: torch.Tensor, state=(fn, kw, p2s, s2p, st, acc, now, use_cand, cand_kw)) -> None:  # type: ignore[no-untyped-def]
            f, kw_, p2s_, s2p_, st_, acc_, now_, use_cand_, ckw = state
            cand = None
            if use_cand_:  # the step's candidates for every layer, one launch (cand_par: four)
                bn = {"block_n": kw_["block_n"]} if "block_n" in kw_ else {}
                cand = lru_candidates(
                    s2p_.view(-1), st_.view(-1), now_, s_at, nf, n_slots=n, count=M, **bn, **ckw
                )
            for li in range(layers):  # one placement per layer, as a decode step makes them
                one = slice(li, li + 1)
                f(
                    p2s_.view(-1), s2p_.view(-1), st_.view(-1), now_, sel, p_at[:, one], s_at[:, one], base, nf, table, acc_, n_slots=n, pos_len=P, page_size=64, force=False, minus1=minus1, **kw_,
                    **({} if cand is None else {"cand": cand[:, one]}),
                )  # fmt: skip

        def requests(prev: torch.Tensor, g: torch.Generator = g) -> torch.Tensor:
            return torch.where(
                torch.rand(batch, M, generator=g, device=dev) < hit,
                prev,
                torch.randint(0, ctx_max, (batch, M), generator=g, device=dev),
            ).sort(dim=1).values  # fmt: skip

        for _ in range(n // (M // 2) + 4):  # fill the buffer (half the requests new each step)
            now.add_(1)
            new = torch.randint(0, ctx_max, (batch, M), generator=g, device=dev)
            prev = (
                torch.where(torch.rand(batch, M, generator=g, device=dev) < 0.5, prev, new).sort(dim=1).values
            )
            place(prev)
        acc.zero_()
        # time only the placement: make the requests first, replay them
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(steps):
            prev = requests(prev)
            now.add_(1)
            torch.cuda.synchronize()
            a.record()
            place(prev)
            z.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(z))
        ms.sort()
        h, mi = int(acc[0]), int(acc[1])
        res[name] = {
            "median_us": 1e3 * ms[len(ms) // 2],
            "min_us": 1e3 * ms[0],
            "hit_rate": h / max(1, h + mi),
        }
        # the same requests went to every path: their tables must agree (sink columns aside)
        snaps[name] = [t[..., :-1].clone() for t in (p2s, s2p, st)] + [acc[:2].clone()]
        if fn is lru_place:  # the kernels alone: `steps` more placements in one graph, replayed once
            reqs = []
            for _ in range(steps):
                prev = requests(prev)
                reqs.append(prev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for r in reqs:
                    now.add_(1)
                    place(r)
            torch.cuda.synchronize()
            a.record()
            graph.replay()
            z.record()
            torch.cuda.synchronize()
            res[name]["graph_us"] = 1e3 * a.elapsed_time(z) / steps
    same = all(
        all(torch.equal(x, y) for x, y in zip(snaps["torch"], snaps[k]))
        for k in ("serial", "parallel", "cand", "cand_par")
    )
    return {"N": n, "B": batch, "L": layers, "M": M, "tables_match": same, **res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--hit",
        type=float,
        nargs="+",
        default=[0.9, 1.0],
        help="shares of each step's requests kept from the last (1.0: every position hits)",
    )
    ap.add_argument(
        "--block-n",
        type=int,
        nargs="+",
        default=[None],
        help="the full kernel's slot block(s) (default: its own)",
    )
    ap.add_argument(
        "--m", type=int, default=2048, help="requested positions per row and step (the top-k: GLM-5.3 2048)"
    )
    ap.add_argument("--n", type=int, nargs="+", default=None, help="only the cases with these slot counts N")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cases = [c for c in CASES if args.n is None or c[0] in args.n]
    if not cases or not 0 < args.m <= 4096:
        print(f"place_bench: --n must name some of {sorted({c[0] for c in CASES})} and 0 < --m <= 4096")
        return 2
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    rows = [
        {**_case(n, b, l, args.steps, hit, bn, args.m), "block_n": bn}
        for bn in args.block_n
        for hit in args.hit
        for n, b, l in cases
    ]
    lines = [
        "| N | B | L | M | block_n | hit rate | same tables | torch us | serial us | parallel us | cand us | "
        "serial graph us | parallel graph us | cand graph us | cand_par graph us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, k, q, c, cp = r["torch"], r["serial"], r["parallel"], r["cand"], r["cand_par"]
        lines.append(
            f"| {r['N']} | {r['B']} | {r['L']} | {r['M']} | {r['block_n'] or 'default'} | {k['hit_rate']:.3f} | "
            f"{'yes' if r['tables_match'] else '**NO**'} | "
            f"{t['median_us']:.1f} | {k['median_us']:.1f} | {q['median_us']:.1f} | {c['median_us']:.1f} | "
            f"{k['graph_us']:.1f} | {q['graph_us']:.1f} | {c['graph_us']:.1f} | {cp['graph_us']:.1f} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        dev = torch.cuda.get_device_name()
        (args.out / "place-bench.json").write_text(json.dumps({"device": dev, "cases": rows}, indent=2))
        (args.out / "place-bench.md").write_text(
            f"# HiSparse placement ({dev})\n\n" + "\n".join(lines) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
