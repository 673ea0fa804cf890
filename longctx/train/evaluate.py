"""A quick NIAH check of a checkpoint through `longctx.Engine` (the real sparse, paged path).

Samples come from the RULER generator with a held-out seed (training draws its own per-row
seeds), are sent raw (no chat template, as training formats them) and decoded greedily; the
score is RULER's string_match_all in percent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longctx.workloads.ruler_tasks import TASKS, RulerGenerator
from longctx.workloads.scoring import METRICS
from longctx.workloads.tokens import ByteCounter

EVAL_SEED = 987_654_321
DEFAULT_EVAL_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1")


def niah_eval(
    model_dir: str | Path,
    lengths: tuple[int, ...] = (1024,),
    tasks: tuple[str, ...] = DEFAULT_EVAL_TASKS,
    samples: int = 4,
    device: str = "auto",
    dtype: str = "auto",
    max_new_tokens: int = 48,
    seed: int = EVAL_SEED,
    dense: bool = False,
) -> dict[str, Any]:
    """Scores per `task@length` (0-100), their mean under "avg", and a few predictions. A task whose
    smallest sample does not fit a length (e.g. niah_multikey_1 at 512) is listed under "skipped"
    instead of failing the whole evaluation. `dense=True` evaluates the same weights with an `index_topk`
    above every prompt, i.e. dense attention: what the model retrieves when its indexer loses nothing."""
    from longctx import Engine
    from longctx.workloads.fit import LengthError

    gen = RulerGenerator(ByteCounter(), seed=seed, max_new_tokens_scale=0.5)  # as training fits prompts
    items = []
    skipped: list[str] = []
    for L in lengths:
        for t in tasks:
            try:
                drawn = [gen.sample(t, L, i) for i in range(samples)]
            except LengthError:
                skipped.append(f"{t}@{L}")
                continue
            items += [(t, L, s, list((s.input + s.answer_prefix).encode("utf-8"))) for s in drawn]
    if not items:
        return {"avg": 0.0, "skipped": skipped, "examples": []}
    max_context = max(lengths) + max_new_tokens + 64
    topk = max_context if dense else None
    with Engine(model_dir, device=device, dtype=dtype, max_context=max_context, index_topk=topk) as eng:
        outs = eng.generate([p for *_, p in items], max_new_tokens=max_new_tokens, temperature=0.0)
    scores: dict[str, list[float]] = {}
    examples: list[dict[str, Any]] = []
    for (t, L, s, _), o in zip(items, outs):
        text = bytes(b for b in o.token_ids if b < 256).decode("utf-8", errors="replace")
        scores.setdefault(f"{t}@{L}", []).append(METRICS[TASKS[t].metric](text, list(s.outputs)))
        if len(examples) < 4:
            examples.append({"task": t, "length": L, "want": list(s.outputs), "got": text})
    out: dict[str, Any] = {k: round(100 * sum(v) / len(v), 1) for k, v in scores.items()}
    out["avg"] = round(sum(out.values()) / max(1, len(out)), 1)
    out["examples"] = examples
    if skipped:
        out["skipped"] = skipped
    return out
