"""The GPU bench scripts' CPU paths: each runs end to end on a tiny model so a device call does not
find a broken script. Seconds each; nothing is written into bench/results."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

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
    assert d["launches"] >= sum(r["calls"] for r in d["top"])
    assert abs(sum(g["share"] for g in d["groups"].values()) - 1) < 1e-2
    # the narrowing's decode steps (tiny.json: top 16; from position 100 on the top 8): named and recorded
    narrow = ["--index-topk-long", "8", "--index-topk-long-from", "100"]
    assert main(["--phase", "decode", "--tokens", "200", "--steps", "4", *narrow, *common]) == 0
    d = json.loads((tmp_path / "step-profile-decode-200-b1-auto-long8.json").read_text())
    assert d["selection"] == {"index_topk_long": 8, "index_topk_long_from": 100} and d["seconds"] > 0
    assert main(["--phase", "decode", "--tokens", "200", "--index-topk-long", "16", *common]) == 2  # one line


def test_step_profile_capped_stable_topk_hits_on_cpu(tmp_path: Path) -> None:
    """--stable-topk zeroes the indexer's queries: every decode step selects the same (earliest)
    keys, so after the first step a capped HiSparse decode nearly always hits."""
    from bench.step_profile import main

    args = ["--device", "cpu", "--config", "configs/tiny.json", "--top", "3", "--out", str(tmp_path)]
    args += ["--phase", "decode", "--tokens", "400", "--steps", "6", "--hisparse-device-tokens", "96"]
    assert main([*args, "--stable-topk"]) == 0
    d = json.loads((tmp_path / "step-profile-decode-400-b1-auto-cap96-stable.json").read_text())
    assert d["stable_topk"] and d["hisparse"]["hits"] > 0
    assert d["hisparse"]["hit_rate"] > 0.9, d["hisparse"]
    runs = d["decode_runs"]  # how the timed steps ran (graph replays / recaptures on CUDA)
    assert set(runs) == {"warm", "prof", "plain", "synced"} and runs["plain"]["steps"] > 0
    assert 0 <= runs["plain"]["device_fed_steps"] <= runs["plain"]["steps"]
    # the loop timed as the engine runs it and synced step by step, with the host's share per step
    assert d["seconds"] > 0 and d["synced_s"] > 0 and runs["synced"]["steps"] == runs["plain"]["steps"]
    assert runs["synced"]["token_wait_ms"] >= 0


def test_step_profile_trained_model_on_ruler_prompts_on_cpu(tmp_path: Path) -> None:
    """--prompt ruler --model <trained>: the capped decode profiled as the QA service runs it (a real
    haystack, the trained indexer's top-k), recorded with the model and prompt form."""
    from bench.step_profile import main

    args = ["--device", "cpu", "--model", str(WIP), "--top", "3", "--out", str(tmp_path)]
    args += ["--phase", "decode", "--tokens", "1200", "--steps", "4", "--hisparse-device-tokens", "400"]
    assert main([*args, "--prompt", "ruler"]) == 0
    d = json.loads((tmp_path / "step-profile-decode-1200-b1-auto-cap400-ruler.json").read_text())
    assert d["prompt"] == "ruler" and "retrieval-wip" in d["model"]
    assert d["hisparse"]["hits"] > 0 and 0 < d["hisparse"]["hit_rate"] <= 1


def test_prefill_chunk_sweep_on_cpu(tmp_path: Path) -> None:
    from bench.prefill_chunks import main

    args = ["--device", "cpu", "--config", "configs/tiny.json", "--tokens", "300", "--out", str(tmp_path)]
    assert main([*args, "--chunks", "64,128"]) == 0
    d = json.loads((tmp_path / "prefill-chunks-300.json").read_text())
    assert set(d["sweep"]) == {"64", "128"} and all(v["tok_s"] > 0 for v in d["sweep"].values())
    assert d["best_chunk"] in (64, 128) and len(d["chunk_ms_first_last"]) == 2
    assert abs(sum(g["share"] for g in d["groups"].values()) - 1) < 1e-2
    assert main([*args, "--chunks", "0"]) == 2  # a bad sweep is refused with a message


def test_gemm_shapes_lists_the_decode_projections_on_cpu(tmp_path: Path) -> None:
    from bench.gemm_shapes import main

    assert (
        main(["--device", "cpu", "--config", "configs/tiny.json", "--batch", "1", "--out", str(tmp_path)])
        == 0
    )
    (d,) = json.loads((tmp_path / "gemm-shapes.json").read_text())  # one entry per --config
    kinds = {r["kind"]: r for r in d["shapes"]}
    # as the GPU decode runs them: absorbed W_UK/W_UV, not kv_b_proj; gate+up as one GEMM
    assert not any("kv_b_proj" in k or k.endswith(("gate_proj", "up_proj")) for k in kinds)
    assert kinds["self_attn.w_uk (absorbed)"]["batch"] == 4 and kinds["self_attn.q_a_proj"]["per_step"] == 6
    assert kinds["mlp.gate_up"]["n"] == 2 * 128 and d["per_step_ms"]["cublas_m1"] > 0
    # every plain projection timed through cuBLAS, gemv, and as fp8 through fp8_block_linear and gemv
    assert {"cublas_us_m1", "gemv_us_m1", "fp8_gemm_us_m1", "gemv_fp8_us_m1"} <= set(kinds["lm_head"])


def test_sampling_bench_on_cpu(tmp_path: Path) -> None:
    """bench.sampling's CPU path: both paths draw the same tokens for every kind of row, logits and batch
    (top-p rows with and without the candidates route, which times them twice), and the penalties and
    the greedy floor are timed at each batch."""
    from bench.sampling import main

    assert main(["--device", "cpu", "--vocab", "3000", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "sampling-cpu.json").read_text())
    assert len(d["rows"]) == 30 and all(r["same"] == 1.0 and r["batched_ms"] > 0 for r in d["rows"])
    assert {r["logits"] for r in d["rows"]} == {"flat", "peaked"}
    assert all((r["batched_sort_ms"] is not None) == ("top_p" in r["rows"]) for r in d["rows"])
    assert [p["batch"] for p in d["penalties"]] == [1, 8, 32] == [g["batch"] for g in d["greedy"]]
    assert all(p["kernel_equals_torch"] and p["apply_record_kernel_ms"] > 0 for p in d["penalties"])


def test_step_profile_groups_kernels_by_model_part() -> None:
    from bench.step_profile import kernel_groups

    assert list(kernel_groups([(1.0, "_fused_kernel", 1)])) == ["indexer + top-k + sorts"]
    g = kernel_groups([(3000.0, "_indexer_kernel", 3), (1000.0, "sparse_mla_heads_kernel", 8),
                       (500.0, "nvjet_sm90_tst_128x8", 10), (500.0, "vectorized_elementwise_kernel", 40)])  # fmt: skip
    assert g["indexer + top-k + sorts"]["share"] == 0.6 and g["sparse MLA"]["launches"] == 8
    assert list(g)[0] == "indexer + top-k + sorts" and "other (elementwise etc.)" in g


def test_retrieval_eval_merge_pairs_capped_and_uncapped_samples(tmp_path: Path) -> None:
    """`capped_minus_uncapped.1m` compares the samples scored both ways (same seed and index), not the two
    runs' means over different samples: uncapped 0-4 (4 right), capped 0-7 (7 right, sample 2 wrong). The
    uncapped file holds sample 0's row twice (two runs' rows joined): it counts once."""
    from bench.retrieval_eval import main

    L = 1 << 20
    uncapped = {("niah_single_1", i): float(i != 0) for i in range(5)}
    uncapped.update({("niah_multikey_1", i): 0.0 for i in range(3)})
    capped = {("niah_single_1", i): float(i != 2) for i in range(8)}
    capped.update({("niah_multikey_1", i): float(i == 1) for i in range(4)})
    for name, rows, cap in (("u", uncapped, None), ("c", capped, 0.1)):
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"cap_fraction": cap, "form": "raw"}))
        lines = [json.dumps({"task": t, "length": L, "index": i, "seed": 42, "score": s}) + "\n"
                 for (t, i), s in rows.items()]  # fmt: skip
        (d / "results.jsonl").write_text("".join(lines + lines[:1] * (name == "u")))
    m = ["merge", str(tmp_path / "u"), str(tmp_path / "c"), "--out", str(tmp_path / "m"), "--name", "r"]
    assert main(m) == 0
    res = json.loads((tmp_path / "m" / "r.json").read_text())  # (--name: the files' stem)
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"r.json", "r.md", "r.png"}
    # niah_single_1 over 0-4: capped 4 right of 5 (0 right, 2 wrong), uncapped 4: 0; multikey over 0-2:
    # capped 1 of 3, uncapped 0: +33.3; the mean of the two
    assert res["capped_minus_uncapped.1m"] == round((0.0 + 100 / 3) / 2, 1)
    assert res["capped_minus_uncapped_pairs.1m"] == 8
    assert res["niah_single_1.1m"] == 87.5 and res["niah_single_1.1m_uncapped"] == 80.0  # (all samples)


def test_retrieval_eval_records_the_environment_s_selection(tmp_path: Path, monkeypatch) -> None:
    """A run under LONGCTX_TOPK_LONG_DECODE=0 records it, and merge keeps it apart from the default's."""
    from bench.retrieval_eval import main

    monkeypatch.setattr("longctx.cli.main", lambda argv: 0)  # (no model run: the run's record alone)
    run = ["run", "--model", str(WIP), "--lengths", "1k", "--samples", "1"]
    monkeypatch.setenv("LONGCTX_TOPK_LONG_DECODE", "0")
    assert main([*run, "--out", str(tmp_path / "w")]) == 0
    assert json.loads((tmp_path / "w" / "run.json").read_text())["topk_long_decode"] == "0"
    monkeypatch.delenv("LONGCTX_TOPK_LONG_DECODE")
    assert main([*run, "--out", str(tmp_path / "d")]) == 0
    assert "topk_long_decode" not in json.loads((tmp_path / "d" / "run.json").read_text())
    row = json.dumps({"task": "niah_single_1", "length": 1024, "index": 0, "seed": 42, "score": 1.0})
    for d in ("w", "d"):
        (tmp_path / d / "results.jsonl").write_text(row + "\n")
    assert main(["merge", str(tmp_path / "w"), str(tmp_path / "d"), "--out", str(tmp_path / "m")]) == 2


def test_retrieval_eval_run_and_merge(tmp_path: Path) -> None:
    from bench.retrieval_eval import main

    run = ["run", "--model", str(WIP), "--samples", "1", "--concurrency", "2"]
    tasks = "niah_single_1,niah_multikey_1"
    u = tmp_path / "u"
    assert main([*run, "--lengths", "1k", "--tasks", tasks, "--out", str(u)]) == 0
    # a rerun with more samples resumes: `longctx ruler`'s settings record (results.jsonl.run.json) is its
    # own, beside retrieval_eval's run.json, and holds what the run's lengths share
    assert main([*run, "--lengths", "1k", "--tasks", tasks, "--samples", "2", "--out", str(u)]) == 0
    assert len((u / "results.jsonl").read_text().splitlines()) == 4
    assert json.loads((u / "results.jsonl.run.json").read_text())["form"] == "raw"
    assert json.loads((u / "run.json").read_text())["tasks"] == tasks.split(",")
    # a capped run (cap > index_topk is required, so at least 257 device tokens)
    assert main([*run, "--lengths", "3k", "--tasks", "niah_single_1", "--cap-fraction", "0.1",
                 "--out", str(tmp_path / "c")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "c" / "run.json").read_text())["device_tokens"] == {"3072": 307}
    # the same weights with each full layer selecting another top-k (`longctx ruler --index-topk`), on the
    # sample index 2 alone (`--indices`)
    t = tmp_path / "t"
    assert (
        main(
            [
                *run,
                "--lengths",
                "1k",
                "--tasks",
                "niah_single_1",
                "--index-topk",
                "64",
                "--index-local-window",
                "16",
                "--kv-dtype",
                "bf16",
                "--kv-fp8-skip-layers",
                "1",
                "--index-topk-long",
                "32",
                "--index-topk-long-from",
                "512",
                "--indices",
                "2",
                "--out",
                str(t),
            ]
        )  # fmt: skip
        == 0
    )
    assert json.loads((t / "run.json").read_text())["index_topk"] == 64
    assert json.loads((t / "run.json").read_text())["index_local_window"] == 16
    assert json.loads((t / "run.json").read_text())["kv_dtype"] == "bf16"
    assert json.loads((t / "run.json").read_text())["index_topk_long"] == 32  # (from 512 on: narrowed)
    rows = (t / "results.jsonl").read_text().splitlines()
    assert [json.loads(r)["index"] for r in rows] == [2]  # (--indices)
    assert main([*run, "--lengths", "1k", "--index-topk", "0", "--out", str(tmp_path / "z")]) == 2
    assert main(["merge", str(tmp_path / "u"), str(tmp_path / "c"), "--out", str(tmp_path / "m")]) == 0
    res = json.loads((tmp_path / "m" / "retrieval-h200.json").read_text())
    assert {"niah_single_1.1k", "niah_multikey_1.1k", "niah_single_1.3k_capped"} <= set(res)
    assert "selection" not in res  # (the checkpoint's own)
    # a sample scored with other engine flags does not merge with the checkpoint's own at its length
    assert main(["merge", str(tmp_path / "u"), str(t), "--out", str(tmp_path / "m2")]) == 2
    assert main(["merge", str(t), "--out", str(tmp_path / "m3")]) == 0
    sel = json.loads((tmp_path / "m3" / "retrieval-h200.json").read_text())["selection"]["niah_single_1.1k"]
    assert sel == {"index_topk": 64, "index_local_window": 16, "index_topk_long": 32,
                   "index_topk_long_from": 512, "kv_dtype": "bf16", "kv_fp8_skip_layers": "1"}  # fmt: skip
    assert res["samples"]["niah_single_1.1k"] == 2 and 0 <= res["niah_single_1.1k"] <= 100
    assert (tmp_path / "m" / "retrieval-h200.png").stat().st_size > 0 and res["chat"] is False
    # the chat form: ruler's --chat prompts, recorded; it is never merged with raw-prompt runs
    assert (
        main([*run, "--lengths", "1k", "--tasks", "niah_single_1", "--chat", "--out", str(tmp_path / "h")])
        == 0
    )
    row = json.loads((tmp_path / "h" / "results.jsonl").read_text().splitlines()[0])
    assert (
        json.loads((tmp_path / "h" / "run.json").read_text())["chat"] is True
        and row["task"] == "niah_single_1"
    )
    assert main(["merge", str(tmp_path / "u"), str(tmp_path / "h"), "--out", str(tmp_path / "x")]) == 2
    # the documents form (the QA endpoint's prompt): recorded as its own form, never merged with others
    assert main([*run, "--lengths", "1k", "--tasks", "niah_single_2", "--documents",
                 "--out", str(tmp_path / "d")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "d" / "run.json").read_text())["form"] == "documents"
    assert main(["merge", str(tmp_path / "h"), str(tmp_path / "d"), "--out", str(tmp_path / "x")]) == 2
    assert main(["merge", str(tmp_path / "d"), "--out", str(tmp_path / "y")]) == 0
    assert json.loads((tmp_path / "y" / "retrieval-h200.json").read_text())["form"] == "documents"


