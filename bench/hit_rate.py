"""HiSparse's decode hit rate with a trained indexer (issue 5 asks for >= 0.9 at 128K).

Random weights spread their top-k over the whole context, so their hit rate (0.1-0.35) says nothing
about a real model. This prefills a RULER niah_single_1 prompt (bytes) into a checkpoint with
HiSparse capped at `--cap-fraction` of the context and greedily decodes `--steps` tokens, reporting
the fraction of the decode steps' selected tokens that were already resident. Runs on the CPU (the
shipped retrieval checkpoint is small) or the GPU.

    python -m bench.hit_rate [--model models-shipped/retrieval-wip] [--tokens 8192] [--steps 48] [--policies]

`--policies` also records every layer's decode selections and replays them through cache policies
offline (`replay`): LRU as HiSparse runs it, Belady's optimal eviction (the best any policy that only
caches can do with that many slots), and an unbounded cache (what is left are first-time selections,
which no eviction policy can hit), each counted after a warm-up of `--warmup` steps. That says whether
a hit rate target is a matter of the cache policy or of how much the model's selection moves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def _use(cache: OrderedDict[int, None], positions: Iterable[int], room: int | None = None) -> None:
    """Make `positions` the most recent entries of an LRU cache, then (with `room`) evict to fit."""
    for p in positions:
        cache[p] = None
        cache.move_to_end(p)
    while room is not None and len(cache) > room:
        cache.popitem(last=False)


def _split(sel: Iterable[int], t: int, first_ctx: int, recent: int) -> tuple[set[int], set[int], set[int]]:
    """Decode step t's selection as a set, its pinned part (the `recent` newest positions of a context
    of first_ctx + t tokens: always resident, so hits) and the rest."""
    cur = set(sel)
    pinned = {p for p in cur if p >= first_ctx + t - recent}
    return cur, pinned, cur - pinned


def replay(
    steps: Sequence[Sequence[int]],
    first_ctx: int,
    cap: int,
    recent: int,
    warmup: int,
    ahead: Sequence[Sequence[int]] | None = None,
    neighbours: int = 0,
) -> dict[str, float]:
    """Hit rates of one (request, layer)'s decode selections under three caches of `cap` device slots.

    steps[t]: the positions selected at decode step t, whose context is first_ctx + t tokens; the
    `recent` newest positions are always resident (they are hits, as in HiSparse, and take `recent`
    of the slots). The caches start empty and only steps >= warmup are counted. "lru" evicts the least
    recently selected position; "belady" the one selected again furthest in the future (never: first),
    the optimum for any cache that fetches on a miss; "unbounded" never evicts. Also the mean fraction
    of a step's selection that the previous step selected too ("overlap_prev").

    `ahead[t]` (optional): the positions the indexer ranked just below the top-k at step t. Then
    "lru_ahead" is LRU that also fetches those after each step (in recency between older entries and
    the step's own selection), with "ahead_fetches" the extra rows it copied per counted step
    against "lru_misses" per counted step.

    `neighbours` R > 0: also "lru_nb", LRU that on each miss at p also fetches the positions within R of
    p (not selected this step, not pinned; in recency between older entries and the step's own
    selection), with "nb_fetches" the extra rows it copied per counted step: whether what a step
    misses sits next to what an earlier step missed (a page-wise swap-in's bet)."""
    room = cap - recent
    assert room > 0 and all(len(set(s)) <= room + recent for s in steps)
    uses: dict[int, list[int]] = {}
    for t, sel in enumerate(steps):
        for p in set(sel):
            uses.setdefault(p, []).append(t)
    lru: OrderedDict[int, None] = OrderedDict()
    pre: OrderedDict[int, None] = OrderedDict()  # LRU + fetch-ahead
    nbc: OrderedDict[int, None] = OrderedDict()  # LRU + the misses' neighbours
    fetched = nb_fetched = 0
    opt: set[int] = set()
    seen: set[int] = set()
    hits = {"lru": 0, "belady": 0, "unbounded": 0} | ({"lru_ahead": 0} if ahead is not None else {})
    if neighbours:
        hits["lru_nb"] = 0
    total, overlap, n_overlap = 0, 0.0, 0
    prev: set[int] = set()
    for t, sel in enumerate(steps):
        cur, pinned, old = _split(sel, t, first_ctx, recent)
        if t and cur:
            overlap += len(cur & prev) / len(cur)
            n_overlap += 1
        prev = cur
        if t >= warmup:
            total += len(cur)
            hits["lru"] += len(pinned) + sum(1 for p in old if p in lru)
            hits["belady"] += len(pinned) + len(old & opt)
            hits["unbounded"] += len(pinned) + len(old & seen)
            if ahead is not None:
                hits["lru_ahead"] += len(pinned) + sum(1 for p in old if p in pre)
            if neighbours:
                hits["lru_nb"] += len(pinned) + sum(1 for p in old if p in nbc)
        if neighbours:
            lo, hi = 0, first_ctx + t - recent
            extra_nb = {
                q
                for p in old
                if p not in nbc
                for q in range(max(lo, p - neighbours), min(hi, p + neighbours + 1))
                if q not in cur and q not in nbc
            }
            if t >= warmup:
                nb_fetched += len(extra_nb)
            _use(nbc, sorted(extra_nb))
            _use(nbc, sorted(old), room)
        _use(lru, sorted(old), room)
        if ahead is not None:
            extra = [p for p in ahead[t] if p not in pre and p < first_ctx + t - recent]
            if t >= warmup:
                fetched += len(extra)
            _use(pre, extra)  # more recent than older entries, behind the step's own selection
            _use(pre, sorted(old), room)
        opt |= old
        if len(opt) > room:

            def next_use(p: int, t: int = t) -> int:
                later = [u for u in uses[p] if u > t]
                return later[0] if later else len(steps) + 1

            victims = sorted(opt - old, key=next_use, reverse=True)[: len(opt) - room]
            opt -= set(victims)
        seen |= old
    out = {k: v / max(1, total) for k, v in hits.items()}
    out["overlap_prev"] = overlap / max(1, n_overlap)
    if ahead is not None:
        n_counted = max(1, len(steps) - warmup)
        out["ahead_fetches"] = fetched / n_counted
        out["lru_misses"] = (total - hits["lru"]) / n_counted  # pinned positions are always hits
    if neighbours:
        out["nb_fetches"] = nb_fetched / max(1, len(steps) - warmup)
    out["counted_selections"] = float(total)
    return out


def tail_cover(
    steps: Sequence[Sequence[int]], tail: Sequence[Sequence[int]], first_ctx: int, recent: int
) -> dict[str, float]:
    """How much of one (request, layer)'s decode selections, every step counted, an unbounded cache
    holds when it starts empty ("cold": the first-time selections miss) against when it starts with
    the selections of the prompt's last queries (`tail`, the final prefill chunk's last rows), i.e. the
    best a warm-up of the device slots from those queries can do. The `recent` newest are hits."""
    warm = {p for sel in tail for p in sel}
    seen: set[int] = set()
    hits = {"cold": 0, "tail": 0}
    total = 0
    for t, sel in enumerate(steps):
        cur, pinned, old = _split(sel, t, first_ctx, recent)
        total += len(cur)
        hits["cold"] += len(pinned) + len(old & seen)
        hits["tail"] += len(pinned) + len(old & (seen | warm))
        seen |= old
    out = {k: v / max(1, total) for k, v in hits.items()}
    out["tail_positions"] = float(len(warm))
    return out


def warm_lru(
    steps: Sequence[Sequence[int]],
    tail: Sequence[Sequence[int]],
    freq: dict[int, int],
    first_ctx: int,
    cap: int,
    recent: int,
) -> dict[str, float]:
    """LRU with `cap` slots (the `recent` newest pinned), every decode step counted, starting from
    what a prefill could leave resident: nothing ("cold"); the prompt's last queries' selections,
    latest query first ("tail", as HiSparse's tail placement), or by how many of those queries
    selected them ("tail_count"); the positions the whole prefill
    selected most often ("freq", `freq`: position -> how many prefill queries selected it); the tail
    first, then the most frequent ("tail_freq"). Each start set is cut to the cap's evictable room, and
    its first entries are the most recent."""
    room = cap - recent
    latest = list(dict.fromkeys(p for sel in reversed(tail) for p in sel))  # the latest query's first
    by_freq = sorted(freq, key=lambda p: (-freq[p], -p))
    n_tail: dict[int, int] = {}
    for sel in tail:
        for p in sel:
            n_tail[p] = n_tail.get(p, 0) + 1
    rank = {p: i for i, p in enumerate(latest)}
    starts = {
        "cold": [],
        "tail": latest[:room],
        # the tail's positions by how many of its queries selected them, then latest first
        "tail_count": sorted(latest, key=lambda p: (-n_tail[p], rank[p]))[:room],
        "freq": by_freq[:room],
        "tail_freq": list(dict.fromkeys(latest + by_freq))[:room],
    }
    out: dict[str, float] = {}
    for name, start in starts.items():
        lru: OrderedDict[int, None] = OrderedDict((p, None) for p in reversed(start))  # first = oldest
        hits = total = 0
        for t, sel in enumerate(steps):
            cur, pinned, old = _split(sel, t, first_ctx, recent)
            total += len(cur)
            hits += len(pinned) + sum(1 for p in old if p in lru)
            _use(lru, sorted(old), room)
        out[name] = hits / max(1, total)
    out["freq_positions"] = float(len(freq))
    return out


class SelectionRecorder:
    """While entered: every layer's batch-1 decode selection as HiSparse resolves it (positions, -1
    dropped), and with `ahead` > 0 the next `ahead` positions the indexer ranked below its top-k (the
    torch top-k, i.e. the CPU path). Patches `HiSparseKVCache.resolve` and `topk.topk_indices_ref`."""

    def __init__(self, ahead: int = 0, tail: int = 0, freq: bool = False) -> None:
        self.ahead = ahead
        self.tail = tail  # prefill: keep each layer's last `tail` query rows of the latest chunk
        self.prefill_tail: dict[int, list[list[int]]] = {}
        self.freq = freq  # prefill: count how many queries selected each position, per layer
        self.prefill_freq: dict[int, torch.Tensor] = {}
        self.steps: dict[int, list[list[int]]] = {}
        self.below: dict[int, list[list[int]]] = {}
        self.recent = 0
        self._extra: list[int] = []

    def __enter__(self) -> SelectionRecorder:
        from longctx.kernels import topk as topk_mod

        from longctx.hisparse.cache import HiSparseKVCache
        from longctx.model import ops

        rec, resolve, ref = self, HiSparseKVCache.resolve, topk_mod.topk_indices_ref
        self._undo = [(HiSparseKVCache, "resolve", resolve), (topk_mod, "topk_indices_ref", ref)]

        def topk_indices_ref(logits, k, valid_len, *window):  # type: ignore[no-untyped-def]
            out = ref(logits, k, valid_len, *window)
            if rec.ahead and logits.shape[0] == 1:
                chosen = set(out[0].tolist())  # (with a window: the next ranked before it)
                wide = ref(logits, k + rec.ahead, valid_len, *window)[0].tolist()
                rec._extra = [p for p in wide if p >= 0 and p not in chosen]
            return out

        def resolve_rec(cache, layer, topk, ctx):  # type: ignore[no-untyped-def]
            prefill = getattr(cache, "_dec", None) is None and topk.shape[0] > 1  # a prefill chunk
            if rec.tail and prefill:
                rows = topk[-rec.tail :].tolist()
                rec.prefill_tail[layer] = [[p for p in r if p >= 0] for r in rows]
            if rec.freq and prefill:
                prev = rec.prefill_freq.get(layer)
                sel = topk[topk >= 0].long().flatten().cpu()
                n = torch.bincount(sel, minlength=0 if prev is None else prev.numel())
                if prev is not None:
                    n[: prev.numel()] += prev
                rec.prefill_freq[layer] = n
            if topk.shape[0] == 1 and getattr(cache, "_dec", None) is not None:
                rec.steps.setdefault(layer, []).append([p for p in topk[0].tolist() if p >= 0])
                rec.below.setdefault(layer, []).append(list(rec._extra))  # shared layers: their full layer's
                rec.recent = cache.recent
            return resolve(cache, layer, topk, ctx)

        HiSparseKVCache.resolve = resolve_rec  # type: ignore[method-assign]
        topk_mod.topk_indices_ref = topk_indices_ref
        ops._lookup.cache_clear()  # the model looks ops up once and caches them
        return self

    def __exit__(self, *exc: object) -> None:
        from longctx.model import ops

        for obj, name, fn in self._undo:
            setattr(obj, name, fn)
        ops._lookup.cache_clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models-shipped" / "retrieval-wip"))
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length (bytes = tokens)")
    ap.add_argument("--steps", type=int, default=48, help="greedy decode steps")
    ap.add_argument("--cap-fraction", type=float, default=0.1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None, help="write hit-rate-<tokens>.json here")
    ap.add_argument("--policies", action="store_true", help="replay the selections through LRU / Belady")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps the offline caches warm up on")
    ap.add_argument(
        "--ahead",
        type=int,
        default=0,
        help="with --policies: also replay LRU fetching the next N ranked (CPU)",
    )
    ap.add_argument(
        "--neighbours",
        type=int,
        default=0,
        metavar="R",
        help="with --policies: also replay LRU fetching each miss's neighbours within R positions",
    )
    ap.add_argument(
        "--tail",
        type=int,
        default=0,
        help="with --policies: also count what the prompt's last N queries' selections would hold",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="with --policies and --tail: LRU started from what prefill could leave resident (the tail, "
        "the positions the prefill selected most often, both)",
    )
    ap.add_argument(
        "--index-local-window",
        type=int,
        default=None,
        metavar="W",
        help="each query's newest W positions in every selection (Engine's; default the model's)",
    )
    args = ap.parse_args(argv)

    from bench.common import niah_byte_prompt
    from longctx import Engine
    from longctx.engine.request import Request, SamplingParams

    ids = niah_byte_prompt(args.tokens)
    from longctx.config import ModelConfig

    topk = ModelConfig.from_json(args.model).index_topk
    cap = max(topk + 2, int(args.cap_fraction * len(ids)))  # a decode query's selection must fit
    params = SamplingParams(max_new_tokens=args.steps, temperature=0.0, ignore_eos=True)
    rec = SelectionRecorder(args.ahead, args.tail, args.warm) if args.policies else contextlib.nullcontext()
    with (
        rec,
        Engine(
            args.model,
            device=args.device,
            hisparse_device_tokens=cap,
            chunk_size=args.chunk,
            index_local_window=args.index_local_window,
        ) as eng,  # fmt: skip
    ):
        eng.add_request(Request("hit-rate", ids, params))
        t0 = time.perf_counter()
        prefill_s, at_first = None, None
        while eng.has_work():
            for o in eng.step():
                if o.new_token_ids and at_first is None:
                    prefill_s, at_first = time.perf_counter() - t0, eng.stats()["hisparse"]
        end = eng.stats()["hisparse"]
    assert at_first is not None
    hits, misses = end["hits"] - at_first["hits"], end["misses"] - at_first["misses"]
    res = {
        "model": args.model,
        "context_tokens": len(ids),
        "index_topk": topk,
        "index_local_window": args.index_local_window,
        "device_tokens_cap": cap,
        "decode_steps": args.steps,
        "hits": hits,
        "misses": misses,
        "decode_hit_rate": hits / max(1, hits + misses),
        "prefill_s": prefill_s,
        "device": args.device,
        "command": "python -m bench.hit_rate " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if isinstance(rec, SelectionRecorder) and rec.steps:
        r = rec.recent
        per = {
            layer: replay(
                st,
                len(ids) + 1,
                cap,
                r,
                args.warmup,
                rec.below[layer] if args.ahead else None,
                args.neighbours,
            )
            for layer, st in sorted(rec.steps.items())
        }
        if args.tail:
            for layer, st in rec.steps.items():
                per[layer].update(
                    {
                        f"tail_{k}": v
                        for k, v in tail_cover(st, rec.prefill_tail.get(layer, []), len(ids) + 1, r).items()
                    }
                )
        if args.warm:
            for layer, st in rec.steps.items():
                f = rec.prefill_freq.get(layer, torch.zeros(0, dtype=torch.long))
                nz = f.nonzero().flatten()
                freq = dict(zip(nz.tolist(), f[nz].tolist()))
                w = warm_lru(st, rec.prefill_tail.get(layer, []), freq, len(ids) + 1, cap, r)
                per[layer].update({f"warm_{k}": v for k, v in w.items()})
        keys = tuple(next(iter(per.values())))
        mean = {k: sum(v[k] for v in per.values()) / len(per) for k in keys}
        res["policies"] = {
            "warmup_steps": args.warmup,
            "recent": r,
            "ahead": args.ahead,
            "neighbours": args.neighbours,
            "tail": args.tail,
            "mean": mean,
            "per_layer": per,
        }
        print(
            f"offline replay after {args.warmup} warm-up steps (mean of {len(per)} layers): LRU {mean['lru']:.3f}, "
            f"Belady {mean['belady']:.3f}, unbounded {mean['unbounded']:.3f}; "
            f"overlap with the previous step's selection {mean['overlap_prev']:.3f}"
            + (
                f"; LRU fetching the next {args.ahead} ranked: {mean['lru_ahead']:.3f} "
                f"({mean['ahead_fetches']:.0f} extra rows a step against {mean['lru_misses']:.0f} misses)"
                if args.ahead
                else ""
            )
            + (
                f"; LRU fetching each miss's neighbours within {args.neighbours}: {mean['lru_nb']:.3f} "
                f"({mean['nb_fetches']:.0f} extra rows a step)"
                if args.neighbours
                else ""
            )
            + (
                f"; every step, an unbounded cache from empty {mean['tail_cold']:.3f}, from the last "
                f"{args.tail} prompt queries' selections ({mean['tail_tail_positions']:.0f} positions) "
                f"{mean['tail_tail']:.3f}"
                if args.tail
                else ""
            )
            + (
                f"; LRU at the cap, every step, from empty {mean['warm_cold']:.3f}, from the tail "
                f"{mean['warm_tail']:.3f}, from the prefill's most selected {mean['warm_freq']:.3f}, "
                f"tail then most selected {mean['warm_tail_freq']:.3f}"
                if args.warm
                else ""
            )
        )
    print(
        f"{len(ids):,} tokens, top-{topk}, cap {cap:,} ({args.cap_fraction:.0%}): decode hit rate "
        f"{res['decode_hit_rate']:.3f} over {args.steps} steps ({hits:,} hits, {misses:,} misses)"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"hit-rate-{len(ids)}.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
