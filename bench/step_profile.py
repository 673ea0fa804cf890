"""Where step time goes: torch.profiler over a longctx prefill or decode steps of small-1m on the GPU.

Prints the top CUDA kernels by total time, the wall time and the GPU busy time (their gap is host
work and launch latency), and writes step-profile-<phase>-....json under --out.
- `--phase prefill`: one prefill of `--tokens` (which of indexer, top-k, sparse MLA, MoE, GEMMs
  dominate the prefill issue 9 compares with transformers);
- `--phase decode`: `--steps` batch-`--batch` decode steps at context `--tokens` (CUDA graphs as
  the engine runs them), against issue 9's decode roofline.
The prefill form and the sparse-MLA variant are switchable so one run can compare them.

    python -m bench.step_profile [--phase prefill|decode] [--tokens 16384] [--batch 1] [--steps 32]
                                 [--prefill-form auto|absorbed|expanded] [--sparse-mla-heads-min N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import scratch_dir  # noqa: E402
from longctx.engine.args import add_selection_args, selection_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# Kernel name patterns -> the part of the model they belong to (first match wins), for the shares
# issue 9 asks about (the indexer's share of a long prefill, say).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "indexer + top-k + sorts",
        ("indexer", "_fused_kernel", "topk", "TopK", "_hist", "radixSort", "RadixSort", "sort"),
    ),
    ("sparse MLA", ("sparse_mla", "_combine_kernel")),
    ("MoE experts + router", ("_gate_up_kernel", "_down_kernel", "_align", "_router")),
    ("GEMMs (projections)", ("nvjet", "gemm", "Gemm", "cutlass", "xmma", "sm90_", "fp8_block")),
    ("KV / swap copies", ("_write_", "_copy_rows", "swap", "Memcpy", "memcpy")),
    ("norm / rope / activation", ("_rms_norm", "_rope", "_silu_mul", "rsqrt", "layer_norm")),
)


def kernel_groups(rows: list[tuple[float, str, int]]) -> dict[str, dict[str, float]]:
    """(time, kernel name, launches) rows -> per group: ms, share of the total, launches."""
    total = sum(t for t, _, _ in rows) or 1.0
    out: dict[str, dict[str, float]] = {}
    for t, name, n in rows:
        g = next((g for g, pats in GROUPS if any(p in name for p in pats)), "other (elementwise etc.)")
        d = out.setdefault(g, {"ms": 0.0, "share": 0.0, "launches": 0})
        d["ms"] += t / 1e3
        d["share"] += t / total
        d["launches"] += n
    return {
        g: {k: round(v, 4) for k, v in d.items()} for g, d in sorted(out.items(), key=lambda x: -x[1]["ms"])
    }


def step_spread(t0: float, stamps: list[float]) -> dict[str, float]:
    """Per-call wall times of a decode loop (ms): median and spread, so one slow step (a recapture, a
    page allocation) is told apart from every step being slow."""
    if not stamps:
        return {}
    dts = sorted(1e3 * (b - a) for a, b in zip([t0, *stamps[:-1]], stamps))

    def q(f: float) -> float:
        return round(dts[min(len(dts) - 1, int(f * len(dts)))], 4)

    return {"step_ms_median": q(0.5), "step_ms_p10": q(0.1), "step_ms_p90": q(0.9), "step_ms_max": q(1.0)}


def host_ms_per_step(st0: dict[str, Any], st1: dict[str, Any], n: int) -> dict[str, float]:
    """The host's share of a decode loop's steps from two engine stats (ms a step): filling a graph's
    inputs (`graph_prep_ms`), the graph launch call (`graph_launch_ms`) and the wait for the sampled
    tokens (`token_wait_ms`), timed by the engine itself, so without a profiler's overhead."""
    g0, g1 = st0.get("cuda_graphs", {}), st1.get("cuda_graphs", {})
    pairs = [("graph_prep_ms", g0.get("prep_s"), g1.get("prep_s")),
             ("graph_launch_ms", g0.get("launch_s"), g1.get("launch_s")),
             ("token_wait_ms", st0.get("token_wait_s"), st1.get("token_wait_s"))]  # fmt: skip
    return {k: round(1e3 * (b - a) / max(1, n), 4) for k, a, b in pairs if a is not None and b is not None}


# idle gaps between kernels by size (us): upper bound, name
_GAP_BUCKETS = (
    (2.0, "<2us"),
    (5.0, "2-5us"),
    (20.0, "5-20us"),
    (100.0, "20-100us"),
    (float("inf"), ">100us"),
)