def test_retrieval_eval_depth_bins_a_runs_niah_scores(tmp_path: Path) -> None:
    """`retrieval_eval depth`: a run's niah samples regenerated (seed, length, index) and their scores
    counted by where the needle's value stands in the prompt; a run without niah rows is refused."""
    from bench.retrieval_eval import main

    rows = [
        {"task": "niah_single_1", "length": 1024, "index": i, "seed": 42, "score": float(i % 2)}
        for i in range(4)
    ]
    rows.append({"task": "vt", "length": 1024, "index": 0, "seed": 42, "score": 1.0})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["depth", str(path), "--out", str(tmp_path / "d.json")]) == 0
    got = json.loads((tmp_path / "d.json").read_text())["right_of"]
    (cells,) = got.values()  # one (task, length): vt has no needle depth
    assert list(got) == ["niah_single_1 1K"] and sum(n for _, n in cells.values()) == 4
    assert sum(r for r, _ in cells.values()) == 2
    (tmp_path / "vt.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    assert main(["depth", str(tmp_path / "vt.jsonl")]) == 2


def test_train_report_on_the_committed_logs(tmp_path: Path) -> None:
    from bench.train_report import main

    logs = sorted((ROOT / "bench" / "results" / "training").glob("run*.jsonl"))
    assert len(logs) >= 2
    assert main([f"{p.stem}={p}" for p in logs] + ["--out", str(tmp_path / "curves")]) == 0
    table = (tmp_path / "curves.md").read_text()
    assert all(p.stem in table for p in logs) and (tmp_path / "curves.png").exists()


def _two_gpu_python(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in python for bench/session.sh: logs "$CUDA_VISIBLE_DEVICES argv" to `calls`, says 2
    GPUs, and a `longctx.train` run leaves a checkpoint and a log in its --out."""
    fake = tmp_path / "py"
    calls = tmp_path / "calls"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$CUDA_VISIBLE_DEVICES $*" >> {calls}\n'
        'if [ "$1" = "-c" ]; then echo 2; exit 0; fi\n'
        'if [ "$2" = "longctx.train" ]; then o=$(echo "$@" | sed "s/.*--out \\([^ ]*\\).*/\\1/"); '
        'mkdir -p $o; echo w > $o/model.safetensors; echo "{}" > $o/train_log.jsonl; fi\n'
    )
    fake.chmod(0o755)
    return fake, calls


def _gpu_case(tmp_path: Path, ngpu: int) -> tuple[Path, Path, Path]:
    """`_two_gpu_python` in tmp_path/<ngpu>, saying `ngpu` GPUs: (its python, its calls log, a session dir)."""
    case = tmp_path / str(ngpu)
    case.mkdir()
    fake, calls = _two_gpu_python(case)
    fake.write_text(fake.read_text().replace("echo 2; exit 0", f"echo {ngpu}; exit 0"))
    return fake, calls, case / "s"


def _gate_failing_python(tmp_path: Path, calls: Path | None = None, train_seconds: int = 0) -> Path:
    """A stand-in python for bench/session.sh on one GPU whose model fails the 4K gate: a `longctx.train`
    run leaves a checkpoint in its --out after `train_seconds`; with `calls`, each call logs
    "$CUDA_VISIBLE_DEVICES $PWD argv" there."""
    fake = tmp_path / "py"
    log = f'echo "$CUDA_VISIBLE_DEVICES $PWD $*" >> {calls}\n' if calls else ""
    fake.write_text(
        "#!/usr/bin/env bash\n" + log + 'if [ "$1" = "-c" ]; then echo 1; exit 0; fi\n'
        'if [ "$3" = "gate" ]; then exit 1; fi\n'
        'if [ "$2" = "longctx.train" ]; then o=$(echo "$@" | sed "s/.*--out \\([^ ]*\\).*/\\1/"); '
        f"mkdir -p $o; echo w > $o/model.safetensors; sleep {train_seconds}; fi\n"
    )
    fake.chmod(0o755)
    return fake


def _wait_for_calls(calls: Path, seen: str, times: int = 1, seconds: float = 60) -> None:
    """Wait (`seconds` at most) until `seen` is in a stand-in python's calls log `times` times."""
    import time

    deadline = time.time() + seconds
    while time.time() < deadline and (not calls.exists() or calls.read_text().count(seen) < times):
        time.sleep(0.5)


def _session_until(
    env: dict[str, str], calls: Path, seen: str, times: int = 1, cwd: Path = ROOT
) -> list[str]:
    """`bench/session.sh start` with `env` in the tree `cwd`, wait (60 s at most) until `seen` is in the
    stand-in python's calls log `times` times, then `stop`: the log's lines."""
    import subprocess

    subprocess.run(["bash", "bench/session.sh", "start"], cwd=cwd, env=env, check=True, capture_output=True)
    _wait_for_calls(calls, seen, times)
    subprocess.run(["bash", "bench/session.sh", "stop"], cwd=cwd, env=env, check=True, capture_output=True)
    return calls.read_text().splitlines()


def test_session_script_runs_both_lanes_in_order(tmp_path: Path) -> None:
    """bench/session.sh with a stand-in python that logs its arguments: with two GPUs lane A trains
    then evaluates on GPU 0 and lane B checks on GPU 1 then waits for the model; `collect` packs."""
    import os
    import subprocess
    import tarfile
    import time

    fake, calls = _two_gpu_python(tmp_path)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(tmp_path / "s"), "OUT": str(tmp_path / "out")}
    run = lambda *a: subprocess.run(["bash", "bench/session.sh", *a], cwd=ROOT, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True)  # fmt: skip
    run("start")
    _wait_for_calls(calls, "--cap-fraction")
    run("stop")
    # stop ends this session's processes only (it once matched every `longctx.cli` on the machine)
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "s")], capture_output=True, text=True).stdout
    assert left.strip() == ""
    lines = calls.read_text().splitlines()
    gpu0 = [x for x in lines if x.startswith("0 ") and not x.startswith("0 -c ")]
    # the placement check's verdict is read before the first capped run
    assert any(x.startswith("0 -c ") and x.endswith("gpu-kernel-check.json") for x in lines), lines
    gpu1 = [x for x in lines if x.startswith("1 ")]
    # the fused selection checked on lane A's GPU before training selects with it (--select auto)
    assert "gpu_kernel_check --only train_select" in gpu0[0]
    gpu0 = gpu0[1:]
    assert "longctx.train" in gpu0[0] and "--init-from models-shipped/retrieval-wip" in gpu0[0]
    assert (
        "--needle-weight 1.0 --needle-form bytes --pose-max 1048576 --pose-far 0 --chat-fraction 0.25 "
        "--document-fraction 0.25 --copy-hex-fraction 0 "
        "--curriculum 0:4096,1000:16384,2500:65536,4000:131072,5000:262144 --replay-fraction 0.3 "
        in gpu0[0]
        and "--select auto --seed 26 --index-local-window 64 --kl-share" in gpu0[0]
    )  # one argv
    # the selection window: graphs against eager decode with it on this GPU, before any score
    assert "bench.gpu_check --only window" in gpu0[1]
    del gpu0[1]
    # a quick 4K score, the gate on it, then the long lengths
    assert "--lengths 4k " in gpu0[1] and "retrieval_eval gate" in gpu0[2]
    # 32K, then HiSparse at 128K on a RULER prompt, then the 128K scores (the longest) last
    # (the placement kernels checked on the GPU before the first capped run)
    assert (
        "--lengths 32k " in gpu0[3]
        and "--documents" in gpu0[4]
        and "gpu_kernel_check --only place" in gpu0[5]
    )
    # then the kept victim candidates (their own check: a failure turns only them off)
    assert "gpu_kernel_check --only keep_cand" in gpu0[6]
    del gpu0[6]
    assert "long_context" in gpu0[6]
    # the trained model's 128K decode profiled capped, then uncapped, on RULER prompts
    assert all("step_profile" in x and "--prompt ruler" in x for x in gpu0[7:9])
    assert "--hisparse-device-tokens 13106" in gpu0[7] and "--hisparse" not in gpu0[8]
    assert "place_bench --m 256" in gpu0[9] and "--block-n" not in gpu0[9]
    # the capped 128K decode again with the candidates not forked (LONGCTX_HISPARSE_FORK=0, the A/B)
    assert "long_context" in gpu0[10] and str(tmp_path / "s" / "long_context_nofork") in gpu0[10]
    assert "step_profile" in gpu0[11] and "--hisparse-device-tokens 13106" in gpu0[11]
    assert str(tmp_path / "s" / "profiles_nofork") in gpu0[11]
    del gpu0[10:12]
    # and selecting the victim candidates every step (LONGCTX_CAND_KEEP=0, the kept lists' A/B)
    assert "long_context" in gpu0[10] and str(tmp_path / "s" / "long_context_nokeep") in gpu0[10]
    assert "step_profile" in gpu0[11] and str(tmp_path / "s" / "profiles_nokeep") in gpu0[11]
    del gpu0[10:12]
    assert "--lengths 128k " in gpu0[10]
    assert "bench.hit_rate" in gpu0[11] and "--tokens 131072" in gpu0[11] and "--device cuda" in gpu0[11]
    # niah_single_1 between 128K and 1M, the trained model's needle recall at 1M (the question's share of
    # the last row's selection), then (bounded) the engine against the training forward at 1M
    assert "--lengths 256k,512k " in gpu0[12] and "--out " + str(tmp_path / "s" / "eval" / "mid") in gpu0[12]
    assert "bench.needle_recall" in gpu0[13] and "--lengths 1m --samples 1" in gpu0[13]
    assert "--model " + str(tmp_path / "s" / "train" / "ckpt") in gpu0[13]
    # the trained model's parity, its last prompt row and the answer's space row (the decode step too)
    assert "bench.long_parity --model " + str(tmp_path / "s" / "train" / "ckpt") + " --lengths 1m" in gpu0[14]
    assert "--answer-row" in gpu0[14] and "--with-question" not in gpu0[14]
    assert "--forms engine,engine_bf16kv,train" in gpu0[14]  # (the engine with bf16 KV too)
    assert "--lengths 1m " in gpu0[15] and "--index-topk" not in gpu0[15]  # (TOPK_1M: off by default)
    assert "gpu_kernel_check" in gpu1[0] and "gpu_check" in gpu1[1] and "step_profile" in gpu1[2]
    assert "--cap-fraction 0.1" in gpu1[-1]
    assert any("vs_transformers" in x for x in gpu1) and any("bench.kernels --skip" in x for x in gpu1)
    # the shipped model's needle recall at 32K and 128K on the checks' GPU, before the capped 1M lane
    needle, needle_1m = [x for x in gpu1 if "bench.needle_recall" in x]
    assert "--lengths 32k,128k" in needle and "--model models-shipped/retrieval-wip" in needle
    assert "--lengths 1m --samples 2" in needle_1m and gpu1.index(needle_1m) < len(gpu1) - 1
    (speed,) = [x for x in gpu1 if "bench.train_speed" in x]  # the chunked against the fused selection
    assert "--impls gather,fused" in speed and "131072" in speed and gpu1.index(speed) < len(gpu1) - 1
    # the capped 1M lane started only once the model existed
    assert lines.index(gpu1[-1]) > lines.index(gpu0[0])
    out = run("collect").stdout
    assert "results.tgz" in out and "model.tar.00" in out
    with tarfile.open(tmp_path / "out" / "results.tgz") as t:
        names = t.getnames()
    assert "./logs/lane_a.log" in names and "./logs/train_log.jsonl" in names


def _capped_first_session(tmp_path: Path, gpus: int) -> tuple[list[str], Path]:
    """A session with CHECKS=0 CAPPED_FIRST=3 BF16KV_FIRST=2 on `gpus` fake GPUs, run until the trained model's
    capped 1M lane starts: the fake python's calls ("$CUDA_VISIBLE_DEVICES argv", `-c` probes left out) and
    the session directory."""
    import os
    import subprocess

    fake, calls = _two_gpu_python(tmp_path)
    fake.write_text(fake.read_text().replace("echo 2; exit 0", f"echo {gpus}; exit 0"))
    s = tmp_path / "s"
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(tmp_path / "out"),
           "CHECKS": "0", "CAPPED_FIRST": "3", "BF16KV_FIRST": "2"}  # fmt: skip
    run = lambda *a: subprocess.run(["bash", "bench/session.sh", *a], cwd=ROOT, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True)  # fmt: skip
    run("start")
    _wait_for_calls(calls, "--cap-fraction", 2, seconds=90)
    run("stop")
    return [x for x in calls.read_text().splitlines() if " -c " not in f" {x}"], s


def test_session_capped_first_scores_the_shipped_model_under_the_cap_before_the_trained_one(
    tmp_path: Path,
) -> None:
    """CAPPED_FIRST=N with two GPUs and no checks: lane B's GPU first scores N niah_single_1 samples of the
    shipped model at 1M under a 10% HiSparse cap (its own directory), BF16KV_FIRST=M then M uncapped with a
    bf16 KV cache, then the trained model's capped 1M."""
    lines, s = _capped_first_session(tmp_path, gpus=2)
    gpu1 = [x for x in lines if x.startswith("1 ")]
    first, bf16kv, trained = gpu1[:3]
    assert "--model models-shipped/retrieval-wip --lengths 1m --samples 3" in first
    assert (
        "--tasks niah_single_1 --cap-fraction 0.1" in first and f"--out {s}/eval/capped_1m_shipped" in first
    )
    # then uncapped with a bf16 KV cache (CUDA's default is fp8)
    assert "--model models-shipped/retrieval-wip --lengths 1m --samples 2" in bf16kv
    assert "--kv-dtype bf16" in bf16kv and "--cap-fraction" not in bf16kv
    assert f"--out {s}/eval/bf16kv_1m_shipped" in bf16kv
    assert f"--model {s}/train/ckpt --lengths 1m" in trained and f"--out {s}/eval/capped_1m" in trained


def test_session_one_gpu_scores_the_shipped_model_after_the_training_and_timed_figures(
    tmp_path: Path,
) -> None:
    """CAPPED_FIRST / BF16KV_FIRST on one GPU: the shipped model's 1M samples wait for lane A's timed figures
    (training, long_context and the step profiles), so they share the GPU with neither (beside the training
    they cost run 22 40% of its steps); then the trained model's capped 1M."""
    lines, s = _capped_first_session(tmp_path, gpus=1)
    shipped = [i for i, x in enumerate(lines) if "--model models-shipped/retrieval-wip --lengths 1m" in x]
    assert (
        len(shipped) == 2
        and "--cap-fraction 0.1" in lines[shipped[0]]
        and "--kv-dtype bf16" in lines[shipped[1]]
    )
    timed = [
        i for i, x in enumerate(lines) if "longctx.train" in x or "long_context" in x or "step_profile" in x
    ]
    assert len(timed) == 8 and max(timed) < min(
        shipped
    )  # (two with LONGCTX_HISPARSE_FORK=0, two CAND_KEEP=0)
    trained = [x for x in lines if f"--model {s}/train/ckpt --lengths 1m" in x and "--cap-fraction" in x]
    assert len(trained) == 1 and lines.index(trained[0]) > max(shipped)


def test_session_start_on_a_warm_machine_stops_the_earlier_session_and_moves_its_files(
    tmp_path: Path,
) -> None:
    """A second `start` while the first session's training still runs (a machine still warm from the last
    device call): the first one's processes end, its files move to <session>.earlier-*, and the new session
    starts with none of them (no samples "already done", no checkpoint it did not train)."""
    import os
    import subprocess
    import time

    calls = tmp_path / "calls"
    fake = _gate_failing_python(tmp_path, calls, train_seconds=60)
    s = tmp_path / "s"
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(tmp_path / "out"), "CHECKS": "0"}
    run = lambda *a: subprocess.run(["bash", "bench/session.sh", *a], cwd=ROOT, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True)  # fmt: skip
    run("start")
    try:
        _wait_for_calls(calls, "longctx.train")
        (s / "eval").mkdir()
        (s / "eval" / "results.jsonl").write_text("{}\n")
        (s / "triton-cache").mkdir(exist_ok=True)
        (s / "triton-cache" / "entry").write_text("k")
        first = subprocess.run(
            ["pgrep", "-f", str(s / "train")], capture_output=True, text=True
        ).stdout.split()
        assert first, "the first session's training is not running"
        said = run("start").stdout
        assert "an earlier session was on this machine" in said, said
        (old,) = tmp_path.glob("s.earlier-*")
        assert (old / "eval" / "results.jsonl").exists() and (old / "logs").is_dir()
        assert not (s / "eval").exists() and (s / "triton-cache" / "entry").read_text() == "k"
        time.sleep(0.5)
        assert not any(os.path.exists(f"/proc/{p}") for p in first), first
        _wait_for_calls(calls, "longctx.train", times=2)
        assert calls.read_text().count("longctx.train") == 2
    finally:
        run("stop")


