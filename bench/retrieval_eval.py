"""RULER-style retrieval scores of a trained checkpoint through longctx (issue 10's measurement).

`run` scores the listed tasks at each length through `longctx ruler` (the embedded engine, raw
prompts as training formats them, greedy, RULER's string_match_all), one engine per length so a
HiSparse cap can be a fraction of that length; results.jsonl in the run directory is resumable, so a
run cut off by the device tool's 10-minute limit keeps every sample it finished. `merge` combines
run directories (capped and uncapped, from different GPUs or calls) into
bench/results/retrieval-h200.{json,md} and a PNG of score vs length.

    python -m bench.retrieval_eval run --model DIR --lengths 4k,32k,128k --samples 20 --out R/uncapped
    python -m bench.retrieval_eval run --model DIR --lengths 1m --samples 3 --cap-fraction 0.1 --out R/capped
    python -m bench.retrieval_eval merge R/uncapped R/capped [--out bench/results]
    python -m bench.retrieval_eval gate R/uncapped --length 4k --min 20   # exit 0: scores reach 20
    python -m bench.retrieval_eval depth R/uncapped/results.jsonl   # niah scores by the needle's depth

Keys of the JSON: `<task>.<len>` (0-100; at 1m the HiSparse-capped run, elsewhere the uncapped one),
`<task>.1m_uncapped` / `<task>.<len>_capped` for the other kind, `avg_niah.<len>` (the mean over the
tasks when every task has a score at that length), `samples.<task>.<len>`, and
`capped_minus_uncapped.1m` (over the samples scored both ways, same seed and index: per task the mean
difference, then the mean over tasks; `capped_minus_uncapped_pairs.1m` counts them), and `selection.<task>.<len>`
(the engine flags, e.g. index_topk_long, a score was taken with where not the checkpoint's own: `merge`
refuses runs that select differently at one length).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.workloads.cli_args import SELECTION_ENGINE_KW, SELECTION_ENV, selection_env  # noqa: E402

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
)
ONE_M = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
RUN_META = "run.json"
# run.json's keys that change how the same weights select or store: `run`'s engine flags, passed on to
# `longctx ruler` as --index-topk ... --kv-dtype --kv-fp8-skip-layers
SELECTION_KEYS = SELECTION_ENGINE_KW
# training fits prompts with half RULER's output budget (longctx/train/data.py); evaluation does too
MAX_NEW_TOKENS_SCALE = "0.5"
# --documents sends no answer prefix: the model writes RULER's answer sentence (~80 bytes) before the
# value, so it gets RULER's whole budget (128 tokens for niah)
DOCUMENTS_MAX_NEW_TOKENS_SCALE = "1.0"


def length_name(n: int) -> str:
    return f"{n >> 20}m" if n % ONE_M == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)


def result_key(length: int, capped: bool) -> str:
    """'128k', '1m', '1m_uncapped', '4k_capped': the headline at 1M is the capped run, elsewhere the uncapped."""
    if capped == (length >= ONE_M):
        return length_name(length)
    return length_name(length) + ("_capped" if capped else "_uncapped")


def run(args: argparse.Namespace) -> int:
    from longctx.cli import main as cli
    from longctx.seeds import SEED_RANGE, is_seed
    from longctx.workloads.ruler_cli import parse_lengths, prompt_form

    if not is_seed(args.seed):  # (before the run's record is written: `longctx ruler` would refuse it)
        print(f"run: error: --seed {args.seed}: must be {SEED_RANGE}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = parse_lengths(args.lengths)
    meta = {"model": str(args.model), "cap_fraction": args.cap_fraction, "tasks": list(args.tasks.split(","))}
    # the same weights with each full layer selecting another top-k, each query's newest positions kept,
    # another KV cache dtype (CUDA's default: fp8): recorded, and passed on to `longctx ruler`
    engine_flags: list[str] = []
    for name in SELECTION_KEYS:
        value = getattr(args, name)
        if value is not None:
            meta[name] = value
            engine_flags += ["--" + name.replace("_", "-"), str(value)]
    meta.update(selection_env())  # recorded in run.json like the flags
    meta["chat"] = bool(args.chat)
    meta["form"] = prompt_form(args.chat, args.documents)
    scale = DOCUMENTS_MAX_NEW_TOKENS_SCALE if args.documents else MAX_NEW_TOKENS_SCALE
    meta["max_new_tokens_scale"] = float(scale)
    meta["device_tokens"] = {}
    rc = 0
    for L in lengths:
        argv = [
            "ruler", "--model", str(args.model), "--tasks", args.tasks, "--lengths", str(L),
            "--samples", str(args.samples), "--concurrency", str(args.concurrency),
            "--max-new-tokens-scale", scale, "--seed", str(args.seed), "--out", str(out),
        ]  # fmt: skip
        if args.indices:
            argv += ["--indices", args.indices]
        if args.chat or args.documents:
            argv.append("--chat" if args.chat else "--documents")
        argv += engine_flags
        if args.cap_fraction:
            cap = max(1, int(args.cap_fraction * L))
            meta["device_tokens"][str(L)] = cap
            argv += ["--hisparse-device-tokens", str(cap)]
        (out / RUN_META).write_text(json.dumps(meta, indent=2) + "\n")
        t = time.perf_counter()
        rc = cli(argv) or rc
        print(f"retrieval_eval: {length_name(L)} done in {time.perf_counter() - t:.0f}s", flush=True)
    return rc


def collect(run_dirs: list[Path]) -> dict:
    """Per (task, length, capped): the scores of every finished sample, from each run's results.jsonl;
    `selection`: per such key the engine flags (SELECTION_KEYS) of the runs that scored it."""
    from longctx.workloads.ruler_cli import prompt_form
    from longctx.workloads.ruler_runner import read_results, unique_rows

    scores: dict[tuple[str, int, bool], list[float]] = {}
    latency: dict[tuple[str, int, bool], list[float]] = {}
    # (task, length, capped) -> {(seed, index): score}: the same sample scored capped and uncapped pairs up
    by_sample: dict[tuple[str, int, bool], dict[tuple[int, int], float]] = {}
    forms: set[str] = set()  # the prompt forms of the runs (raw, chat, documents)
    selection: dict[tuple[str, int, bool], set[tuple]] = {}
    for d in run_dirs:
        meta = json.loads((d / RUN_META).read_text()) if (d / RUN_META).exists() else {}
        capped = bool(meta.get("cap_fraction"))
        sel = tuple((k, meta[k]) for k in (*SELECTION_KEYS, *SELECTION_ENV) if meta.get(k) is not None)
        if meta:  # (a directory without run.json does not say; one from before "form" has "chat")
            forms.add(meta.get("form") or prompt_form(bool(meta.get("chat")), False))
        for r in unique_rows(read_results(d / "results.jsonl")):
            k = (r["task"], int(r["length"]), capped)
            scores.setdefault(k, []).append(float(r["score"]))
            selection.setdefault(k, set()).add(sel)
            if "index" in r:
                by_sample.setdefault(k, {})[(int(r.get("seed", 42)), int(r["index"]))] = float(r["score"])
            if r.get("latency_s") is not None:
                latency.setdefault(k, []).append(float(r["latency_s"]))
    return {
        "scores": scores,
        "latency": latency,
        "forms": forms,
        "by_sample": by_sample,
        "selection": selection,
    }


def capped_minus_uncapped(by_sample: dict, length: int) -> tuple[float, int] | None:
    """Capped minus uncapped score (0-100) at `length` over the samples scored both ways: per task the mean
    over its paired samples, then the mean over tasks; and how many pairs there were. None: no pairs."""
    per_task, pairs = [], 0
    for (task, n, capped), cap in sorted(by_sample.items()):
        if not capped or n != length:
            continue
        unc = by_sample.get((task, n, False), {})
        both = sorted(set(cap) & set(unc))
        if both:
            per_task.append(100 * sum(cap[s] - unc[s] for s in both) / len(both))
            pairs += len(both)
    return (round(sum(per_task) / len(per_task), 1), pairs) if per_task else None


def gate(args: argparse.Namespace) -> int:
    """Exit 0 when the mean score over the tasks run at `--length` reaches `--min` (0-100), else 1.

    bench/session.sh asks this after a quick 4K run, before spending minutes of device time on the
    long lengths for a model that does not retrieve."""
    from longctx.workloads.ruler_cli import parse_lengths

    (L,) = parse_lengths(args.length)
    got = collect([Path(args.run)])["scores"]
    per_task = {t: 100 * sum(v) / len(v) for (t, n, _), v in got.items() if n == L and v}
    if not per_task:
        print(f"gate: no finished samples at {length_name(L)} in {args.run}")
        return 1
    mean = sum(per_task.values()) / len(per_task)
    ok = mean >= args.min
    print(
        f"gate: mean {mean:.1f} over {len(per_task)} tasks at {length_name(L)} "
        f"{'>=' if ok else '<'} {args.min:g}: {'go on' if ok else 'stop'}"
    )
    return 0 if ok else 1


def merge(args: argparse.Namespace) -> int:
    got = collect([Path(d) for d in args.runs])
    if len(got["forms"]) > 1:
        print(
            f"merge: runs of different prompt forms ({', '.join(sorted(got['forms']))}) score different "
            "prompts; merge them apart",
            file=sys.stderr,
        )
        return 2
    mixed = sorted(k for k, sels in got["selection"].items() if len(sels) > 1)
    if mixed:
        task, L, capped = mixed[0]
        print(
            f"merge: {task} at {length_name(L)}{' capped' if capped else ''} comes from runs that select "
            "differently (--index-topk / --index-local-window / --index-topk-long / --kv-dtype / "
            "--kv-fp8-skip-layers, LONGCTX_TOPK_LONG_DECODE); merge them apart",
            file=sys.stderr,
        )
        return 2
    (form,) = got["forms"] or {"raw"}
    res: dict = {
        "tasks": list(TASKS),
        "chat": form == "chat",
        "form": form,
        "samples": {},
        "mean_latency_s": {},
    }
    by_len: dict[tuple[int, bool], dict[str, float]] = {}
    for (task, L, capped), v in sorted(got["scores"].items()):
        key = f"{task}.{result_key(L, capped)}"
        res[key] = round(100 * sum(v) / len(v), 1)
        res["samples"][key] = len(v)
        (sel,) = got["selection"][(task, L, capped)]
        if sel:  # the engine flags it was scored with, where not the checkpoint's own
            res.setdefault("selection", {})[key] = dict(sel)
        lat = got["latency"].get((task, L, capped))
        if lat:
            res["mean_latency_s"][key] = round(sum(lat) / len(lat), 2)
        by_len.setdefault((L, capped), {})[task] = res[key]
    for (L, capped), row in sorted(by_len.items()):
        if all(t in row for t in TASKS):
            res[f"avg_niah.{result_key(L, capped)}"] = round(sum(row.values()) / len(row), 1)
    paired = capped_minus_uncapped(got["by_sample"], ONE_M)
    if paired is not None:  # over the samples run both ways (the runs may hold different numbers of them)
        res["capped_minus_uncapped.1m"], res["capped_minus_uncapped_pairs.1m"] = paired
    lengths = sorted({L for L, _ in by_len})
    head = "| task | " + " | ".join(length_name(L) for L in lengths) + " |"
    rows = [head, "|---" * (len(lengths) + 1) + "|"]
    for t in TASKS:
        cells = []
        for L in lengths:
            u, c = by_len.get((L, False), {}).get(t), by_len.get((L, True), {}).get(t)
            cell = "-" if u is None else f"{u:.0f}"
            if c is not None:
                cell = f"{c:.0f} capped" if u is None else f"{u:.0f} / {c:.0f} capped"
            cells.append(cell)
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    print(table)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(table + "\n")
    plot(by_len, out / f"{args.name}.png")
    return 0


DEPTH_BINS = (0.1, 0.3, 0.5, 0.7, 0.9)  # upper edges; the last bin runs to 1.0


def depth(args: argparse.Namespace) -> int:
    """Scores of a run's niah samples by where the needle's value stands in the prompt (0: its start, 1:
    just before the question), from the samples regenerated with the run's seed, tokenizer and output
    budget (raw prompts). Prints a table per (task, length) and writes it as JSON with --out."""
    from longctx.workloads.ruler_runner import format_length, read_results
    from longctx.workloads.ruler_tasks import TASKS as RULER_TASKS
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    rows = read_results(Path(args.results))
    rows = [r for r in rows if RULER_TASKS.get(r["task"]) and RULER_TASKS[r["task"]].family == "niah"]
    if not rows:
        print(f"depth: no niah rows in {args.results}", file=sys.stderr)
        return 2
    gens: dict[int, RulerGenerator] = {}
    counter = load_counter(args.tokenizer)
    table: dict[str, dict[str, list[int]]] = {}
    edges = (*DEPTH_BINS, 1.0)
    for r in rows:
        seed = int(r.get("seed", 42))
        gen = gens.setdefault(seed, RulerGenerator(counter, seed=seed, max_new_tokens_scale=args.scale))
        s = gen.sample(r["task"], int(r["length"]), int(r["index"]))
        text = s.input + s.answer_prefix
        at = text.find(s.outputs[0])
        if at < 0:
            continue
        d = at / len(text)
        lo = 0.0
        for hi in edges:
            if d < hi or hi == 1.0:
                break
            lo = hi
        key = f"{r['task']} {format_length(int(r['length']))}"
        cell = table.setdefault(key, {}).setdefault(f"{lo:.1f}-{hi:.1f}", [0, 0])
        cell[0] += int(float(r["score"]) >= 1)
        cell[1] += 1
    names = [f"{lo:.1f}-{hi:.1f}" for lo, hi in zip((0.0, *DEPTH_BINS), edges)]
    lines = [
        "| task, length | " + " | ".join(f"depth {n}" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for key, cells in sorted(table.items()):
        lines.append(
            f"| {key} | "
            + " | ".join(f"{cells[n][0]} / {cells[n][1]}" if n in cells else "-" for n in names)
            + " |"
        )
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": args.results, "right_of": table}, indent=2) + "\n")
    return 0


def plot(by_len: dict[tuple[int, bool], dict[str, float]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for capped, style in ((False, "-o"), (True, "--s")):
        for t in TASKS:
            pts = sorted((L, row[t]) for (L, c), row in by_len.items() if c == capped and t in row)
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    label=t + (" (capped 10%)" if capped else ""),
                )
    ax.set_xscale("log", base=2)
    ax.set_ylim(-2, 102)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score (%)")
    ax.set_title("retrieval model through longctx")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=110)


def main(argv: list[str] | None = None) -> int:
    from longctx.config import KV_DTYPE_NAMES, kv_dtype_name
    from longctx.engine.args import add_selection_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="score tasks at lengths into a resumable run directory")
    r.add_argument("--model", required=True)
    r.add_argument("--lengths", default="4k,32k,128k")
    r.add_argument("--tasks", default=",".join(TASKS))
    r.add_argument("--samples", type=int, default=20)
    r.add_argument(
        "--indices", default=None, help="these sample indices (comma list) instead of 0..samples-1"
    )
    r.add_argument("--concurrency", type=int, default=8)
    r.add_argument("--seed", type=int, default=42)
    r.add_argument(
        "--cap-fraction", type=float, default=None, help="HiSparse device tokens as a fraction of L"
    )
    forms = r.add_mutually_exclusive_group()
    forms.add_argument(
        "--chat", action="store_true", help="prompts in the model's chat template (`longctx ruler --chat`)"
    )
    forms.add_argument(
        "--documents",
        action="store_true",
        help="niah tasks as long-document QA, the prompt /v1/documents + /ask build (`longctx ruler --documents`)",
    )
    add_selection_args(r)  # (the same weights selecting otherwise: passed on to `longctx ruler`)
    r.add_argument(
        "--kv-dtype",
        type=kv_dtype_name,
        choices=KV_DTYPE_NAMES,
        default=None,
        help="score the same weights with this KV cache dtype (`longctx ruler --kv-dtype`; CUDA's default fp8)",
    )
    r.add_argument(
        "--kv-fp8-skip-layers",
        default=None,
        metavar="L,..",
        help="layers an fp8 cache keeps in the model dtype, or 'none' (`longctx ruler --kv-fp8-skip-layers`; "
        "default the model's)",
    )
    r.add_argument("--out", required=True)
    r.set_defaults(func=run)
    g = sub.add_parser("gate", help="exit 0 when a run's mean score at a length reaches --min")
    g.add_argument("run")
    g.add_argument("--length", default="4k")
    g.add_argument("--min", type=float, default=20.0)
    g.set_defaults(func=gate)
    m = sub.add_parser("merge", help="combine run directories into NAME.{json,md,png} (retrieval-h200)")
    m.add_argument("runs", nargs="+")
    m.add_argument("--out", default=None, help="directory for the results (default bench/results)")
    m.add_argument("--name", default="retrieval-h200", help="the results' file stem (NAME.json, .md, .png)")
    m.set_defaults(func=merge)
    d = sub.add_parser("depth", help="a run's niah scores by the needle's depth in the prompt (raw form)")
    d.add_argument("results", help="a results.jsonl (run directory's, or a committed eval-*.jsonl)")
    d.add_argument("--tokenizer", default=str(RESULTS.parents[1] / "models-shipped" / "retrieval-wip"))
    d.add_argument("--scale", type=float, default=float(MAX_NEW_TOKENS_SCALE), help="the run's output scale")
    d.add_argument("--out", default=None, help="write the table as JSON here")
    d.set_defaults(func=depth)
    args = ap.parse_args(argv)
    from longctx.errors import LongctxError

    try:
        return int(args.func(args) or 0)
    except LongctxError as e:  # (a bad --lengths / --length, an unknown task: one line, not a traceback)
        print(f"retrieval_eval: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
