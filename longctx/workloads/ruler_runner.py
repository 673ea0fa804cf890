"""Run the RULER suite against a client: resumable, concurrent, with a report and a plot.

Results are appended to `OUT/results.jsonl` one row per finished sample, so an interrupted run
resumes where it stopped: a rerun skips every (task, length, index) already there. At the end
`OUT/results.json` (task x length scores, sample counts, mean latencies, effective lengths) and
`OUT/ruler.png` (score vs length per task) are written from all rows in the file, each sample once.
One run at a time writes a directory: a second run into it while the first runs is refused. What the
rows depend on besides their samples (the model, seed, prompt form, engine flags) is recorded beside
them (`OUT/results.jsonl.run.json`), and a run under other settings is refused.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longctx.config import is_int
from longctx.errors import LongctxError
from longctx.workloads.clients import Client, GenRequest, GenResult, run_parallel
from longctx.workloads.jsonl import Effective, claim_settings, open_append, read_rows, sole_writer
from longctx.workloads.ruler_tasks import TASKS, RulerGenerator, Sample
from longctx.workloads.scoring import EFFECTIVE_THRESHOLD, METRICS, effective_length

Key = tuple[str, int, int]
RESULTS = "results.jsonl"  # in the output directory; its settings record beside it (results.jsonl.run.json)
RequestMaker = Callable[[Sample], GenRequest]


@dataclass(frozen=True)
class RunPlan:
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    concurrency: int = 1
    indices: tuple[int, ...] | None = None  # these sample indices instead of 0..samples-1


def plan_keys(plan: RunPlan) -> list[Key]:
    """Every (task, length, index), shortest lengths first so early results are useful.

    Within a length the tasks take turns, a batch (`concurrency` samples of one task) at a time,
    so a run stopped part-way has scores for every task rather than all samples of the first few.
    With `indices`, those sample indices (in their order) instead of 0..samples-1.
    """
    c = max(1, plan.concurrency)
    idx = list(plan.indices) if plan.indices is not None else list(range(plan.samples))
    return [
        (t, L, i)
        for L in plan.lengths
        for j in range(0, len(idx), c)
        for t in plan.tasks
        for i in idx[j : j + c]
    ]


def _key(row: dict) -> Key:
    return (row["task"], int(row["length"]), int(row["index"]))


def read_results(path: Path) -> list[dict]:
    """The rows of a results (or dumped samples) file that name a sample: `read_rows`' objects whose task is a
    string and length and index integers, with a number for score where there is one. A row without them
    (a damaged or foreign line) is passed over like a torn one; it failed as a KeyError on resume."""
    return [r for r in read_rows(path) if _names_a_sample(r)]


def _names_a_sample(row: dict) -> bool:
    score = row.get("score", 0)
    return (
        isinstance(row.get("task"), str)
        and is_int(row.get("length"))
        and is_int(row.get("index"))
        and isinstance(score, (int, float))
        and not isinstance(score, bool)
    )


def unique_rows(rows: list[dict]) -> list[dict]:
    """Each sample's last row: a sample found twice (the rows of two runs joined into one file)
    counts once."""
    return list({_key(r): r for r in rows}.values())


def result_row(sample: Sample, res: GenResult) -> dict:
    refs = list(sample.outputs)
    score = METRICS[TASKS[sample.task].metric](res.text, refs)
    return {
        "task": sample.task,
        "length": sample.length,
        "index": sample.index,
        "seed": sample.seed,
        "pred": res.text,
        "outputs": refs,
        "score": score,
        "prompt_tokens": res.prompt_tokens if res.prompt_tokens is not None else sample.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "latency_s": round(res.latency_s, 4),
        "finish_reason": res.finish_reason,
    }


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sample", disable=not sys.stderr.isatty())


def dump_samples(gen: RulerGenerator, keys: Iterable[Key], dump_dir: Path) -> int:
    """Write samples as JSONL (`DIR/samples.jsonl`), skipping keys already dumped. Returns count."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    path = dump_dir / "samples.jsonl"
    have = {_key(r) for r in read_results(path) if r.get("seed") == gen.seed}
    todo = [k for k in keys if k not in have]
    with open_append(path) as f, _progress(len(todo), "dump") as bar:
        for k in todo:
            f.write(json.dumps(gen.sample(*k).to_json()) + "\n")
            f.flush()
            bar.update(1)
    return len(todo)