def test_session_takes_exact_products_when_only_tf32x3_fails(tmp_path: Path) -> None:
    """Lane A's fused-selection check: if only the tf32x3 cases fail (the `_ieee` ones pass), training
    keeps the fused selection with --select-dot ieee; if those fail too, the chunked torch form."""
    import os

    for code, expect in (("3", "--select auto --seed 26"), ("1", "--select torch --seed 26")):
        case = tmp_path / code
        case.mkdir()
        fake, calls = _two_gpu_python(case)
        text = fake.read_text().splitlines()
        # the verdict's -c script names the _ieee cases: it exits `code`
        text.insert(2, f'case "$2" in *_ieee*) exit {code};; esac')
        fake.write_text("\n".join(text) + "\n")
        env = {**os.environ, "PYTHON": str(fake), "SESSION": str(case / "s"), "OUT": str(case / "out"),
               "CHECKS": "0", "EVAL": "0"}  # fmt: skip
        (train,) = [x for x in _session_until(env, calls, "longctx.train") if "longctx.train" in x]
        assert expect in train and (("--select-dot ieee" in train) == (code == "3")), train


def test_session_trains_a_task_mix_and_reads_key_binding(tmp_path: Path) -> None:
    """TRAIN_SEED / TASK_WEIGHTS / INIT_FROM / VT_HOPS / COPY_UPPER / COPY_PAIRS / TRAIN_EXTRA (last) reach the trainer's flags; KEY_BINDING=1 runs bench.key_binding on the
    trained model, then on the shipped one, after the 4K gate and before the 32K scores; KV_AB=1 scores 4K
    again with a bf16 KV cache right after the gate."""
    import os

    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(tmp_path / "out"), "CHECKS": "0",
           "CAPPED": "0", "TRAIN_SEED": "28", "TASK_WEIGHTS": "niah_multikey_1=3,niah_multikey_2=2",
           "KEY_BINDING": "1", "INIT_FROM": "models-candidates/run29", "VT_HOPS": "1,2",
           "COPY_UPPER": "0.5", "COPY_PAIRS": "0.8", "TRAIN_EXTRA": "--lead-weight 2 --lr 3e-4",
           "KV_AB": "1"}  # fmt: skip
    lines = _session_until(env, calls, "--lengths 32k")
    (train,) = [x for x in lines if "longctx.train" in x]
    assert "--seed 28 " in train, train
    assert train.endswith(
        "--task-weights niah_multikey_1=3,niah_multikey_2=2 --vt-hops 1,2 --copy-upper-fraction 0.5 "
        "--copy-pairs-fraction 0.8 --lead-weight 2 --lr 3e-4"
    ), train
    assert "--init-from models-candidates/run29 " in train
    kb = [i for i, x in enumerate(lines) if "bench.key_binding" in x]
    assert len(kb) == 2, lines
    assert f"--model {s}/train/ckpt " in lines[kb[0]]
    assert "--model models-shipped/retrieval-wip " in lines[kb[1]]
    gate = next(i for i, x in enumerate(lines) if "retrieval_eval gate" in x)
    at_32k = next(i for i, x in enumerate(lines) if "--lengths 32k" in x)
    assert gate < kb[0] < kb[1] < at_32k
    (kv,) = [i for i, x in enumerate(lines) if "--kv-dtype bf16" in x]
    assert gate < kv < kb[0] and "--lengths 4k --samples 20" in lines[kv] and f"{s}/eval/bf16kv" in lines[kv]
    # without the knobs: the default seed and mix, no key_binding
    fake, calls, s = _gpu_case(tmp_path, 2)
    env = {**env, "PYTHON": str(fake), "SESSION": str(s)}
    for k in (
        "TRAIN_SEED",
        "TASK_WEIGHTS",
        "KEY_BINDING",
        "INIT_FROM",
        "VT_HOPS",
        "COPY_UPPER",
        "COPY_PAIRS",
        "TRAIN_EXTRA",
        "KV_AB",
    ):
        env.pop(k)
    lines = _session_until(env, calls, "--lengths 32k")
    (train,) = [x for x in lines if "longctx.train" in x]
    assert "--seed 26 " in train and "--task-weights" not in train and "--vt-hops" not in train
    assert "--copy-upper" not in train and "--copy-pairs" not in train and "--lead-weight" not in train
    assert "--init-from models-shipped/retrieval-wip " in train
    assert not any("bench.key_binding" in x or "--kv-dtype" in x for x in lines)


def test_session_lane_b_starts_from_its_own_weights_and_curriculum(tmp_path: Path) -> None:
    """LANE_B=train with INIT_FROM_B set empty and CURRICULUM_B: lane B trains from the shipped weights on
    its own curriculum while lane A starts from INIT_FROM; the task mix reaches both."""
    import os

    fake, calls, s = _gpu_case(tmp_path, 2)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(tmp_path / "out"), "LANE_B": "train",
           "INIT_FROM": "models-candidates/run29", "INIT_FROM_B": "", "CURRICULUM_B": "0:2048,5000:131072",
           "TASK_WEIGHTS": "niah_multikey_1=3", "EVAL": "0"}  # fmt: skip
    lines = _session_until(env, calls, "longctx.train", times=2)
    (train_a,) = [x for x in lines if "longctx.train" in x and x.startswith("0 ")]
    (train_b,) = [x for x in lines if "longctx.train" in x and x.startswith("1 ")]
    assert "--init-from models-candidates/run29 " in train_a and "--curriculum 0:4096,1000:16384," in train_a
    assert (
        "--init-from models-shipped/retrieval-wip " in train_b
        and "--curriculum 0:2048,5000:131072 " in train_b
    )
    assert all("--task-weights niah_multikey_1=3" in x for x in (train_a, train_b))


def test_session_lane_b_trains_a_second_recipe(tmp_path: Path) -> None:
    """LANE_B=train on two GPUs: lane B trains TRAIN_ARGS_B (default: lane A's without its UUID copy rows) on GPU 1
    under $SESSION/b and scores it as lane A does; no checks, no HiSparse figures (HISPARSE=0 by
    default); `collect` packs both models, lane B's in $OUT/b, and both lanes' logs."""
    import os
    import subprocess
    import tarfile
    import time

    fake, calls = _two_gpu_python(tmp_path)
    s = tmp_path / "s"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "SESSION": str(s),
        "OUT": str(tmp_path / "out"),
        "LANE_B": "train",
        "TOPK_1M": "2048",
    }
    run = lambda *a: subprocess.run(["bash", "bench/session.sh", *a], cwd=ROOT, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True)  # fmt: skip
    run("start")
    deadline = time.time() + 60
    while time.time() < deadline and (
        not calls.exists() or calls.read_text().count("--lengths 1m --samples 10") < 2
    ):
        time.sleep(0.5)
    run("stop")
    lines = calls.read_text().splitlines()
    gpu0 = [x for x in lines if x.startswith("0 ") and not x.startswith("0 -c ")]
    gpu1 = [x for x in lines if x.startswith("1 ") and not x.startswith("1 -c ")]
    (train_a,) = [x for x in gpu0 if "longctx.train" in x]
    (train_b,) = [x for x in gpu1 if "longctx.train" in x]
    assert "--index-local-window 64" in train_a and "--lead-weight" not in train_a
    long, short = (
        "0:4096,1000:16384,2500:65536,4000:131072,5000:262144 ",
        "0:4096,1000:16384,3000:65536,6500:131072 ",
    )
    assert long in train_a and f"--out {s}/b/train/ckpt" in train_b
    # the same recipe otherwise (lane B's command is lane A's with rows to 128K only, with its own paths, on
    # its GPU): the A/B of the 256K rows
    assert "--kl-share" in train_a and "--needle-form bytes " in train_a and "--needle-form bytes " in train_b
    assert "--lr 2e-4 " in train_a and "--pose-far 0 " in train_a
    assert train_b.replace(f"{s}/b/", f"{s}/")[1:] == train_a[1:].replace(long, short)
    for lane, model in ((gpu0, s / "train" / "ckpt"), (gpu1, s / "b" / "train" / "ckpt")):
        assert "gpu_kernel_check --only train_select" in lane[0]
        evals = [x for x in lane if "retrieval_eval run" in x]
        lengths = ["4k", "32k", "4k", "128k", "256k,512k", "1m"]
        if lane is gpu0:  # TOPK_1M: lane A's 1M with the top 2048, before the parity and the 1M scores
            lengths.insert(5, "1m")
            (topk,) = [x for x in lane if "--index-topk 2048" in x]
            assert lane.index(topk) < next(i for i, x in enumerate(lane) if "bench.long_parity" in x)
        assert [x.split("--lengths ")[1].split()[0] for x in evals] == lengths
        assert any("bench.long_parity" in x for x in lane) == (lane is gpu0)
        assert all(f"--model {model}" in x for x in evals)
        assert not any(
            m in x for x in lane for m in ("long_context", "step_profile", "place_bench", "hit_rate")
        )
        # (the only whole-engine GPU check: the selection window's graphs against eager decode)
        assert [x for x in lane if "gpu_check" in x] == [x for x in lane if "gpu_check --only window" in x]
        assert not any("--cap-fraction" in x for x in lane)
    assert any(f"--out {s}/b/eval/uncapped" in x for x in gpu1)
    out = run("collect").stdout
    assert "model.tar.00" in out and (tmp_path / "out" / "b" / "model.tar.00").exists()
    with tarfile.open(tmp_path / "out" / "results.tgz") as t:
        names = t.getnames()
    assert {
        "./logs/lane_a.log",
        "./logs/lane_b.log",
        "./logs/train_log.jsonl",
        "./b/logs/train_log.jsonl",
    } <= set(names)
    assert not any("/train/" in n for n in names)


def test_session_scores_an_existing_model_with_a_window(tmp_path: Path) -> None:
    """TRAIN=0 WINDOW=64 on one GPU: lane A trains nothing and scores the shipped model, every score,
    the needle recall and the parity with --index-local-window 64, 1M first (EARLY_1M, on the sample indices
    of EARLY_1M_INDICES) and with another
    window (ALT_WINDOW) before the last 1M run. LANE_B=eval on two GPUs: lane A trains, lane B scores the
    shipped model with WINDOW_B's window under $SESSION/b."""
    import os

    shipped = "--model models-shipped/retrieval-wip"
    for ngpu in (1, 2):
        fake, calls, s = _gpu_case(tmp_path, ngpu)
        case = s.parent
        env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(case / "out"), "CHECKS": "0",
               "HISPARSE": "0", "CAPPED": "0"}  # fmt: skip
        env.update(
            {"TRAIN": "0", "WINDOW": "64", "EARLY_1M": "4", "EARLY_1M_INDICES": "0,5", "ALT_WINDOW": "128"}
            if ngpu == 1
            else {"LANE_B": "eval", "WINDOW_B": "32"}
        )
        lines = _session_until(env, calls, "--lengths 1m --samples 10", times=1 if ngpu == 1 else 2)
        lane = [x for x in lines if x.startswith(f"{ngpu - 1} ") and " -m " in x]
        assert not any("longctx.train" in x or "gpu_kernel_check" in x for x in lane)
        assert "bench.gpu_check --only window" in lane[0]  # the window checked before any score
        evals = [x for x in lane if "retrieval_eval run" in x or "needle_recall" in x or "long_parity" in x]
        assert evals and all(shipped in x for x in evals)
        if ngpu == 1:
            assert all("--index-local-window 64" in x for x in evals if "window128" not in x)
            lengths = [x.split("--lengths ")[1].split()[0] for x in evals]
            assert lengths == ["4k", "1m", "32k", "4k", "128k", "256k,512k", "1m", "1m", "1m", "1m"]
            (alt,) = [x for x in evals if "window128_1m" in x]
            assert "--index-local-window 128" in alt and "--index-local-window 64" not in alt
            assert lane.index(alt) == len(lane) - 2 and "--samples 4 --indices 0,5 " in evals[1]
            (parity,) = [x for x in evals if "long_parity" in x]
            assert "--answer-row" in parity and "--with-question" not in parity
        else:
            assert all("--index-local-window 32" in x and f"{s}/b/" in x for x in evals)
            assert not any("long_parity" in x for x in evals)
            (train,) = [x for x in lines if x.startswith("0 ") and "longctx.train" in x]
            assert "--index-local-window 64" in train


def test_session_scores_an_existing_model_with_another_top_k(tmp_path: Path) -> None:
    """TRAIN=0 TOPK=128 on one GPU: every score of the shipped model (and the capped 1M lane's, with
    CAPPED_SAMPLES / CAPPED_TASKS) selects the top 128, once, and no window check runs (no WINDOW)."""
    import os

    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"), "CHECKS": "0",
           "HISPARSE": "0", "PARITY": "0", "TRAIN": "0", "TOPK": "128", "EARLY_1M": "20",
           "CAPPED_SAMPLES": "20", "CAPPED_TASKS": "niah_single_1"}  # fmt: skip
    lines = _session_until(env, calls, "--cap-fraction")  # (the capped lane polls every 10 s)
    lane = [x for x in lines if x.startswith("0 ") and " -m " in x]
    assert not any("gpu_check" in x or "longctx.train" in x for x in lane)
    evals = [x for x in lane if "retrieval_eval run" in x or "needle_recall" in x]
    assert evals and all(x.count("--index-topk 128") == 1 for x in evals), evals
    # (and the shipped config's narrowing off: every query selects the top 128)
    assert all(x.count("--index-topk-long 0") == 1 for x in evals), evals
    assert all("--index-local-window" not in x for x in evals)
    (capped,) = [x for x in evals if "--cap-fraction" in x]
    assert "--samples 20 --concurrency 1 --tasks niah_single_1 --cap-fraction 0.1" in capped
    assert "--lengths 1m --samples 20" in evals[1]  # EARLY_1M, right after the 4K gate


def test_session_score_1m_lane(tmp_path: Path) -> None:
    """LANE_A=score1m: no training, no 4K-128K scores; issue 5's capped 128K RULER decode (with and without
    the fork, no place_bench) on the shipped model, then SCORE_1M niah_single_1 samples at 1M uncapped and
    under a 10% cap, each run going on from the committed samples of that model (seeded results.jsonl);
    with two GPUs the capped samples run on GPU 1 from the start."""
    import os
    import subprocess
    import time

    shipped = "--model models-shipped/retrieval-wip"
    for ngpu in (1, 2):
        fake, calls, s = _gpu_case(tmp_path, ngpu)
        case = s.parent
        env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(case / "out"),
               "LANE_A": "score1m", "SCORE_1M": "12"}  # fmt: skip
        subprocess.run(
            ["bash", "bench/session.sh", "start"], cwd=ROOT, env=env, check=True, capture_output=True
        )
        _wait_for_calls(calls, "--lengths 1m", 2)
        time.sleep(0.5)
        subprocess.run(
            ["bash", "bench/session.sh", "stop"], cwd=ROOT, env=env, check=True, capture_output=True
        )
        lines = [x for x in calls.read_text().splitlines() if " -m " in x and "pip" not in x]
        modules = [x.split(" -m ")[1].split()[0] for x in lines]
        assert "longctx.train" not in modules and "bench.place_bench" not in modules
        assert "bench.gpu_check" not in modules and "bench.vs_transformers" not in modules
        # the decode top-k's window checked on the GPU before the figures (on the uncapped lane's GPU)
        assert [x for x in lines if "gpu_kernel_check --only topk_window" in x][0][0] == "0"
        runs = [x for x in lines if "retrieval_eval run" in x]
        assert len(runs) == 2 and all(shipped in x and "--lengths 1m --samples 12 " in x for x in runs)
        assert all("--tasks niah_single_1" in x for x in runs)
        # the shipped config keeps layer 4 out of the fp8 cache; the seeded runs store every layer in fp8, as
        # their committed rows did
        assert all("--kv-fp8-skip-layers none" in x for x in runs)
        (unc,) = [x for x in runs if "--cap-fraction" not in x]
        (cap,) = [x for x in runs if "--cap-fraction 0.1" in x]
        assert f"--out {s}/eval/uncapped_1m" in unc and f"--out {s}/eval/capped_1m" in cap
        fork = [x for x in lines if str(s / "long_context_nofork") in x or str(s / "profiles_nofork") in x]
        assert len(fork) == 2 and all(shipped in x for x in fork)
        # the HiSparse figures before the uncapped samples, on the same GPU
        assert lines.index(unc) > max(lines.index(x) for x in fork) and unc[0] == fork[0][0] == "0"
        assert cap[0] == ("1" if ngpu == 2 else "0")
        if ngpu == 1:
            assert lines.index(cap) > lines.index(unc)
        # the committed samples of the shipped model (run 36a, with its config's narrowing) seed the uncapped
        # and the capped run (the runner skips what a file holds)
        for run, rows in (
            ("uncapped_1m", "eval-run36a-1m-h200.jsonl"),
            ("capped_1m", "eval-run36a-1m-capped-h200.jsonl"),
        ):
            assert (s / "eval" / run / "results.jsonl").read_text() == (
                ROOT / "bench" / "results" / "training" / rows
            ).read_text()


