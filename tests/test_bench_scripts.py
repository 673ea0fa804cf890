"""The GPU bench scripts' CPU paths: each runs end to end on a tiny model so a device call does not
find a broken script. Seconds each; nothing is written into bench/results."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIP = ROOT / "models-shipped" / "retrieval-wip"


def test_step_profile_prefill_and_decode_on_cpu(tmp_path: Path) -> None:
    from bench.step_profile import main

    common = ["--device", "cpu", "--config", "configs/tiny.json", "--top", "5", "--out", str(tmp_path)]
    assert main(["--phase", "prefill", "--tokens", "300", *common]) == 0
    assert main(["--phase", "decode", "--tokens", "200", "--batch", "2", "--steps", "4", *common]) == 0
    files = sorted(p.name for p in tmp_path.glob("step-profile-*.json"))
    assert files == ["step-profile-decode-200-b2-auto.json", "step-profile-prefill-300-b1-auto.json"]
    d = json.loads((tmp_path / files[0]).read_text())
    assert d["seconds"] > 0 and d["busy_s"] > 0 and len(d["top"]) == 5


def test_retrieval_eval_run_and_merge(tmp_path: Path) -> None:
    from bench.retrieval_eval import main

    run = ["run", "--model", str(WIP), "--samples", "1", "--concurrency", "2"]
    tasks = "niah_single_1,niah_multikey_1"
    assert main([*run, "--lengths", "1k", "--tasks", tasks, "--out", str(tmp_path / "u")]) == 0
    # a capped run (cap > index_topk is required, so at least 257 device tokens)
    assert main([*run, "--lengths", "3k", "--tasks", "niah_single_1", "--cap-fraction", "0.1",
                 "--out", str(tmp_path / "c")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "c" / "run.json").read_text())["device_tokens"] == {"3072": 307}
    assert main(["merge", str(tmp_path / "u"), str(tmp_path / "c"), "--out", str(tmp_path / "m")]) == 0
    res = json.loads((tmp_path / "m" / "retrieval-h200.json").read_text())
    assert {"niah_single_1.1k", "niah_multikey_1.1k", "niah_single_1.3k_capped"} <= set(res)
    assert res["samples"]["niah_single_1.1k"] == 1 and 0 <= res["niah_single_1.1k"] <= 100
    assert (tmp_path / "m" / "retrieval-h200.png").stat().st_size > 0


def test_train_report_on_the_committed_logs(tmp_path: Path) -> None:
    from bench.train_report import main

    logs = sorted((ROOT / "bench" / "results" / "training").glob("run*.jsonl"))
    assert len(logs) >= 2
    assert main([f"{p.stem}={p}" for p in logs] + ["--out", str(tmp_path / "curves")]) == 0
    table = (tmp_path / "curves.md").read_text()
    assert all(p.stem in table for p in logs) and (tmp_path / "curves.png").exists()