def run_samples(
    gen: RulerGenerator,
    client: Client,
    keys: list[Key],
    out_dir: Path,
    make_request: RequestMaker,
    concurrency: int = 1,
    settings: dict[str, Any] | None = None,
    effective: Effective | None = None,
) -> int:
    """Run every key not yet in `out_dir/results.jsonl`; returns how many ran now. `settings` (what the
    rows depend on besides their keys: the model, seed, prompt form, engine flags) are recorded beside
    the file, and a rerun under other ones is refused before anything runs: it would mix two models'
    scores in one report (compared as they take effect, with `effective`: `jsonl.check_settings`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with sole_writer(out_dir / ".ruler.lock", out_dir):
        if settings is not None:
            claim_settings(out_dir / RESULTS, settings, "longctx ruler", effective)
        return _run_unlocked(gen, client, keys, out_dir, make_request, concurrency)


def _run_unlocked(
    gen: RulerGenerator,
    client: Client,
    keys: list[Key],
    out_dir: Path,
    make_request: RequestMaker,
    concurrency: int,
) -> int:
    path = out_dir / RESULTS
    rows = read_results(path)
    seeds = {r.get("seed") for r in rows}
    if rows and seeds != {gen.seed}:
        raise LongctxError(
            f"{path} holds results for seed {sorted(seeds, key=str)[0]}, not {gen.seed}; use another --out"
        )
    done = {_key(r) for r in rows}
    todo = [k for k in keys if k not in done]
    with open_append(path) as f, _progress(len(todo), "ruler") as bar:

        def write(sample: Sample, res: GenResult) -> None:
            f.write(json.dumps(result_row(sample, res)) + "\n")
            f.flush()
            bar.update(1)

        if client.parallel:
            lazily = (gen.sample(*k) for k in todo)  # (built on this thread as the workers need them)
            run_parallel(
                lazily,
                lambda s: client.generate([make_request(s)])[0],
                write,
                max(1, concurrency),
                client.stop,
            )
        else:
            for batch in _batches(todo, max(1, concurrency)):
                samples = [gen.sample(*k) for k in batch]
                for s, r in zip(samples, client.generate([make_request(s) for s in samples])):
                    write(s, r)
    return len(todo)


def _batches(keys: list[Key], size: int) -> Iterator[list[Key]]:
    # Batches never mix tasks or lengths: one output budget and similar prompt lengths each.
    batch: list[Key] = []
    for k in keys:
        if batch and (len(batch) == size or batch[0][:2] != k[:2]):
            yield batch
            batch = []
        batch.append(k)
    if batch:
        yield batch


# ---- report ----------------------------------------------------------------------------------
def summarize(rows: list[dict], meta: dict | None = None) -> dict:
    """Aggregate result rows (`unique_rows`): per task and length the score (percent), sample count
    and latency."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in unique_rows(rows):
        if "score" in r:  # (a results row; `read_results` also reads dumped samples, which have none)
            groups[(r["task"], int(r["length"]))].append(r)
    tasks = [t for t in TASKS if any(k[0] == t for k in groups)]
    lengths = sorted({k[1] for k in groups})
    scores: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    latency: dict[str, dict[str, float]] = {}
    for (t, L), rs in sorted(groups.items()):
        key = str(L)
        scores.setdefault(t, {})[key] = round(100 * sum(r["score"] for r in rs) / len(rs), 2)
        counts.setdefault(t, {})[key] = len(rs)
        lat = [r["latency_s"] for r in rs if r.get("latency_s") is not None]
        latency.setdefault(t, {})[key] = round(sum(lat) / len(lat), 4) if lat else None  # type: ignore[assignment]
    average = {}
    for L in lengths:
        vals = [scores[t][str(L)] for t in tasks if str(L) in scores[t]]
        if len(vals) == len(tasks):  # an average over a partial task set would not compare
            average[str(L)] = round(sum(vals) / len(vals), 2)
    eff: dict[str, int | None] = {
        t: effective_length({int(L): s for L, s in scores[t].items()}) for t in tasks
    }
    eff["average"] = effective_length({int(L): s for L, s in average.items()}) if average else None
    return {
        **(meta or {}),
        "tasks": tasks,
        "lengths": lengths,
        "scores": {t: scores[t] for t in tasks},
        "samples": {t: counts[t] for t in tasks},
        "mean_latency_s": {t: latency[t] for t in tasks},
        "average": average,
        "threshold": EFFECTIVE_THRESHOLD,
        "effective_length": eff,
    }


def plot(summary: dict, path: Path) -> None:
    """Score vs length per task (log-2 length axis), the average bold, the threshold dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    from matplotlib import colormaps

    colors = colormaps["tab20"]
    styles = {"niah": "-", "vt": "--", "cwe": "-.", "fwe": "-.", "qa": ":"}
    for i, t in enumerate(summary["tasks"]):
        pts = sorted((int(L), s) for L, s in summary["scores"][t].items())
        style = styles[TASKS[t].family]
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            style,
            marker="o",
            color=colors(i),
            linewidth=1.2,
            label=t,
        )
    if summary["average"]:
        pts = sorted((int(L), s) for L, s in summary["average"].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="black", linewidth=3, label="average")
    ax.axhline(summary["threshold"], color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    lengths = summary["lengths"]
    ax.set_xticks(lengths)
    ax.set_xticklabels([format_length(L) for L in lengths])
    ax.set_ylim(-2, 102)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score (%)")
    ax.set_title(f"RULER — {summary.get('model', '')}".rstrip(" —"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def format_length(n: int) -> str:
    """4096 -> '4K', 1048576 -> '1M', 5000 -> '5000'."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def write_report(out_dir: Path, meta: dict) -> dict:
    """results.json and ruler.png from every row of results.jsonl; returns the summary."""
    summary = summarize(read_results(out_dir / RESULTS), meta)
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    if summary["tasks"]:
        plot(summary, out_dir / "ruler.png")
    return summary


def table(summary: dict) -> str:
    """A plain-text score table (tasks x lengths) for the terminal."""
    lengths = [str(L) for L in summary["lengths"]]
    head = f"{'task':<18}" + "".join(f"{format_length(int(L)):>9}" for L in lengths) + "   effective"
    lines = [head]
    for t in summary["tasks"] + (["average"] if summary["average"] else []):
        row = summary["scores"].get(t, summary["average"] if t == "average" else {})
        cells = "".join(f"{row[L]:>9.1f}" if L in row else f"{'-':>9}" for L in lengths)
        eff = summary["effective_length"].get(t)
        lines.append(f"{t:<18}{cells}   {format_length(eff) if eff else '-'}")
    return "\n".join(lines)