def timeline(prof: Any, top: int = 12) -> dict[str, Any]:
    """What the trace says about time the GPU was NOT busy: the device kernels' union against their
    span, the idle gaps between consecutive kernels by size (many small gaps = per-node launch cost of a
    replayed graph; a few large ones = the GPU waiting for the host), the largest gaps with the kernels
    around them, and the host's CUDA runtime calls (synchronisations, memcpys, graph launches)."""
    from torch.autograd import DeviceType

    evs = [
        e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    evs.sort(key=lambda e: e.time_range.start)
    out: dict[str, Any] = {}
    if evs:
        # the kernel that ends last so far (`prev`, at `end`) and the idle gap before each later start
        busy, gaps, end, prev = 0.0, [], evs[0].time_range.start, evs[0]
        for e in evs:
            s, f = e.time_range.start, e.time_range.end
            if s > end:
                gaps.append((s - end, prev.name, e.name))
            busy += max(0.0, f - max(s, end))
            if f > end:
                end, prev = f, e
        span = end - evs[0].time_range.start
        buckets = dict.fromkeys((name for _, name in _GAP_BUCKETS), 0.0)
        counts = dict.fromkeys(buckets, 0)
        for g, _, _ in gaps:
            b = next(name for limit, name in _GAP_BUCKETS if g < limit)
            buckets[b] += g / 1e3
            counts[b] += 1
        gaps.sort(reverse=True)
        # one decode step's kernels in start order, from the step's greedy argmax (torch's, or kernels.argmax's
        # pick) to the next one's, in the middle of the trace: which GEMM is which layer's projection, and
        # what overlaps what
        marks = [i for i, e in enumerate(evs) if "ArgMax" in e.name or "_argmax_pick_kernel" in e.name]
        step: list[dict[str, Any]] = []
        if len(marks) >= 3:
            lo, hi = marks[len(marks) // 2 - 1], marks[len(marks) // 2]
            t0 = evs[lo + 1].time_range.start if hi > lo + 1 else 0.0
            step = [
                {"k": e.name[:70], "t": round(e.time_range.start - t0, 1), "d": round(e.time_range.end - e.time_range.start, 1)}
                for e in evs[lo + 1 : hi + 1]
            ]  # fmt: skip
        out = {
            "span_ms": round(span / 1e3, 4),
            "union_busy_ms": round(busy / 1e3, 4),
            "idle_ms_by_gap": {k: round(v, 4) for k, v in buckets.items()},
            "gaps_by_size": counts,
            "largest_gaps": [
                {"us": round(g, 1), "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]
            ],
            "one_step": step,
        }
    rt: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith("cuda"):
            d = rt.setdefault(e.name, [0, 0.0])
            d[0] += 1
            d[1] += (e.time_range.end - e.time_range.start) / 1e3
    out["runtime_calls"] = {
        k: {"calls": int(n), "ms": round(ms, 4)}
        for k, (n, ms) in sorted(rt.items(), key=lambda x: -x[1][1])[:top]
    }
    return out


def zero_indexer_queries(model_dir: Path) -> None:
    """Zero every `indexer.wq_b` weight of a checkpoint in place: all indexer logits are then 0 and
    the top-k is the earliest keys, the same set at every step (a stand-in for the step-to-step
    overlap of a trained model's top-k, to time HiSparse's bookkeeping when nearly everything hits)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(model_dir.glob("*.safetensors")):
        sd = load_file(f)
        hit = [k for k in sd if ".indexer.wq_b." in k]
        for k in hit:
            sd[k] = torch.zeros_like(sd[k])
        if hit:
            save_file(sd, f, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--phase", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--tokens", type=int, default=16384, help="prompt length (decode: the context)")
    ap.add_argument("--batch", type=int, default=1, help="decode: requests stepped together")
    ap.add_argument("--steps", type=int, default=32, help="decode: steps profiled")
    ap.add_argument("--prefill-form", default="auto")
    ap.add_argument("--sparse-mla-heads-min", type=int, default=None)
    ap.add_argument(
        "--hisparse-device-tokens", type=int, default=None, help="profile the HiSparse-capped path"
    )
    ap.add_argument(
        "--stable-topk",
        action="store_true",
        help="zero the indexer's query projection so every step selects the same keys (HiSparse at ~100%% hits)",
    )
    ap.add_argument(
        "--prompt",
        choices=("random", "ruler"),
        default="random",
        help="random bytes, or RULER niah_single_1 prompts (a trained byte-level --model: its real top-k "
        "overlap from step to step, so HiSparse's real hit rate)",
    )
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--config", default="configs/small-1m.json", help="config of the random checkpoint")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    ap.add_argument("--out", type=Path, default=None)
    # (e.g. the narrowing's cost: --index-topk-long K --index-topk-long-from P below --tokens)
    add_selection_args(ap)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/step_profile.py needs CUDA (or --device cpu for a smoke run)")
        return 0

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    from longctx.kernels import sparse_mla as sm

    from bench.common import check_selection
    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig
    from longctx.engine.request import Request, SamplingParams
    from longctx.errors import LongctxError

    if args.sparse_mla_heads_min is not None:
        sm.HEADS_MIN_QUERIES = args.sparse_mla_heads_min
    try:  # (the selection flags against the config, before a random checkpoint is written: one line)
        check_selection(args.model or ROOT / args.config, args)
    except LongctxError as e:
        print(f"step_profile: {e}", file=sys.stderr)
        return 2
    model_dir = args.model
    if model_dir is None:
        model_dir = scratch_dir() / "model"
        init_random_checkpoint(ModelConfig.from_json(ROOT / args.config), model_dir, seed=0)
    if args.stable_topk:
        zero_indexer_queries(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = iter(range(7, 1 << 30))  # --prompt ruler: a new haystack per request (no prefix reuse)

    def make_prompt(n: int) -> list[int]:
        if args.prompt == "ruler":
            from bench.common import niah_byte_prompt

            return niah_byte_prompt(n, seed=next(prompts))
        return torch.randint(0, 256, (n,), generator=gen).tolist()

    res: dict = {
        "phase": args.phase,
        "tokens": args.tokens,
        "batch": args.batch,
        "prefill_form": args.prefill_form,
        "heads_min": sm.HEADS_MIN_QUERIES,
        "prompt": args.prompt,
        "model": str(args.model) if args.model else f"random {args.config}",
    }
    dtype = "bfloat16" if cuda else "float32"
    res["hisparse_device_tokens"] = args.hisparse_device_tokens
    res["stable_topk"] = args.stable_topk
    res["selection"] = {k: v for k, v in selection_kwargs(args).items() if v is not None}
    with Engine(
        model_dir,
        device=args.device,
        dtype=dtype,
        prefill_form=args.prefill_form,
        hisparse_device_tokens=args.hisparse_device_tokens,
        **selection_kwargs(args),
    ) as eng:

        def prefill(n: int, tag: str) -> float:
            ids = make_prompt(n)
            eng.add_request(Request(tag, ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
            sync()
            t = time.perf_counter()
            while not any(o.finished for o in eng.step()):
                pass
            sync()
            return time.perf_counter() - t

        hs_decode: dict[str, int] = {}
        runs: dict[str, dict[str, int]] = {}

        def decode(tag: str, steps: int, wrap: Any = contextlib.nullcontext, synced: bool = False) -> float:
            """Seconds per decode step of `batch` requests at context `tokens`; only the decode steps
            run inside `wrap()` (the profiler), not the prefill before them. `synced`: the device is
            synced after every step (nothing of a step overlaps the next one's host work)."""
            for i in range(args.batch):
                ids = make_prompt(args.tokens)
                params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
                eng.add_request(Request(f"{tag}-{i}", ids, params))
            live = set(range(args.batch))
            while not all(len(eng._requests[f"{tag}-{i}"].output_ids) >= 1 for i in range(args.batch)):
                eng.step()  # prefill until every request has its first token
            sync()
            st0 = eng.stats()
            before = st0.get("hisparse") or {}
            stamps: list[float] = []
            with wrap():
                t, n = time.perf_counter(), 0
                for _ in range(steps):
                    outs = eng.step()
                    if synced:
                        sync()
                    stamps.append(time.perf_counter())
                    n += 1
                    live -= {int(o.rid.rsplit("-", 1)[1]) for o in outs if o.finished}
                    if not live:
                        break
                sync()
                dt = (time.perf_counter() - t) / max(1, n)
            st1 = eng.stats()
            after = st1.get("hisparse") or {}
            hs_decode.clear()  # the hits and misses of the timed decode steps only
            hs_decode.update({k: after[k] - before.get(k, 0) for k in ("hits", "misses") if k in after})
            # how the timed steps ran: graph replays, graphs dropped and captured again, continuations
            # launched with device-fed tokens (a wall time far above GPU busy time shows up here)
            g0, g1 = st0.get("cuda_graphs", {}), st1.get("cuda_graphs", {})
            runs[tag] = {
                "steps": n,
                "device_fed_steps": st1["device_fed_steps"] - st0["device_fed_steps"],
                **{k: g1[k] - g0.get(k, 0) for k in ("replays", "recaptures", "buckets") if k in g1},
                **step_spread(t, stamps),
                **host_ms_per_step(st0, st1, n),
            }
            while eng.has_work():
                eng.step()
            return dt

        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=acts)
        if args.phase == "prefill":
            prefill(min(2048, args.tokens), "warm")
            prefill(args.tokens, "warm2")
            with prof:
                dt = prefill(args.tokens, "prof")
            plain = prefill(args.tokens, "plain")
        else:
            decode("warm", 8)  # compiles and captures this (batch, context) bucket
            dt = decode("prof", args.steps, lambda: prof)
            plain = decode("plain", args.steps)
            res["synced_s"] = decode("synced", args.steps, synced=True)
            res["decode_runs"] = runs
            if hs_decode:
                hits, misses = hs_decode["hits"], hs_decode["misses"]
                res["hisparse"] = {"hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses)}
    res["seconds_profiled"] = dt
    res["seconds"] = plain
    per = args.tokens if args.phase == "prefill" else args.batch
    res["tok_s"] = per / plain
    # self time per op: device kernels on the GPU; on the CPU (smoke run) the ops' own CPU time
    from torch.autograd import DeviceType

    rows = []
    total = 0.0
    for e in prof.key_averages():
        if cuda:
            # kernels only: a CPU op's self device time repeats the kernels it launched
            if e.device_type != DeviceType.CUDA:
                continue
            t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((t, e.key, e.count))
            total += t
    rows.sort(reverse=True)
    res["busy_s"] = total / 1e6  # the profiled region: one prefill, or the decode steps
    res["top"] = [
        {"kernel": k[:120], "ms": t / 1e3, "share": t / total, "calls": c} for t, k, c in rows[: args.top]
    ]
    res["launches"] = sum(c for _, _, c in rows)
    res["timeline"] = timeline(prof)
    res["groups"] = kernel_groups(rows)
    if args.phase == "prefill":
        what = f"prefill {args.tokens} tokens: {plain:.3f} s ({per / plain:.0f} tok/s)"
    else:
        what = (
            f"decode batch {args.batch} at {args.tokens}: {plain * 1e3:.3f} ms/step ({per / plain:.0f} tok/s)"
        )
    if "synced_s" in res:
        what += f", synced {res['synced_s'] * 1e3:.3f} ms/step"
    if "hisparse" in res:
        what += f", HiSparse hit rate {res['hisparse']['hit_rate']:.3f}"
    print(f"{what}; {'GPU' if cuda else 'CPU'} busy {total / 1e3:.2f} ms in the profiled region")
    tl_ = res["timeline"]
    if "span_ms" in tl_:
        print(
            f"trace: span {tl_['span_ms']:.2f} ms, kernels' union {tl_['union_busy_ms']:.2f} ms; idle by gap size "
            + ", ".join(
                f"{k} {v:.2f} ms ({tl_['gaps_by_size'][k]})" for k, v in tl_["idle_ms_by_gap"].items()
            )
        )
        for g in tl_["largest_gaps"][:5]:
            print(f"  gap {g['us']:8.1f} us after {g['after'][:50]} before {g['before'][:50]}")
    print(
        "runtime: "
        + ", ".join(f"{k} {v['calls']}x {v['ms']:.2f} ms" for k, v in tl_["runtime_calls"].items())
    )
    for tag, r in res.get("decode_runs", {}).items():
        print(f"decode run {tag}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    for g, d in res["groups"].items():
        print(f"{d['ms']:9.2f} ms {100 * d['share']:5.1f}% {int(d['launches']):6d}  [{g}]")
    for r in res["top"]:
        print(f"{r['ms']:9.2f} ms {100 * r['share']:5.1f}% {r['calls']:6d}  {r['kernel']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        cap = f"-cap{args.hisparse_device_tokens}" if args.hisparse_device_tokens else ""
        cap += "-stable" if args.stable_topk else ""
        cap += "-ruler" if args.prompt == "ruler" else ""
        cap += f"-long{args.index_topk_long}" if args.index_topk_long else ""
        name = f"step-profile-{args.phase}-{args.tokens}-b{args.batch}-{args.prefill_form}{cap}.json"
        (args.out / name).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