def test_session_score_1m_seeds_name_the_shipped_weights() -> None:
    """lane_score_1m seeds its 1M runs with committed rows only while the shipped weights are the ones those
    rows scored: session.sh's SEED_1M_SHA is the sha256 of models-shipped/retrieval-wip/model.safetensors
    (re-shipping without updating it fails here, instead of mixing one model's rows into another's score)."""
    import hashlib
    import re

    (sha,) = re.findall(r"^SEED_1M_SHA=([0-9a-f]{64})$", (ROOT / "bench" / "session.sh").read_text(), re.M)
    assert sha == hashlib.sha256((WIP / "model.safetensors").read_bytes()).hexdigest()


def test_session_score_1m_gives_other_shipped_weights_no_seeds(tmp_path: Path) -> None:
    """LANE_A=score1m on a tree whose shipped weights are not SEED_1M_SHA's: nothing is seeded, and lane
    A's log says why."""
    import os
    import shutil

    tree = tmp_path / "tree"
    for part in ("bench", "configs", "kernels", "longctx", "pyproject.toml", "README.md"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tree / part)
    wip = tree / "models-shipped" / "retrieval-wip"
    wip.mkdir(parents=True)
    (wip / "model.safetensors").write_bytes(b"other weights")
    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"),
           "LANE_A": "score1m", "SCORE_1M": "20", "HISPARSE": "0"}  # fmt: skip
    lines = [x for x in _session_until(env, calls, "--cap-fraction", cwd=tree) if "retrieval_eval run" in x]
    assert len(lines) == 2
    assert not (s / "eval" / "uncapped_1m" / "results.jsonl").exists()
    assert not (s / "eval" / "capped_1m" / "results.jsonl").exists()
    assert "no seeds" in (s / "logs" / "lane_a.log").read_text()


def test_session_score_1m_lane_with_a_narrowing(tmp_path: Path) -> None:
    """LANE_A=score1m with TOPK_LONG / TOPK_LONG_FROM on one GPU, HISPARSE=0, SCORE_MID: the narrowing's
    graphs checked first, no HiSparse figures, the mid lengths then the 1M samples uncapped and capped all
    selecting so, and nothing seeded from the shipped model's rows (its own selection's)."""
    import os

    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"),
           "LANE_A": "score1m", "SCORE_1M": "20", "HISPARSE": "0", "TOPK_LONG": "128",
           "TOPK_LONG_FROM": "262144", "SCORE_MID": "256k,512k"}  # fmt: skip
    lines = _session_until(env, calls, "--cap-fraction")
    lines = [x for x in lines if " -m " in x and "pip" not in x]
    modules = [x.split(" -m ")[1].split()[0] for x in lines]
    assert "bench.long_context" not in modules and "bench.step_profile" not in modules
    check = [i for i, x in enumerate(lines) if "gpu_check --only topk_long" in x]
    runs = [i for i, x in enumerate(lines) if "retrieval_eval run" in x]
    assert len(check) == 1 and len(runs) == 3 and check[0] < runs[0]
    mid, unc, cap = (lines[i] for i in runs)
    assert "--lengths 256k,512k --samples 4" in mid and "--lengths 1m --samples 20" in unc
    assert "--cap-fraction 0.1" in cap and "--cap-fraction" not in unc
    flags = "--index-topk-long 128 --index-topk-long-from 262144"
    assert all(flags in lines[i] for i in runs)
    assert all("--tasks niah_single_1 " in lines[i] for i in runs)  # (SCORE_TASKS' default)
    assert not (s / "eval" / "uncapped_1m" / "results.jsonl").exists()


def test_session_score_1m_lane_takes_other_tasks(tmp_path: Path) -> None:
    """LANE_A=score1m SCORE_TASKS=niah_single_2,niah_single_3: every score (mid lengths, 1M uncapped and
    capped) runs those tasks; the shipped model's own selection seeds the 1M runs (niah_single_1 rows the
    runner leaves alone)."""
    import os

    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"),
           "LANE_A": "score1m", "SCORE_1M": "20", "HISPARSE": "0", "SCORE_MID": "256k,512k",
           "SCORE_TASKS": "niah_single_2,niah_single_3"}  # fmt: skip
    lines = [x for x in _session_until(env, calls, "--cap-fraction") if "retrieval_eval run" in x]
    assert len(lines) == 3 and all("--tasks niah_single_2,niah_single_3 " in x for x in lines)
    assert not any("--index-topk" in x for x in lines)  # (the config's selection)
    assert (s / "eval" / "uncapped_1m" / "results.jsonl").exists()


def test_session_score_1m_lane_scores_a_candidate_with_its_own_seeds(tmp_path: Path) -> None:
    """LANE_A=score1m EVAL_MODEL=<a candidate>: both 1M runs score that model, and the shipped model's
    committed rows never seed them (the runner would skip those samples as done); SEED_1M_UNCAPPED gives the
    candidate's own early samples, and the capped run without a seed starts afresh."""
    import os

    candidate = Path("models-candidates/example")  # (the script only passes the path on)
    own = tmp_path / "own.jsonl"
    own.write_text('{"task": "niah_single_1", "length": 1048576, "index": 0, "score": 1.0}\n')
    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"),
           "LANE_A": "score1m", "SCORE_1M": "20", "HISPARSE": "0",
           "EVAL_MODEL": f"models-candidates/{candidate.name}", "SEED_1M_UNCAPPED": str(own)}  # fmt: skip
    lines = [x for x in _session_until(env, calls, "--cap-fraction") if "retrieval_eval run" in x]
    assert len(lines) == 2 and all(f"--model models-candidates/{candidate.name} " in x for x in lines)
    assert (s / "eval" / "uncapped_1m" / "results.jsonl").read_text() == own.read_text()
    assert not (s / "eval" / "capped_1m" / "results.jsonl").exists()


def test_session_carries_tritons_cache_between_sessions(tmp_path: Path) -> None:
    """`start` unpacks a carried Triton cache (TRITON_CACHE_TGZ) into the session's fixed cache directory,
    which every lane's process gets as TRITON_CACHE_DIR; `collect` packs that directory into
    $OUT/triton-cache.tgz (not into results.tgz) without the intermediate IRs, and one over TRITON_CACHE_MAX_MB
    is not kept."""
    import os
    import subprocess
    import tarfile

    fake, calls, s = _gpu_case(tmp_path, 1)
    fake.write_text(
        fake.read_text().replace("$CUDA_VISIBLE_DEVICES $*", "$CUDA_VISIBLE_DEVICES TC=$TRITON_CACHE_DIR $*")
    )
    src = tmp_path / "carried"
    (src / "triton-cache" / "k1").mkdir(parents=True)
    (src / "triton-cache" / "k1" / "kernel.json").write_text("{}")
    carried = tmp_path / "triton-cache.tgz"
    with tarfile.open(carried, "w:gz") as t:
        t.add(src / "triton-cache", arcname="triton-cache")
    out = s.parent / "out"
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(out), "CHECKS": "0",
           "TRITON_CACHE_TGZ": str(carried)}  # fmt: skip
    lines = [x for x in _session_until(env, calls, "longctx.train") if " -m " in x]
    assert lines and all(f" TC={s}/triton-cache " in x for x in lines)
    assert (s / "triton-cache" / "k1" / "kernel.json").read_text() == "{}"
    (s / "triton-cache" / "k2").mkdir()  # (what this session compiled)
    (s / "triton-cache" / "k2" / "kernel.cubin").write_bytes(b"x")
    for ir in ("ttir", "ttgir", "llir", "ptx", "source"):  # (a cache hit reads none of them)
        (s / "triton-cache" / "k2" / f"kernel.{ir}").write_text("ir")
    run = lambda **e: subprocess.run(["bash", "bench/session.sh", "collect"], cwd=ROOT, env={**env, **e},  # noqa: E731
                                     check=True, capture_output=True, text=True)  # fmt: skip
    run()
    with tarfile.open(out / "triton-cache.tgz") as t:
        names = set(t.getnames())
        assert {"triton-cache/k1/kernel.json", "triton-cache/k2/kernel.cubin"} <= names
        assert not any(n.endswith((".ttir", ".ttgir", ".llir", ".ptx", ".source")) for n in names)
    with tarfile.open(out / "results.tgz") as t:
        assert not any("triton-cache" in n for n in t.getnames())
    (s / "triton-cache" / "k3").mkdir()
    (s / "triton-cache" / "k3" / "big.cubin").write_bytes(os.urandom(2 << 20))
    assert "not kept" in run(TRITON_CACHE_MAX_MB="1").stdout
    assert not (out / "triton-cache.tgz").exists()


def test_triton_cache_pack_leaves_out_the_ir_and_triton_still_hits(tmp_path: Path, monkeypatch) -> None:
    """bench.triton_cache packs a cache without its intermediate IR and rewrites each group file to match,
    so Triton's own cache manager finds the kernel (a group listing a missing file is a miss); the files
    a hit loads (metadata, cubin) come back byte for byte."""
    import os
    import shutil
    import tarfile

    from triton.runtime.cache import FileCacheManager

    from bench.triton_cache import main as pack_main

    cache = tmp_path / "triton-cache"
    key = "ABC123"
    d = cache / key
    d.mkdir(parents=True)
    files = {"k.json": b'{"name": "k"}', "k.cubin": os.urandom(64)}
    files |= {f"k.{ir}": b"ir text" for ir in ("ttir", "ttgir", "llir", "ptx", "source")}
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "__grp__k.json").write_text(json.dumps({"child_paths": {n: str(d / n) for n in files}}))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert FileCacheManager(key).get_group("k.json") is not None
    out = tmp_path / "tc.tgz"
    assert pack_main(["pack", str(cache), str(out)]) == 0
    for ir in ("ttir", "ttgir", "llir", "ptx", "source"):
        (d / f"k.{ir}").unlink()
    assert FileCacheManager(key).get_group("k.json") is None  # (what a plain copy without the IR gives)
    shutil.rmtree(cache)
    with tarfile.open(out) as t:
        names = set(t.getnames())
        t.extractall(tmp_path, filter="data")
    assert names == {f"triton-cache/{key}/{n}" for n in ("k.json", "k.cubin", "__grp__k.json")}
    grp = FileCacheManager(key).get_group("k.json")
    assert grp is not None and set(grp) == {"k.json", "k.cubin"}
    assert all((d / n).read_bytes() == files[n] for n in grp)
    assert pack_main(["pack", str(tmp_path / "none"), str(tmp_path / "x.tgz")]) == 2


@pytest.mark.parametrize("checks", ["1", "0"])
def test_session_gate_skips_the_long_evaluations_and_lanes_run_from_a_copy(
    tmp_path: Path, checks: str
) -> None:
    """A model under the 4K gate gets no 32K-1M runs (neither lane), and the lanes' working
    directory is the session's own copy of the tree, not the (replaceable) checkout. CHECKS=0
    leaves out the checks and profiles: on one GPU training is the first thing that runs."""
    import os
    import subprocess
    import time

    calls = tmp_path / "calls"
    fake = _gate_failing_python(tmp_path, calls)
    s = tmp_path / "s"
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "VS": "0", "PROFILES": "--phase decode",
           "CHECKS": checks}  # fmt: skip
    subprocess.run(["bash", "bench/session.sh", "start"], cwd=ROOT, env=env, check=True, capture_output=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (s / "eval.stop").exists():
        time.sleep(0.3)
    time.sleep(1.0)  # the capped lane sees the stop marker within its poll
    lines = calls.read_text().splitlines()
    subprocess.run(["bash", "bench/session.sh", "stop"], cwd=ROOT, env=env, check=True, capture_output=True)
    assert (s / "eval.stop").exists() and not (s / "eval.go").exists()
    assert any("retrieval_eval gate" in x for x in lines)
    assert not any("32k" in x or "long_context" in x or "--cap-fraction" in x for x in lines)
    work = [x.split()[1] for x in lines if " -m " in x and "pip" not in x]
    assert work and all(w == str(s / "src") for w in work)
    assert (s / "src" / "bench" / "session.sh").exists() and not (s / "src" / "tests").exists()
    modules = [x.split(" -m ")[1].split()[0] for x in lines if " -m " in x and "pip" not in x]
    if checks == "0":  # (the fused selection's check comes first, on lane A)
        assert (
            modules[:2] == ["bench.gpu_kernel_check", "longctx.train"] and "bench.step_profile" not in modules
        )
    else:
        assert modules[0] == "bench.gpu_kernel_check" and "bench.step_profile" in modules


def test_session_until_returns_when_the_lanes_are_done_and_collects(tmp_path: Path) -> None:
    """`session.sh until N` ends a device call's wait as soon as the lanes are done (not after N
    seconds), then reports and collects; on a machine without the session (given back between calls)
    it says so at once, exit 3; N must be a whole number."""
    import os
    import subprocess
    import time

    fake = _gate_failing_python(tmp_path, train_seconds=2)  # (training takes a while)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(tmp_path / "s"), "OUT": str(tmp_path / "out"),
           "CHECKS": "0", "CAPPED": "0"}  # fmt: skip
    run = lambda *a, **e: subprocess.run(["bash", "bench/session.sh", *a], cwd=ROOT, env={**env, **e},  # noqa: E731
                                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run("start").returncode == 0
    t0 = time.time()
    p = run("until", "300")
    assert p.returncode == 0, p.stderr
    assert 2 <= time.time() - t0 < 60 and "the session's lanes are done" in p.stdout
    assert (tmp_path / "out" / "results.tgz").exists()
    t0 = time.time()
    p = run("until", "300", SESSION=str(tmp_path / "elsewhere"))
    assert p.returncode == 3 and "given back between calls" in p.stdout and time.time() - t0 < 10
    assert run("until", "9m").returncode == 2


def test_session_without_a_checkpoint_still_measures_hisparse_on_the_shipped_model(tmp_path: Path) -> None:
    """Training that dies before its first save (a long row out of memory at step 1) leaves no
    checkpoint: lane A scores nothing but still runs issue 5's measurements, on the shipped model. A
    fused selection that fails its GPU check leaves training to the chunked one (--select torch)."""
    import os
    import subprocess
    import time

    fake = tmp_path / "py"
    calls = tmp_path / "calls"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$CUDA_VISIBLE_DEVICES $*" >> {calls}\n'
        'if [ "$1" = "-c" ]; then case "$*" in *checks/select*) exit 1;; esac; echo 1; exit 0; fi\n'
        'if [ "$2" = "longctx.train" ]; then exit 1; fi\n'
    )
    fake.chmod(0o755)
    s = tmp_path / "s"
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "CHECKS": "0"}
    subprocess.run(["bash", "bench/session.sh", "start"], cwd=ROOT, env=env, check=True, capture_output=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (calls.exists() and "profiles_nokeep" in calls.read_text()):
        time.sleep(0.3)
    lines = calls.read_text().splitlines()
    subprocess.run(["bash", "bench/session.sh", "stop"], cwd=ROOT, env=env, check=True, capture_output=True)
    assert (s / "eval.stop").exists() and not any("retrieval_eval" in x for x in lines)
    measured = [x for x in lines if "long_context" in x or "step_profile" in x]
    assert len(measured) == 7 and all("--model models-shipped/retrieval-wip" in x for x in measured)
    (train,) = [x for x in lines if "longctx.train" in x]
    assert "--select torch" in train and "--select auto" not in train
    assert any("gpu_kernel_check --only place" in x for x in lines) and any("place_bench" in x for x in lines)


def test_host_step_measures_a_decode_step_without_the_model() -> None:
    from bench.host_step import measure

    m = measure(batch=3, context=5000, steps=5)
    assert set(m) == {"schedule_ms", "graph_inputs_ms", "update_ms", "total_ms"}
    assert all(v > 0 for v in m.values())


def test_guided_cost_times_each_guide(tmp_path: Path) -> None:
    import json

    from bench.guided_cost import main

    assert main(["--vocab", "600", "--states", "3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "guided-cost-cpu.json").read_text())["rows"]
    assert [r["guide"] for r in rows] == ["regex", "json", "json (nested)", "json_object (nested)"]
    assert all(r["states"] > 1 and r["compile_s"] > 0 and r["mask_ms"] > 0 for r in rows)
    assert "| json_object (nested) |" in (tmp_path / "guided-cost-cpu.md").read_text()


def test_session_stop_kills_its_lanes_and_nothing_else(tmp_path: Path) -> None:
    import os
    import subprocess
    import time

    fake = tmp_path / "py"
    fake.write_text('#!/usr/bin/env bash\nif [ "$1" = "-c" ]; then echo 2; exit 0; fi\nsleep 60\n')
    fake.chmod(0o755)
    bystander = subprocess.Popen(["bash", "-c", "exec -a 'python3 -m longctx.cli serve' sleep 60"])
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(tmp_path / "s")}
    try:
        subprocess.run(
            ["bash", "bench/session.sh", "start"], cwd=ROOT, env=env, check=True, capture_output=True
        )
        time.sleep(1.0)
        assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout  # lanes running
        subprocess.run(
            ["bash", "bench/session.sh", "stop"], cwd=ROOT, env=env, check=True, capture_output=True
        )
        deadline = time.time() + 5
        while (
            time.time() < deadline
            and subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout
        ):
            time.sleep(0.1)
        assert not subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout
        assert bystander.poll() is None  # a process with a longctx-like name is not touched
    finally:
        bystander.kill()


def test_launch_count_of_a_decode_step_stays_fused() -> None:
    """The launches of one decode step (Triton path, interpreter) on tiny.json: the norms, rope,
    SwiGLU gate, top-k -> row translation, each new token's norm + rope + KV write and the MoE's
    combine (slots + shared + residual) are one kernel each, the router two (its logits straight from
    the hidden rows, no fp32 copy or cuBLAS GEMV; then the selection), the routed experts three more
    (align, gate-up, down; the align-free decode path measured slower on the H200 and is off), the
    projections of x one GEMM, the rotary cos / sin one kernel, and the step stays near its measured 169
    launches (825 before the fused kernels, 229 before the second round, 176 before the MoE combine made the
    next layer's input norm, 171 before the cos / sin kernel): a regression here is a slower decode on
    the GPU."""
    from bench.launch_count import count_decode_step

    ops = count_decode_step(ROOT / "configs" / "tiny.json", batch=1, context=70)
    # input, q_a, post-attention a layer and the final norm, less the five MoE layers' next input norms
    # (their combine kernel writes it)
    assert ops["triton._rms_norm_kernel"] == 6 * 3 + 1 - 5
    # MLA q every layer (tiny's rope dim 8 is below the 16 the sparse MLA kernel rotates itself), indexer q
    # per full layer
    assert ops["triton._rope_kernel"] == 6 + 3
    assert ops["triton._norm_rope_mla_kernel"] == 6 and ops["triton._ln_rope_index_kernel"] == 3
    # the router's logits and select kernels (its one launch, LONGCTX_ROUTER_FUSED_MAX_TOKENS, is off)
    assert ops["triton._router_logits_kernel"] == 5 and ops["triton._router_select_kernel"] == 5
    assert ops["triton._align_kernel"] == 5
    assert ops["triton._gate_up_kernel"] == 5 and ops["triton._down_kernel"] == 5
    assert ops["triton._combine_kernel"] == 5
    assert ops["triton._silu_mul_kernel"] == 6  # the dense MLP and five shared experts
    assert ops["triton._logical_to_rows_kernel"] == 3  # once per full layer, shared layers reuse it
    # q_a + kv_a (+ wk + weights_proj) as one GEMM, q_b, o_proj; wq_b; shared / dense MLP; lm_head
    # (kernels.gemv is off by default: cuBLAS measured as fast inside a graph); the router's is its own
    assert ops["aten.linear"] == 6 * 3 + 3 + 5 * 2 + 2 + 1
    assert not {"aten.pow", "aten.rsqrt", "aten.cat", "aten.index_put_", "aten.topk", "aten.silu"} & set(ops)
    assert not {"aten.layer_norm", "aten.zeros_like", "aten.sum", "aten.cos", "aten.sin"} & set(ops)
    assert ops["triton._cos_sin_kernel"] == 1
    # MLA's absorbed W_UK and W_UV: one per-head GEMV launch each a layer, no torch batched GEMM
    assert ops["triton._gemv_kernel"] == 2 * 6 and not {"aten.einsum", "aten.bmm"} & set(ops)
    assert sum(ops.values()) <= 170, ops.most_common(20)


def test_launch_count_sparse_mla_rotates_q(tmp_path: Path) -> None:
    """With a rope dim of 16 (GLM's and small-1m's is 64) the sparse MLA kernel rotates q's rope part
    itself: the step's rope launches are the indexer's alone (163 launches, 169 at rope dim 8)."""
    from bench.launch_count import count_decode_step

    cfg = json.loads((ROOT / "configs" / "tiny.json").read_text())
    (tmp_path / "r.json").write_text(json.dumps({**cfg, "qk_rope_head_dim": 16}))
    ops = count_decode_step(tmp_path / "r.json", batch=1, context=70)
    assert ops["triton._rope_kernel"] == 3 and ops["triton.sparse_mla_heads_kernel"] == 6
    assert sum(ops.values()) <= 164, ops.most_common(20)


def test_launch_count_of_a_windowed_decode_step(tmp_path: Path) -> None:
    """`index_local_window` (the retrieval model's 64): the top-k's write pass stores the window too, so a
    full layer's selection adds no torch ops after the top-k (191 launches on tiny.json with a window of 4
    before, 161 after: 10 small ones a full layer, ~6 of them separate kernels in the H200's 128K
    profile, where / add / compare / cat), and the step's key lengths none either (158; 152 with the
    per-head GEMV for W_UK / W_UV)."""
    from bench.launch_count import count_decode_step

    cfg = json.loads((ROOT / "configs" / "tiny.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps({**cfg, "index_local_window": 4}))
    ops = count_decode_step(tmp_path / "w.json", 1, 120, graphs=True)
    assert not {"aten.where", "aten.cat", "aten.arange", "aten.ge", "aten.le"} & set(ops), ops
    # nor the step's key lengths (the kernels make them from the positions: 158 launches)
    assert not {"aten.sub", "aten.clamp"} & set(ops), ops
    assert ops["triton._topk_write_kernel"] == 3 and sum(ops.values()) <= 153, ops.most_common(20)


def test_launch_count_of_a_capped_decode_step_stays_fused() -> None:
    """A HiSparse-capped decode step (graphs path) adds one placement per full layer (covering its
    shared layers), the newest tokens' placement, one `step_rows` and one `resolve_tail` per layer to
    the uncapped step, and no small torch ops (274 launches before the fused kernels, 181 after, 171
    since the router's select kernel masks the graph's padding rows: one fewer `bitwise_not` and
    `masked_fill` per MoE layer; 170 with the step's victim candidates, one launch that takes the
    select out of each placement; 168 with each IndexShare group placed in one launch instead of a
    full layer's placement and its shared layers' prefetch). Decode top-k here is below the all-hit
    pass's size (no hit pass)."""
    from bench.launch_count import count_decode_step

    # a 120-token prompt over 60 slots: the interpreted prefill is most of this test's time
    ops = count_decode_step(ROOT / "configs" / "tiny.json", 1, 120, hisparse_device_tokens=60, graphs=True)
    assert ops["triton._router_logits_kernel"] == 5 and ops["triton._router_select_kernel"] == 5
    assert not {"aten.bitwise_not", "aten.masked_fill"} & set(ops)  # valid rows: in the select kernel
    # tiny.json: full layers 0, 2 and 5 (1 shares 0's top-k, 3 and 4 share 2's): 3 + the newest tokens'
    assert ops["triton._lru_place_kernel"] == 4 and ops["triton._resolve_tail_kernel"] == 6
    assert ops["triton._step_rows_kernel"] == 1 and "triton._copy_rows_counted_2d_kernel" not in ops
    assert ops["triton._lru_candidates_kernel"] == 1 and "triton._par_pass_kernel" not in ops
    assert not {"aten.where", "aten.ge", "aten.clamp", "aten.index", "aten.__and__", "aten.lt"} & set(ops)
    assert sum(ops.values()) <= 163, ops.most_common(20)


def test_run_list_runs_each_line_and_packs_one_file(tmp_path: Path) -> None:
    """bench/run_list.sh: every command runs (a failing or timed-out one does not stop the list), a
    line over the budget is skipped, and everything comes back in one results.tgz."""
    import subprocess
    import tarfile

    lst = tmp_path / "list.txt"
    lst.write_text(
        "# a comment\nT=5 echo one > $R/one.txt\nT=1 sleep 5\nT=5 false\nT=999 echo never\nT=5 echo two\n"
    )
    out = tmp_path / "out"
    p = subprocess.run(
        ["bash", str(ROOT / "bench" / "run_list.sh"), str(lst), "60"],
        env={"OUT": str(out), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "[2] rc=124" in p.stdout and "[3] rc=1" in p.stdout and "[4] skipped" in p.stdout
    with tarfile.open(out / "results.tgz") as t:
        names = set(t.getnames())
    assert {"r/one.txt", "r/1.log", "r/5.log", "r/skipped.log"} <= names
    assert not (out / "r").exists()


def test_swap_sweep_on_cpu(tmp_path: Path) -> None:
    """bench/swap_sweep.py's GPU path at toy sizes under the interpreter: every setting it times is
    checked against the reference, and the winners come out as LONGCTX_SWAP_* specs."""
    from longctx.kernels.swap import CopyKnobs

    from bench.swap_sweep import main

    args = ["--device", "cpu", "--quick", "--pool-gib", "0.002", "--read-gib", "0.0002"]
    args += ["--out", str(tmp_path)]
    assert main(args) == 0
    d = json.loads((tmp_path / "swap-sweep-cpu.json").read_text())
    assert {r["case"] for r in d["results"]} == {"pages", "rows", "pages-in-order"}
    assert all(r["ok"] for r in d["results"]) and set(d["best"]) == {"pages", "rows"}
    assert all(isinstance(CopyKnobs.parse(spec), CopyKnobs) for spec in d["best"].values())
    assert "LONGCTX_SWAP_PAGES=" in (tmp_path / "swap-sweep-cpu.md").read_text()


def test_smla_sweep_on_cpu(tmp_path: Path) -> None:
    """bench/smla_sweep.py's GPU path at toy sizes under the interpreter: every sparse MLA heads setting
    it times is checked against the reference (ragged -1 padding included), winners come out as specs."""
    from longctx.kernels.sparse_mla_heads import HeadsKnobs

    from bench.smla_sweep import main

    assert main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "smla-sweep-cpu.json").read_text())
    assert all(c["ok"] for c in d["checks"]) and len(d["checks"]) >= 3
    assert all("ragged3" in c["rel_err"] for c in d["checks"])
    assert {r["batch"] for r in d["results"]} == {1, 3} and set(d["best"]) == {"1", "3"}
    assert all(isinstance(HeadsKnobs.parse(w["env_spec"]), HeadsKnobs) for w in d["best"].values())
    assert "LONGCTX_SPARSE_MLA_HEADS=" in (tmp_path / "smla-sweep-cpu.md").read_text()


def test_idx_sweep_on_cpu(tmp_path: Path) -> None:
    """bench/idx_sweep.py's GPU path at toy sizes under the interpreter: every indexer decode setting it
    times is checked against the reference (batch 1, 3 and a ragged 3), winners come out as env specs."""
    from longctx.kernels.indexer import DecodeKnobs

    from bench.idx_sweep import main

    assert main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "idx-sweep-cpu.json").read_text())
    assert all(c["ok"] for c in d["checks"]) and len(d["checks"]) >= 3
    assert all("h8_ragged3" in c["rel_err"] for c in d["checks"])
    assert any("tma=1" in c["spec"] for c in d["checks"])
    assert {r["batch"] for r in d["results"]} == {1, 3} and len(d["best"]) == 2
    assert all(isinstance(DecodeKnobs.parse(w["env_spec"]), DecodeKnobs) for w in d["best"].values())
    assert "LONGCTX_INDEXER_DECODE=" in (tmp_path / "idx-sweep-cpu.md").read_text()


def test_train_speed_times_old_and_new_steps_on_cpu(tmp_path: Path) -> None:
    from bench.train_speed import main

    assert main(["--device", "cpu", "--quick", "--stages", "sparse", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "train-speed-cpu.json").read_text())
    (row,) = d["rows"]
    assert row["stage"] == "sparse" and row["new"]["tokens_per_s"] > 0 and row["old"]["tokens_per_s"] > 0
    # the point of the new step: no host syncs, fewer launches than the per-expert / per-row loops
    assert row["new"]["syncs"] == 0 and row["old"]["syncs"] > 0 and row["new"]["ops"] < row["old"]["ops"]
    # the two forms of the sparse attention, each at every length; both sync-free
    assert main(["--device", "cpu", "--quick", "--stages", "sparse", "--impls", "gather,mask,fused,fused_ieee",
                 "--out", str(tmp_path / "forms")]) == 0  # fmt: skip
    (row,) = json.loads((tmp_path / "forms" / "train-speed-cpu.json").read_text())["rows"]
    assert (
        row["gather"]["syncs"] == 0
        and row["mask"]["syncs"] == 0
        and row["gather"]["ops"] != row["mask"]["ops"]
    )
    # the fused selection (its torch reference on a CPU), and every sparse point's selection timed alone
    assert row["fused"]["tokens_per_s"] > 0 and all(
        row[i]["select_s"] > 0 for i in ("gather", "mask", "fused", "fused_ieee")
    )
    assert main(["--device", "cpu", "--quick", "--impls", "new,bogus"]) == 2


def test_hit_rate_runs_the_shipped_model_capped(tmp_path: Path) -> None:
    from bench.hit_rate import main

    args = ["--tokens", "1024", "--steps", "4", "--policies", "--warmup", "1", "--ahead", "32", "--tail", "8"]
    assert main([*args, "--index-local-window", "32", "--out", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("hit-rate-*.json")
    d = json.loads(f.read_text())
    assert d["device_tokens_cap"] == d["index_topk"] + 2  # 10% of ~1K is below top-k: the floor
    assert d["index_local_window"] == 32
    assert d["hits"] + d["misses"] > 0 and 0.0 <= d["decode_hit_rate"] <= 1.0
    m = d["policies"]["mean"]
    assert len(d["policies"]["per_layer"]) >= 1
    assert 0.0 <= m["lru"] <= m["belady"] + 1e-9 <= m["unbounded"] + 2e-9 <= 1.0 + 2e-9
    assert 0.0 <= m["lru_ahead"] <= 1.0 and m["ahead_fetches"] >= 0
    assert 0.0 <= m["tail_cold"] <= m["tail_tail"] <= 1.0 and m["tail_tail_positions"] > 0


def test_cache_policy_replay_against_hand_counts() -> None:
    """`replay` on a sequence worked out by hand, then Belady >= LRU on random ones; `tail_cover` by hand."""
    import random

    from bench.hit_rate import replay, tail_cover, warm_lru

    # 3 slots for old positions (cap 4, the newest position pinned); step t's context is 100 + t tokens
    steps = [[0, 1], [2, 3], [0, 2], [1, 3, 102]]  # 102: the newest position at step 3
    r = replay(steps, 100, cap=4, recent=1, warmup=1)
    # LRU: after step 1 {1,2,3} (0 evicted); step 2: 0 miss, 2 hit -> {3,0,2}; step 3: 1 miss, 3 hit
    assert r["lru"] == (0 + 1 + 2) / 7  # + the pinned 102
    # Belady at step 1 evicts 1 (next used at step 3) rather than 0 (step 2): step 2 hits both
    assert r["belady"] == (0 + 2 + 2) / 7
    assert r["unbounded"] == (0 + 2 + 3) / 7
    # fetching the next-ranked positions: each step's `ahead` is hit at the step after it
    steps = [[0, 1], [2, 3], [0, 4], [5, 2]]
    r = replay(steps, 100, cap=4, recent=1, warmup=1, ahead=[[2], [4], [5], []])
    assert r["lru"] == 0.0 and r["lru_ahead"] == 3 / 6
    assert r["ahead_fetches"] == 2 / 3 and r["lru_misses"] == 2.0  # per counted step (t0's fetch uncounted)
    # fetching each miss's neighbours (R = 1): step 0 misses 10 and fetches 9, 11; step 1 selects 11 (a hit)
    # and misses 20 (fetching 19, 21); step 2 selects 21 (hit) and 9 (hit), missing nothing
    r = replay([[10], [11, 20], [21, 9]], 100, cap=8, recent=1, warmup=1, neighbours=1)
    assert r["lru"] == 0.0 and r["lru_nb"] == 3 / 4 and r["nb_fetches"] == (2 + 0) / 2  # (counted steps)
    rng = random.Random(0)
    for _ in range(20):
        seq = [rng.sample(range(60), 8) for _ in range(30)]
        r = replay(seq, 1000, cap=20, recent=4, warmup=3)
        assert r["lru"] <= r["belady"] + 1e-12 <= r["unbounded"] + 2e-12
    # what the prompt's last queries selected, held from the start: every step counted
    steps = [[0, 1, 100], [2, 0], [5, 1]]  # 100: the newest position at step 0 (pinned)
    c = tail_cover(steps, [[0, 5], [5, 9]], 100, recent=1)
    assert c["cold"] == (1 + 1 + 1) / 7  # 100 pinned; 0 seen at step 1; 1 seen at step 2
    assert c["tail"] == (2 + 1 + 2) / 7 and c["tail_positions"] == 3  # + 0 at step 0, + 5 at step 2
    # LRU at the cap from a prefill's leftovers: room 2 (cap 3, one pinned); the tail latest first is
    # 5, 9, 0, by count in it 5 (twice), 9, 0; the whole prefill's most selected 1, 0, 5
    w = warm_lru(steps, [[0, 5], [5, 9]], {1: 9, 0: 4, 5: 1}, 100, cap=3, recent=1)
    # from empty: step 0 only the pinned 100 -> {0, 1}; step 1 hits 0 -> {0, 2}; step 2 none
    assert w["cold"] == (1 + 1 + 0) / 7
    # from {5, 9}: step 0 misses both and evicts them -> {0, 1}: then as from empty
    assert w["tail"] == w["tail_count"] == w["tail_freq"] == (1 + 1 + 0) / 7
    # from {1, 0}: step 0 hits both, step 1 hits 0 -> {0, 2}, step 2 none
    assert w["freq"] == (3 + 1 + 0) / 7 and w["freq_positions"] == 3


def test_vs_transformers_long_from(tmp_path):
    """--long-from folds long_context's uncapped 1M request into max_context and the 1M row."""
    from bench.vs_transformers import add_long_from

    src = tmp_path / "long-context-h200.json"
    src.write_text(
        json.dumps(
            {
                "request_1m": {
                    "context_tokens": 1 << 20,
                    "prefill_s": {"uncapped": 80.0, "capped": 90.0},
                    "decode_ms_per_token": {"uncapped": 2.0, "capped": 5.0},
                }
            }
        )
    )
    lc = {"prefill_tok_s": {131072: 1e5}, "decode_ms": {131072: 1.4}, "max_context": 131072}
    res = {"max_context": {"transformers": 16384, "longctx": 131072}}
    add_long_from(res, lc, src)
    assert res["max_context"]["longctx"] == 1 << 20
    assert lc["decode_ms"][1 << 20] == 2.0 and abs(lc["prefill_tok_s"][1 << 20] - (1 << 20) / 80.0) < 1e-6
    assert res["long_from"]["source"] == str(src)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    res2 = {"max_context": {"longctx": 131072}}
    add_long_from(res2, {"prefill_tok_s": {}, "decode_ms": {}, "max_context": 131072}, empty)
    assert res2["max_context"]["longctx"] == 131072 and "error" in res2["long_from"]


def test_moe8_sweep_on_cpu(tmp_path: Path) -> None:
    """bench/moe8_sweep.py at toy sizes under the interpreter: the current path and the stream variants
    are each checked against the reference and a winner spec comes out."""
    from longctx.kernels.moe_stream import DEFAULT, parse_config

    from bench.moe8_sweep import main

    assert main(["--device", "cpu", "--quick", "--batches", "1,3", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "moe8-sweep-cpu.json").read_text())
    assert {r["variant"] for r in d["results"]} == {"current", "stream default", "stream mma=fp8"}
    assert all(r["ok"] for r in d["results"]) and set(d["best_stream"]) == {"1", "3"}
    assert all(parse_config(spec, DEFAULT) for spec in d["best_stream"].values())


def test_indexer_recall_on_the_shipped_model(tmp_path: Path) -> None:
    """bench.indexer_recall: per-layer recall of the needle's first digit, sparse vs dense next byte."""
    from bench.indexer_recall import main

    assert main(["--lengths", "512", "--samples", "1", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "indexer-recall.json").read_text())
    r = d["lengths"]["512"]
    assert r["prompts"] == 2 and len(r["recall_per_layer"]) == 6
    assert all(
        0.0 <= x <= 1.0 for x in r["recall_per_layer"] + [r["first_digit_sparse"], r["first_digit_dense"]]
    )
    assert (tmp_path / "indexer-recall.md").read_text().startswith("Needle recall")
    # --no-dense: the sparse pass alone (what long prompts can afford on a CPU)
    assert main(["--lengths", "512", "--samples", "1", "--no-dense", "--out", str(tmp_path / "s")]) == 0
    r2 = json.loads((tmp_path / "s" / "indexer-recall.json").read_text())["lengths"]["512"]
    assert r2["first_digit_dense"] is None and r2["recall_per_layer"] == r["recall_per_layer"]


def test_needle_recall_through_the_engine(tmp_path: Path) -> None:
    """bench.needle_recall: the shipped model answers 1K niah prompts through the engine and the
    recorded full layers (0, 1, 3) put the needle's value among the answer rows' selections; a
    second run resumes (no sample twice); bad arguments get exit 2."""
    from bench.needle_recall import main, needle_positions, recall_by_layer

    assert needle_positions([5, 1, 2, 9, 1, 2], [1, 2]) == [1, 2, 4, 5] and needle_positions([1], []) == []
    rows = {0: [(9, [3, 4, 7]), (10, [3]), (12, [4])], 1: [(9, [1])]}
    r = recall_by_layer(rows, [3, 4], prompt_len=10, answer_len=2)
    # row 12 is past the answer; `local`: the last prompt row's share of the prompt's (10) positions
    assert r["0"] == {"last_prompt": 1.0, "answer": 0.75, "any": 1.0, "local": 0.3}
    assert r["1"] == {"last_prompt": 0.0, "answer": 0.0, "any": 0.0, "local": 0.1}
    # a needle with letters (a UUID's a-f at position 4): `answer` over its letters and over the rest
    r = recall_by_layer(rows, [3, 4], prompt_len=10, answer_len=2, letters=[4])
    assert r["0"]["answer_letters"] == 0.5 and r["0"]["answer_digits"] == 1.0
    args = ["--lengths", "1k", "--samples", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert main(args) == 0
    lines = (tmp_path / "needle-recall.jsonl").read_text().splitlines()
    assert len(lines) == 2 and main(args) == 0
    assert len((tmp_path / "needle-recall.jsonl").read_text().splitlines()) == 2
    d = json.loads((tmp_path / "needle-recall.json").read_text())["by_length"]["1K"]
    assert d["all"]["samples"] == 2 and set(d["all"]["layers"]) == {"0", "1", "3"}
    row = json.loads(lines[0])
    assert row["score"] == 1 and row["value"] in row["output"]
    assert all(v["any"] == 1 and 0 < v["answer"] <= 1 and 0 < v["local"] <= 1 for v in row["recall"].values())
    # the step that wrote the value's first digit: it wrote the wanted one, ranked first among the top 5
    fd = row["first_digit"]
    assert (
        fd["wrote"] == fd["want"] == ord(row["value"][0]) and fd["want_rank"] == 1 and fd["want_logprob"] <= 0
    )
    from bench.needle_recall import first_digit, summarize, table
    from longctx.engine.request import TokenLogprob

    lps = [TokenLogprob(32, 0.0), TokenLogprob(52, -0.5, ((52, -0.5), (49, -1.0)))]
    assert first_digit([32, 52], lps, [49, 50]) == {
        "step": 1, "wrote": 52, "want": 49, "want_logprob": -1.0, "want_rank": 2
    }  # fmt: skip
    wrong = {**row, "score": 0.0, "first_digit": first_digit([32, 52], lps, [49, 50])}
    summary = summarize([row, wrong])
    assert summary["1K"]["wrong"]["first_digit_rank"] == {"2": 1}
    older = {
        **row,
        "recall": {k: {x: y for x, y in v.items() if x != "local"} for k, v in row["recall"].items()},
    }
    # rows from before `local`; numbers have no letters
    assert "| - | - |" in table(summarize([older])) and "| - | - |" not in table(summary)
    uuid = {
        **row,
        "recall": {k: {**v, "answer_letters": 0.5, "answer_digits": 1.0} for k, v in row["recall"].items()},
    }
    both = summarize([uuid, row])["1K"]["all"]["layers"][
        "0"
    ]  # the letters averaged over the samples with some
    assert both["answer_letters"] == 0.5 and "0.50 / 1.00 |" in table(summarize([uuid]))
    assert main([*args[:-1], str(tmp_path / "x"), "--tasks", "vt"]) == 2
    assert main([*args[:-1], str(tmp_path / "x"), "--lengths", "12q"]) == 2
    assert main([*args[:-1], str(tmp_path / "x"), "--index-topk", "0"]) == 2


def test_needle_recall_forces_the_needle_into_chosen_layers(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """--force-layers: with a top-k too small to hold a UUID needle beside the window, the forced full
    layers select every needle position at every answer row (the recorded selections are the forced
    ones), the others are left as the indexer chose, and the row says how many positions were put in;
    a shared layer, a non-number or a GPU device is one error line (exit 2)."""
    from bench.needle_recall import main

    head = ["--lengths", "1k", "--samples", "1", "--tasks", "niah_single_3"]
    # 48 positions beside the window of 64: room for a UUID's 36 bytes (the shipped narrowing off)
    topk = ["--index-topk-long", "0", "--index-topk", "112"]
    base = [*head, "--device", "cpu", *topk]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    (plain,) = [json.loads(x) for x in (tmp_path / "a" / "needle-recall.jsonl").read_text().splitlines()]
    assert "forced" not in plain and set(plain["recall"]) == {"0", "1", "3"}
    # force the full layers whose own selection misses part of the needle (the shipped weights decide
    # which: run 29's missed it in all three, run 36a's in layers 0 and 1)
    low = sorted(int(k) for k, v in plain["recall"].items() if v["answer"] < 1)
    assert low, plain["recall"]
    forced = ",".join(map(str, low))
    assert main([*base, "--force-layers", forced, "--out", str(tmp_path / "f")]) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "f" / "needle-recall.jsonl").read_text().splitlines()]
    assert row["forced"]["layers"] == low and row["forced"]["rows"] > 0 and row["forced"]["replaced"] > 0
    assert all(row["recall"][str(k)]["answer"] == 1.0 for k in low)
    capsys.readouterr()
    for bad in ("2", "0,x", "99"):
        assert main([*base, "--force-layers", bad, "--out", str(tmp_path / "x")]) == 2
    assert main([*head, *topk, "--device", "auto", "--force-layers", "0", "--out", str(tmp_path / "x")]) == 2
    # a top-k whose room beside the window cannot take the needle: one line, not a traceback
    assert main([*base[:-1], "72", "--force-layers", "0", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(e.startswith("needle_recall: ") for e in err), err
    assert all("--force-layers" in e for e in err[:4]) and "no room for the needle" in err[4]


def test_long_parity_engine_equals_the_training_forward_on_cpu(tmp_path: Path) -> None:
    """bench.long_parity: the engine's last prompt row and the training forward's agree on the CPU
    (fp32: the same model, ~1e-7 apart), both put the answer's space first; bad arguments exit 2."""
    from bench.long_parity import main

    args = ["--lengths", "1k", "--device", "cpu", "--with-question", "16", "--without-question", "16"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "long-parity.json").read_text())["rows"]
    # the question's last 16 positions forced into / kept out of the last row's selection: other forwards
    q_in, q_out = row["forms"].pop("train+q"), row["forms"].pop("train-q")
    assert q_in["question_window"] == q_out["question_window"] == 16 and q_out["rel_diff"] > 1e-6
    assert set(row["forms"]) == {"engine", "train"} and row["forms"]["engine"]["rel_diff"] <= 1e-4
    assert all(v["top"][0][0] == " " and v["want_logprob"] > -0.1 for v in row["forms"].values())
    assert "| 1K | engine |" in (tmp_path / "long-parity.md").read_text()
    # every layer's attention at the last row (full and IndexShare): shares in [0, 1], the needle's and the
    # question's together at most all of it, and (a trained model at 1K) some of it on the needle over the
    # selection
    att = row["attention"]
    assert set(att) == {str(i) for i in range(6)}  # configs/retrieval.json's six layers
    for a in att.values():
        assert all(0.0 <= v <= 1.0 for v in a.values())
        assert (
            a["needle_sel"] + a["local_sel"] <= 1.0 + 1e-3
            and a["needle_dense"] + a["local_dense"] <= 1.0 + 1e-3
        )
    assert max(a["needle_sel"] for a in att.values()) > 0.01
    assert "| 1K | 0 |" in (tmp_path / "long-parity.md").read_text()
    # the narrowing from position 512 on (--index-topk-long): the engine and the training forward alike
    narrow = ["--index-topk-long", "128", "--index-topk-long-from", "512"]
    assert main(["--lengths", "1k", "--device", "cpu", *narrow, "--out", str(tmp_path / "n")]) == 0
    res = json.loads((tmp_path / "n" / "long-parity.json").read_text())
    assert res["index_topk_long"] == 128 and res["rows"][0]["forms"]["engine"]["rel_diff"] <= 1e-4
    # a top-k override (the shipped narrowing off): the training forward selects the top 128 too
    wide = ["--index-topk", "128", "--index-topk-long", "0"]
    assert main(["--lengths", "1k", "--device", "cpu", *wide, "--out", str(tmp_path / "w")]) == 0
    res = json.loads((tmp_path / "w" / "long-parity.json").read_text())
    assert res["rows"][0]["forms"]["engine"]["rel_diff"] <= 1e-4
    for bad in (
        ["--index-topk", "128"],  # under the shipped narrowing of 128
        ["--task", "vt"],
        ["--index", "-1"],
        ["--lengths", "12q"],
        ["--forms", "engine"],
        ["--forms", "x,train"],
        ["--index-topk", "0"],
        ["--with-question", "-1"],
    ):
        assert main([*bad, "--device", "cpu", "--out", str(tmp_path / "x")]) == 2


def test_long_parity_answer_row_compares_the_decode_step_on_cpu(tmp_path: Path) -> None:
    """`--answer-row`: the row after the answer's space through the engine's prefill, the engine's decode
    step and the training forward agree on the CPU (fp32), and the attention table is that row's; the
    engine with fp8 caches (`engine_fp8kv`) is near them but not equal."""
    from bench.long_parity import main

    forms = ["--forms", "engine,engine_fp8kv,train"]
    assert main(["--lengths", "1k", "--device", "cpu", "--answer-row", *forms, "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "long-parity.json").read_text())["rows"]
    assert row["forms"]["engine"]["top"][0][0] == " " and row["forms"]["engine"]["rel_diff"] <= 1e-4
    fp8 = row["forms"]["engine_fp8kv"]
    assert fp8["top"][0][0] == " " and 1e-5 < fp8["rel_diff"] < 0.1  # (quantised caches: close, not equal)
    ans = row["answer_row"]
    assert set(ans["forms"]) == {"engine", "engine_decode", "engine_fp8kv", "engine_fp8kv_decode", "train"}
    assert ans["want"].isdigit()
    eng, dec, train = (ans["forms"][f] for f in ("engine", "engine_decode", "train"))
    assert eng["rel_diff"] <= 1e-4 and dec["logprob_diff"] <= 1e-3
    assert eng["top"][0][0] == dec["top"][0][0] == train["top"][0][0]
    assert train["want_logprob"] is not None and train["want_logprob"] <= 0.0
    assert row["attention_row"] == "answer's space row" and len(row["attention"]) == 6
    md = (tmp_path / "long-parity.md").read_text()
    assert "| 1K | engine_decode |" in md and "answer's space row" in md
    bad = ["--answer-row", "--with-question", "8", "--device", "cpu", "--out", str(tmp_path / "x")]
    assert main(bad) == 2


def test_long_context_ruler_prompt_writes_its_own_keys(tmp_path: Path) -> None:
    """A RULER-prompt run (the trained model) is stored beside the issue's random-prompt keys, never
    over them, with the model and command it came from."""
    from bench.long_context import main

    assert main(["--quick", "--prompt", "ruler", "--phases", "128k", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "long-context-quick.json").read_text())
    assert "decode_128k" not in data
    d = data["decode_128k_ruler"]
    assert d["prompt"] == "ruler" and "--prompt ruler" in d["command"] and d["model"]
    assert d["tokens_match_uncapped"] == 1 and 0 <= d["hit_rate"] <= 1
    # the decode timed both ways (--quick: 8 tokens, the first from prefill, then 4 engine-loop and 3 synced steps)
    for key in ("decode_ms_per_token", "decode_ms_per_token_synced"):
        assert all(v > 0 for v in d[key].values()) and set(d[key]) == {"capped", "uncapped"}
    assert d["capped_over_uncapped_step"] > 0 and d["capped_over_uncapped_step_synced"] > 0
    # its ceilings travel with its keys: the top level stays the random-prompt run's
    assert "ceilings" not in data and "command" not in data and d["ceilings"] == {}
    md = (tmp_path / "long-context-quick.md").read_text()
    assert "decode_128k_ruler.hit_rate" in md and "decode_128k_ruler ms/token synced" in md


def test_needle_context_shares(tmp_path: Path) -> None:
    """bench.needle_context: a row's attention share on far keys over its selection and over every causal
    key (uniform logits: the counts), then a run on the shipped model at 1K (late needles only)."""
    import torch

    from bench.needle_context import main, row_shares

    scores = torch.zeros(2, 1, 8)
    sel = torch.full((8, 4), -1)
    sel[6, :3] = torch.tensor([0, 5, 6])
    (r,) = row_shares(scores, [6], sel, local=2)  # far: keys 0..4; causal: 0..6
    assert r == {"sel_far_keys": 1.0, "far_sel": pytest.approx(1 / 3), "far_dense": pytest.approx(5 / 7)}
    (d,) = row_shares(scores, [6], None, local=2)  # dense layer: the selection is every causal key
    assert d["far_sel"] == pytest.approx(5 / 7) and d["sel_far_keys"] == 5.0
    out = tmp_path / "nc"
    assert (
        main(
            ["--lengths", "1k", "--samples", "1", "--min-depth", "0.5", "--device", "cpu", "--out", str(out)]
        )
        == 0
    )
    res = json.loads((out / "needle-context.json").read_text())
    (L,) = res["lengths"].values()
    assert L["samples"][0]["depth"] >= 0.5 and L["samples"][0]["rows"] > 0
    assert len(L["layers"]) == 6 and all(
        0.0 <= v["far_sel"] <= 1.0 and 0.0 <= v["far_dense"] <= 1.0 for v in L["layers"]
    )
    assert all(v["sel_far_keys"] <= 256 for v in L["layers"])
    assert main(["--lengths", "1k", "--samples", "0", "--out", str(out)]) == 2
    # the same weights selecting otherwise, as the engine takes it: the top 128 (the shipped narrowing off)
    base = ["--lengths", "1k", "--samples", "1", "--min-depth", "0.5", "--device", "cpu", "--out", str(out)]
    assert main([*base, "--index-topk", "128", "--index-topk-long", "0"]) == 0
    res = json.loads((out / "needle-context.json").read_text())
    assert res["selection"] == {"index_topk": 128, "index_topk_long": 0}
    (L,) = res["lengths"].values()
    assert all(v["sel_far_keys"] <= 128 - 64 for v in L["layers"][:2])  # (full layers: the window's 64)
    assert main([*base, "--index-topk", "128"]) == 2  # under the shipped narrowing of 128: says how


def test_session_diagnoses_a_model_that_misses_at_1m(tmp_path: Path) -> None:
    """DIAG_1M=P on one GPU: when the early 1M samples (EARLY_1M_INDICES) score below P, bench.needle_context
    runs at 128K and 1M on the shipped and the scored model, then the shipped model's near 1M needles with
    the top 128, before the 32K scores; when they reach P, none of that."""
    import os

    for passes in (False, True):
        (tmp_path / str(passes)).mkdir()
        fake, calls, s = _gpu_case(tmp_path / str(passes), 1)
        if not passes:  # the 1M gate says "stop"
            fake.write_text(
                fake.read_text().replace(
                    'if [ "$1" = "-c" ]',
                    'if [[ "$*" == *"gate"*"--length 1m"* ]]; then exit 1; fi\nif [ "$1" = "-c" ]',
                )
            )
        env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"), "CHECKS": "0",
               "HISPARSE": "0", "CAPPED": "0", "TRAIN": "0", "EARLY_1M_INDICES": "0,5", "DIAG_1M": "62.5"}  # fmt: skip
        lane = [x for x in _session_until(env, calls, "--lengths 128k ") if " -m " in x]
        runs = [
            x.split(" -m ")[1].split()[0] + " " + x.split("--lengths ")[1].split()[0]
            for x in lane
            if "--lengths" in x
        ]
        assert (
            runs[:2] == ["bench.retrieval_eval 4k", "bench.retrieval_eval 1m"]
            and sum("--lengths 1m --samples 1 --indices 0,5 " in x for x in lane) == 1
        )
        diag = [x for x in lane if "needle_context" in x]
        if passes:
            assert not diag and runs[2] == "bench.retrieval_eval 32k"
        else:
            assert runs[2:6] == [
                "bench.needle_context 128k,1m",
                "bench.needle_context 128k,1m",
                "bench.retrieval_eval 1m",  # the shipped model's near needles with the top 128
                "bench.retrieval_eval 32k",
            ]
            (k128,) = [x for x in lane if "--index-topk 128" in x]
            assert "--indices 0,5,15,16 " in k128 and "--model models-shipped/retrieval-wip " in k128
            assert (
                "--model models-shipped/retrieval-wip " in diag[0]
                and f"{s}/needle_context/shipped" in diag[0]
            )
            assert f"{s}/needle_context/trained" in diag[1] and "--min-depth 0.9 --device cuda" in diag[1]


def test_key_binding_parses_needles_and_reports(tmp_path: Path) -> None:
    """bench.key_binding: the needle sentences of a multikey sample (four, the asked key's value among
    them), the answer kinds, `ahead`; then a run on the shipped model at 1K (shares in [0, 1], one
    `index_ahead` per full layer, answers that add up); bad arguments exit 2."""
    from bench.key_binding import ahead, answer_kind, main, needles
    from bench.needle_recall import MAX_NEW_TOKENS_SCALE, SEED
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    s = RulerGenerator(load_counter(str(WIP)), seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE).sample(
        "niah_multikey_1", 1024, 0
    )
    found = needles(s.input)
    assert len(found) == 4 and len({k for k, _ in found}) == 4
    assert [v for _, v in found].count(s.outputs[0]) == 1
    (asked_key,) = [k for k, v in found if v == s.outputs[0]]
    assert asked_key in s.answer_prefix
    assert answer_kind(" 123.", ["123"], ["456"]) == "asked"
    assert answer_kind(" 456.", ["123"], ["456"]) == "other" and answer_kind(" 7", ["123"], ["456"]) == "none"
    assert ahead([0.5, 0.1, 0.2], {0}) and not ahead([0.1, 0.5], {0}) and not ahead([0.3], {0})
    out = tmp_path / "kb"
    assert main(["--lengths", "1k", "--samples", "2", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads((out / "key-binding.json").read_text())
    (r,) = res["results"].values()
    assert r["full_layers"] == [0, 1, 3] and len(r["rows"]) == 2
    summ = r["summary"]
    assert len(summ["layers"]) == 6 and len(summ["index_ahead"]) == 3 and sum(summ["answers"].values()) == 2
    assert all(0.0 <= v[k] <= 1.0 for v in summ["layers"] for k in v)
    assert "| niah_multikey_1 1K | 3 |" in (out / "key-binding.md").read_text()
    for bad in (["--tasks", "vt"], ["--samples", "0"], ["--index-topk", "128"]):
        assert main([*bad, "--device", "cpu", "--out", str(out)]) == 2


def test_write_results_keeps_the_notes_below_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import common

    res, out = tmp_path / "results", tmp_path / "out"
    res.mkdir()
    monkeypatch.setattr(common, "RESULTS", res)
    # a table with hand-written notes below it: the rewrite replaces the table, keeps the notes
    (res / "x.md").write_text("| a | b |\n|---|---|\n| 1 | 2 |\n\nRun 1: why 2.\n\nRun 0: older.\n")
    common.write_results("x", {"a": 3}, "| a | b |\n|---|---|\n| 3 | 4 |", out)
    md = (res / "x.md").read_text()
    assert md.startswith("| a | b |\n|---|---|\n| 3 | 4 |\n")
    assert "| 1 | 2 |" not in md and md.endswith("Run 1: why 2.\n\nRun 0: older.\n")
    assert (out / "x.md").read_text() == md and json.loads((out / "x.json").read_text()) == {"a": 3}
    # the second rewrite finds the mark and keeps exactly the same notes
    common.write_results("x", {"a": 5}, "| a | b |\n|---|---|\n| 5 | 6 |")
    md2 = (res / "x.md").read_text()
    assert (
        md2.count(common.NOTES_MARK) == 1
        and md2.split(common.NOTES_MARK)[1] == md.split(common.NOTES_MARK)[1]
    )
    # a file that does not start with a table is kept whole below the new one; a new file gets no mark
    (res / "y.md").write_text("# Title\n\nprose\n")
    common.write_results("y", {}, "| t |")
    assert (res / "y.md").read_text().endswith("# Title\n\nprose\n")
    common.write_results("z", {}, "| t |")
    assert (res / "z.md").read_text() == "| t |\n"


def test_session_trains_first_with_pre_args_then_from_those_weights(tmp_path: Path) -> None:
    """PRE_MINUTES / PRE_ARGS: a first training under $S/pre with PRE_ARGS after lane A's flags, then the
    training (TRAIN_MINUTES) from its checkpoint, then the scores; `collect` brings the first one's log,
    and its weights while the training after it has none."""
    import os
    import subprocess

    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(tmp_path / "out"), "CHECKS": "0",
           "CAPPED": "0", "PRE_MINUTES": "2", "PRE_ARGS": "--task-weights vt=1 --curriculum 0:2048",
           "COPY_PROBE": "1"}  # fmt: skip
    lines = _session_until(env, calls, "--lengths 4k")
    pre, train = [x for x in lines if "longctx.train" in x]
    # COPY_PROBE=1: the copy probe on each training's weights as soon as they exist
    probe_pre, probe_main = [x for x in lines if "bench.copy_probe" in x]
    assert f"--model {s}/pre/train/ckpt --device cuda --out {s}/copy_probe/pre" in probe_pre
    assert f"--model {s}/train/ckpt --device cuda --out {s}/copy_probe/main" in probe_main
    assert lines.index(pre) < lines.index(probe_pre) < lines.index(train) < lines.index(probe_main)
    assert f"--out {s}/pre/train/ckpt --steps 0 --max-minutes 2 " in pre
    assert pre.endswith("--kl-share --task-weights vt=1 --curriculum 0:2048"), pre
    assert f"--out {s}/train/ckpt " in train and train.endswith(f"--kl-share --init-from {s}/pre/train/ckpt")
    assert lines.index(pre) < lines.index(train) < next(i for i, x in enumerate(lines) if "--lengths 4k" in x)
    (s / "pre" / "train" / "stdout.log").write_text("pre\n")
    subprocess.run(
        ["bash", "bench/session.sh", "collect"], cwd=ROOT, env=env, check=True, capture_output=True
    )
    assert (s / "logs" / "pre_train_stdout.log").read_text() == "pre\n"
    assert (s / "logs" / "pre_train_log.jsonl").exists()
    # the first training's weights come back only while the one after it has saved none
    assert not (tmp_path / "out" / "pre").exists()
    (s / "train" / "ckpt" / "model.safetensors").unlink()
    subprocess.run(
        ["bash", "bench/session.sh", "collect"], cwd=ROOT, env=env, check=True, capture_output=True
    )
    assert (tmp_path / "out" / "pre" / "model.tar.00").exists()
    # checkpoints every TRAIN_SAVE_EVERY (100) steps, so that collect has recent weights to bring
    assert "--save-every 100 " in pre and "--save-every 100 " in train


def test_copy_probe_scores_copies_by_alphabet_and_vt_by_chain(tmp_path: Path) -> None:
    """bench.copy_probe: the copied bytes are those after a repeated string's first byte; on the shipped
    model every alphabet and chain length gets its figures, and bad flags exit 2 with one line."""
    from bench.copy_probe import copied_bytes, copied_offsets, main

    assert copied_bytes("ab cd ab x cd") == [7, 12]  # ("ab" again at 6: its "b"; "cd" again at 11: its "d")
    assert copied_bytes("abc abc abc") == [5, 6, 9, 10]
    assert copied_offsets("abc x abc") == [(7, 1), (8, 2)]
    out = tmp_path / "p"
    args = ["--model", str(WIP), "--device", "cpu", "--rows", "1", "--copy-length", "300"]
    assert main([*args, "--vt-length", "1100", "--hops", "1", "--samples", "1", "--out", str(out)]) == 0
    d = json.loads((out / "copy-probe.json").read_text())
    assert set(d["copy"]) == {"lower_digits", "capitals", "uuid", "pairs_lower_digits", "pairs_capitals"}
    assert all(v["bytes"] > 0 and v["loss"] > 0 and v["chance"] > 2 for v in d["copy"].values())
    # the loss by the byte's place in the string: the mean of the places weighs each byte once
    for v in d["copy"].values():
        assert set(v["by_offset"]) <= {"1", "2", "4", "8"} and "1" in v["by_offset"]
        assert min(v["by_offset"].values()) - 1e-3 <= v["loss"] <= max(v["by_offset"].values()) + 1e-3
    assert d["vt"]["1"]["samples"] == 1 and d["vt"]["1"]["names"] == 2
    assert "| capitals |" in (out / "copy-probe.md").read_text()
    assert main([*args, "--hops", "0"]) == 2


def test_gpt_control_learns_the_copy_rows_and_probes_them_on_cpu(tmp_path: Path) -> None:
    """bench.gpt_control: a tiny plain GPT on pair rows leaves the byte vocabulary's chance (ln 320) for
    the rows' alphabets within 150 steps, and its probes score every copy-probe alphabet by place."""
    from bench.copy_probe import ALPHABETS
    from bench.gpt_control import main

    out = tmp_path / "gc"
    args = ["--steps", "150", "--device", "cpu", "--seq", "128", "--batch", "8", "--layers", "2", "--hidden", "64",
            "--heads", "4", "--ffn", "128", "--lr", "3e-3", "--warmup-steps", "10", "--probe-every", "1e9",
            "--probe-rows", "1", "--probe-length", "128", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    d = json.loads((out / "gpt-control.json").read_text())
    assert d["losses"][-1]["step"] == 150 and d["losses"][-1]["tokens"] == 150 * 8 * 128
    assert d["losses"][-1]["loss"] < 4.5 < math.log(320)  # 37 lowercase letters, digits and a space: ~3.6
    copy = d["probes"][-1]["copy"]
    assert set(copy) == set(ALPHABETS)
    for name in ("pairs_lower_digits", "pairs_capitals"):
        assert copy[name]["by_offset"] and all(math.isfinite(v) for v in copy[name]["by_offset"].values())
    assert "| 150 |" in (out / "gpt-control.md").read_text()
    assert main(args[:-2] + ["--out", str(out), "--seq", "0"]) == 2  # bad input: one line, exit 2


def test_induction_control_trains_every_variant_then_probes_and_collects(tmp_path: Path) -> None:
    """bench/induction_control.sh with a stand-in python: the GPT control and four longctx.train variants on
    pair rows alone (dense ones dense the whole run, *_pre from INIT_FROM), each from a copy of the tree;
    `probe` scores a copy of each checkpoint with the torch kernels; `collect` packs the logs."""
    import subprocess
    import tarfile

    fake, calls = _two_gpu_python(tmp_path)
    s = tmp_path / "ctl"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "CONTROL_DIR": str(s),
        "MINUTES": "2",
        "OUT": str(tmp_path / "out"),
    }
    run = lambda *a: subprocess.run(["bash", "bench/induction_control.sh", *a], cwd=ROOT, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True)  # fmt: skip
    run("start")
    _wait_for_calls(calls, "longctx.train", 4)
    lines = calls.read_text().splitlines()
    train = {ln.split("--out ")[1].split()[0].split("/")[-2]: ln for ln in lines if "longctx.train" in ln}
    assert set(train) == {"dense_fresh", "sparse_fresh", "dense_pre", "sparse_pre"}
    assert any("bench.gpt_control --minutes 2 --device cuda" in ln for ln in lines)
    for v, ln in train.items():
        assert "--copy-pairs-fraction 1.0" in ln and "--pose-max 0" in ln and "--max-minutes 2" in ln
        assert ("--dense-warmup-steps 1000000000" in ln) == v.startswith("dense")
        assert ("--init-from models-shipped/retrieval-wip" in ln) == v.endswith("_pre")
    assert (s / "src" / "bench" / "gpt_control.py").exists()
    probe = run("probe", "mid")
    assert "sparse_pre: no checkpoint" not in probe.stdout
    probes = [ln for ln in calls.read_text().splitlines() if "bench.copy_probe" in ln]
    assert len(probes) == 4 and all("--backend torch" in ln and "/snap/" in ln for ln in probes)
    assert (s / "snap" / "dense_pre-mid" / "model.safetensors").exists()
    run("collect")
    with tarfile.open(tmp_path / "out" / "results.tgz") as t:
        assert "logs/dense_fresh-stdout.log" in t.getnames()
    run("stop")


def test_slim_tree_hides_tracked_paths_from_the_device_copy_and_restores_them(tmp_path: Path) -> None:
    """bench/slim_tree.sh: a hidden path leaves the index and is ignored (so the device tool's copy
    skips it) while its files stay on disk; restore brings the index back to HEAD; bad input is one
    line and exit 2, with staged work never touched."""
    import subprocess

    repo = tmp_path / "repo"
    (repo / "models" / "a").mkdir(parents=True)
    (repo / "models" / "a" / "w.bin").write_bytes(os.urandom(4096))
    (repo / "keep.txt").write_text("kept\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout

    def slim(*args: str) -> subprocess.CompletedProcess[str]:
        script = ROOT / "bench" / "slim_tree.sh"
        return subprocess.run(["bash", str(script), *args], cwd=repo, capture_output=True, text=True)

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    before = int(slim("status").stdout.split("copies ")[1].split()[0])
    r = slim("hide", "models/a/")
    assert r.returncode == 0, r.stderr
    assert "models/a/w.bin" not in git("ls-files")
    assert git("status", "--porcelain", "--untracked-files=all").splitlines() == ["D  models/a/w.bin"]
    assert (repo / "models" / "a" / "w.bin").stat().st_size == 4096  # still on disk
    after = int(r.stdout.split("copies ")[1].split()[0])
    assert before - after == 4096
    assert "models/a" in slim("status").stdout
    # refused: an untracked path, staged changes, no path, an unknown command (one line each, exit 2)
    assert slim("hide", "nothing/here").returncode == 2
    for args in (("hide",), ("frobnicate",)):
        r = slim(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = slim("restore")
    assert r.returncode == 0 and "models/a" in r.stdout
    assert git("status", "--porcelain", "--untracked-files=all") == ""
    assert slim("restore").returncode == 0 and git("status", "--porcelain") == ""  # twice is harmless
    (repo / "keep.txt").write_text("changed\n")
    git("add", "keep.txt")
    r = slim("hide", "models/a")
    assert r.returncode == 2 and "staged" in r.stderr
    assert "models/a/w.bin" in git("ls-files") and git("status", "--porcelain") == "M  keep.txt\n"


def test_session_score_32k_off_goes_from_the_gate_to_the_long_scores(tmp_path: Path) -> None:
    """TRAIN=0 SCORE_32K=0 (a call scoring weights an earlier call trained and scored at 4K/32K): the 4K
    gate, the early 1M samples, then 128K; no 32K and no documents scores."""
    import os

    fake, calls, s = _gpu_case(tmp_path, 1)
    env = {**os.environ, "PYTHON": str(fake), "SESSION": str(s), "OUT": str(s.parent / "out"), "CHECKS": "0",
           "HISPARSE": "0", "PARITY": "0", "CAPPED": "0", "TRAIN": "0", "EARLY_1M": "4", "MID_LENGTHS": "",
           "SCORE_32K": "0"}  # fmt: skip
    lines = _session_until(env, calls, "--lengths 128k")
    evals = [x for x in lines if x.startswith("0 ") and "retrieval_eval run" in x]
    lengths = [x.split("--lengths ")[1].split()[0] for x in evals]
    assert lengths[:3] == ["4k", "1m", "128k"] and "32k" not in lengths, lengths
    assert not any("--documents" in x for x in evals)
    assert all("--model models-shipped/retrieval-wip " in x for x in evals)


def test_value_repeat_finds_the_first_repeat_and_probes_its_row_on_cpu(tmp_path: Path) -> None:
    """bench.value_repeat: first_repeat finds the first number written twice; probe_repeat on an answer
    that writes a needle's value twice gives every layer's shares at that row (the needle, the answer's
    copy, the needles not written yet), and on a repeated value no needle holds, no shares; a run on the
    shipped model at 1K writes its rows and table; a task other than niah_multivalue is one line, exit 2."""
    import torch

    from bench.long_parity import train_model
    from bench.needle_recall import MAX_NEW_TOKENS_SCALE, SEED
    from bench.value_repeat import first_repeat, main, probe_repeat
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import load_counter

    assert first_repeat(" 1234567, 7654321, 1234567, 7654321.") == (19, "1234567")
    assert first_repeat(" 1234567, 7654321.") is None and first_repeat("") is None
    counter = load_counter(str(WIP))
    s = RulerGenerator(counter, seed=SEED, max_new_tokens_scale=MAX_NEW_TOKENS_SCALE).sample(
        "niah_multivalue", 1024, 0
    )
    a, b = s.outputs[:2]
    model = train_model(str(WIP), torch.device("cpu"), {})
    ids = counter.encode(s.input + s.answer_prefix)
    got = probe_repeat(model, counter, s, ids, f" {a}, {b}, {a}.", torch.device("cpu"))
    assert got["repeat"] == a and got["needle"] and len(got["layers"]) == 6
    assert all(0 <= v <= 1 for x in got["layers"] for v in x.values())
    assert all(max(x[k] for x in got["layers"]) > 0 for k in ("needle", "answer", "unwritten"))
    assert probe_repeat(model, counter, s, ids, " 1111111, 1111111.", torch.device("cpu")) == {
        "repeat": "1111111", "needle": False, "layers": None}  # fmt: skip
    assert probe_repeat(model, counter, s, ids, f" {a}.", torch.device("cpu")) == {"repeat": None}
    assert main(["--model", str(WIP), "--lengths", "1k", "--samples", "2", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "value-repeat.json").read_text())["results"]["1K"]["rows"]
    assert [r["index"] for r in rows] == [0, 1] and all(len(r["outputs"]) == 4 for r in rows)
    assert all((r["repeat"] is None) == (first_repeat(r["pred"]) is None) for r in rows)
    assert "answers repeating a value" in (tmp_path / "value-repeat.md").read_text()
    assert main(["--model", str(WIP), "--tasks", "niah_single_1", "--out", str(tmp_path)]) == 2


def test_kv_split_stores_each_half_in_its_own_kind(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """bench.kv_split: with index_topk above the prompt every key is selected whatever the index keys
    hold, so fp8 MLA rows with model-dtype index keys score exactly as the all-fp8 cache, and model-dtype
    rows with fp8 index keys exactly as the all-model-dtype cache; the pools hold the asked kinds."""
    import torch

    from bench.kv_split import KINDS, split_pools
    from bench.kv_split import main as kv_split
    from longctx import Engine
    from longctx.kvstore.pool import PagedKVPool
    from tests.conftest import make_checkpoint, rand_ids, tiny_config

    # the split sets the kinds itself: a whole-cache dtype or a HiSparse cap is refused, in one line
    for extra in (["--kv-dtype", "bf16"], ["--kv-fp8-skip-layers", "1"], ["--cap-fraction", "0.1"]):
        with pytest.raises(SystemExit) as exc:
            kv_split(["--mla", "fp8", "--index", "model", "--", "--model", "m", "--out", "o", *extra])
        assert exc.value.code == 2
    d = make_checkpoint(tmp_path / "m", tiny_config(index_topk=128), seed=3)
    ids = rand_ids(100, 0)
    with Engine(d, device="cpu", kv_dtype="fp8_e4m3") as e:
        all_fp8 = e.score(ids)
    with Engine(d, device="cpu") as e:
        all_model = e.score(ids)
    assert not torch.allclose(all_fp8, all_model, rtol=1e-3, atol=1e-3)  # (the halves' kinds matter)
    built: list[PagedKVPool] = []
    orig = PagedKVPool.__init__
    for mla, index, want in (("fp8", "model", all_fp8), ("model", "fp8", all_model)):
        monkeypatch.setattr(PagedKVPool, "__init__", orig)  # (monkeypatch restores it after the test)
        split_pools(mla, index)
        split = PagedKVPool.__init__

        def keep(self, *a, _split=split, **k):  # type: ignore[no-untyped-def]
            _split(self, *a, **k)
            built.append(self)

        monkeypatch.setattr(PagedKVPool, "__init__", keep)
        with Engine(d, device="cpu") as e:
            got = e.score(ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        pool = built[-1]
        assert {(pool.mla_kind(i), pool.index_kind(i)) for i in pool.layers} == {(KINDS[mla], KINDS[index])}
        assert next(iter(pool._mla.values())).dtype == (torch.uint8 if mla == "fp8" else torch.float32)
        assert next(iter(pool._index.values())).dtype == (torch.uint8 if index == "fp8" else torch.float32)
    # fp8 rows in chosen layers only: all the layers is the fp8 rows' cache again; one layer is neither
    # cache, and is the engine's fp8 cache that keeps the other layers out of fp8 (`kv_fp8_skip_layers`)
    n = tiny_config().num_hidden_layers
    monkeypatch.setattr(PagedKVPool, "__init__", orig)
    with Engine(
        d, device="cpu", kv_dtype="fp8_e4m3", kv_fp8_skip_layers=[i for i in range(n) if i != 1]
    ) as e:
        only_1 = e.score(ids)
    for layers, want in ((frozenset(range(n)), all_fp8), (frozenset({1}), None)):
        monkeypatch.setattr(PagedKVPool, "__init__", orig)
        split_pools("fp8", "model", layers)
        with Engine(d, device="cpu") as e:
            got = e.score(ids)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.allclose(got, all_fp8, rtol=1e-4, atol=1e-4)
            assert not torch.allclose(got, all_model, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got, only_1, rtol=1e-5, atol=1e-5)  # (its index keys: model dtype)
    with pytest.raises(SystemExit):
        kv_split(["--mla", "model", "--index", "model", "--layers", "1", "--", "--model", "m", "--out", "o"])


def test_retrieval_eval_run_refuses_a_bad_seed_before_writing(tmp_path: Path, capsys) -> None:
    """A --seed `longctx ruler` would refuse is one line (exit 2) before the run's record is written."""
    from bench.retrieval_eval import main

    out = tmp_path / "w"
    assert main(["run", "--model", str(WIP), "--seed", "-1", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "run: error: --seed -1: must be an integer in [0, 2**63)"
    assert not out.exists()


def test_retrieval_eval_refuses_bad_lengths_in_one_line(tmp_path: Path, capsys) -> None:
    """A --lengths (run) or --length (gate) parse_lengths refuses is one line with exit 2, not a traceback."""
    from bench.retrieval_eval import main

    out = tmp_path / "w"
    assert main(["run", "--model", str(WIP), "--lengths", "4x", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "retrieval_eval: lengths '4x': not a length; use e.g. 4k,32k,128k,1m or a token count"
    ]
    assert main(["gate", str(out), "--length", "4x"]) == 2
    assert capsys.readouterr().err.strip().startswith("retrieval_eval: lengths '4x': not a length")


def test_vs_transformers_longctx_timing_on_cpu(tiny_dir, monkeypatch):
    """lc_prefill_decode's loop figure (first token to the last but one, as the host receives them) and its
    synced median run on a CPU engine: positive times, every request given all its tokens, batches too."""
    import math

    import bench.vs_transformers as vt
    from longctx import Engine

    monkeypatch.setattr(vt, "sync", lambda: None)
    with Engine(tiny_dir, device="cpu") as eng:
        for synced in (False, True):
            for b in (1, 3):
                pre, step = vt.lc_prefill_decode(eng, 70, 6, batch=b, synced=synced)
                assert 0 < pre < 60 and 0 < step < 10 and math.isfinite(step)
        assert not eng.has_work()
        with pytest.raises(AssertionError, match="decode_tokens"):
            vt.lc_prefill_decode(eng, 70, 2)


@pytest.mark.parametrize("part", ["smla", "smla_uv", "topk", "wuk", "router"])
def test_ncu_decode_parts_check_their_kernels_on_cpu(part: str, capsys) -> None:
    """bench.ncu_decode's parts (what Nsight Compute reads on the GPU) run at toy sizes under the
    interpreter, each checked against its reference first."""
    from bench.ncu_decode import main

    assert main(["--part", part, "--device", "cpu", "--context", "1024", "--calls", "1"]) == 0
    out = capsys.readouterr().out
    assert part == "wuk" or ("rel err" in out or "equal to the reference" in out)
