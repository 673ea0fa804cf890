"""`python -m longctx.train` on bad input: exit code 2 and one line before any work, nothing already saved
lost, and Ctrl-C saving what was trained. CPU, tiny config, seconds."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import longctx.train.loop as loop
from longctx.errors import CheckpointError
from longctx.train.__main__ import main
from longctx.train.checkpoint import TRAINER_STATE, read_recipe, read_training, save_training
from longctx.train.loop import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.json"
RUN = ["--config", str(TINY), "--device", "cpu", "--steps", "1", "--tokens-per-step", "1024",
       "--curriculum", "0:512", "--warmup-steps", "1", "--kl-rows", "16", "--save-dtype", "float32"]  # fmt: skip


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run must be refused before it builds a model (before any long work)."""

    def refuse(*a: object) -> None:
        raise AssertionError("a model was built: the error did not come up front")

    monkeypatch.setattr(loop, "TrainCausalLM", refuse)


BAD_FLAGS = [
    (["--steps", "-1"], "steps must be >= 0"),
    (["--lr", "nan"], "lr must be"),
    (["--lr", "0"], "lr must be"),
    (["--max-minutes", "-1"], "max_minutes"),
    (["--max-minutes", "inf", "--steps", "0"], "max_minutes"),
    (["--save-every", "0"], "save_every"),
    (["--log-every", "0"], "log_every"),
    (["--kl-rows", "0"], "kl_rows"),
    (["--lm-weight", "nan"], "lm_weight"),
    (["--kl-weight", "-1"], "kl_weight"),
    (["--needle-weight", "inf"], "needle_weight"),
    (["--lead-weight", "inf"], "lead_weight"),
    (["--advance-exact", "2"], "advance_exact"),
    (["--advance-window", "0"], "advance_window"),
    (["--num-workers", "-1"], "num_workers"),
    (["--eval-samples", "-1"], "eval_samples"),
    (["--eval-samples", "1", "--eval-lengths", "1k"], "--eval-lengths"),
    (["--eval-samples", "1", "--eval-lengths", "2000000"], "max_position_embeddings"),
    (["--tokens-per-step", "0"], "tokens_per_step"),
    (["--text-fraction", "-0.5"], "text_fraction"),
    (["--copy-fraction", "nan"], "copy_fraction"),
    (["--task-weights", "vt=inf"], "finite"),
    (["--task-weights", "niah=1"], "niah_single_1"),  # the message lists the tasks
    (["--curriculum", "0:256"], "too short for any retrieval task"),
    (["--pose-max", "2000000"], "max_position_embeddings"),
    (["--device", "bogus"], "device must be"),
    (["--device", "meta"], "device must be"),
]


@pytest.mark.parametrize(("flags", "want"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_values_are_one_line_errors_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None, flags: list[str], want: str
) -> None:
    out = tmp_path / "run"
    assert main([*RUN, "--out", str(out), *flags]) == 2
    assert want in _err_line(capsys)
    assert not out.exists()


def test_rows_longer_than_the_models_positions_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**json.loads(TINY.read_text()), "max_position_embeddings": 256}))
    assert main([*RUN, "--config", str(short), "--out", str(tmp_path / "run")]) == 2
    assert "exceed the model's max_position_embeddings (256)" in _err_line(capsys)


def test_a_malformed_flag_is_one_line_not_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([*RUN, "--out", "x", "--steps", "abc"], [*RUN, "--out", "x", "--stepz", "3"], RUN):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "error:" in _err_line(capsys)


def test_an_out_a_save_would_destroy_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    """save_training replaces --out as a whole: a file, a directory of other files, another run's checkpoint
    and a path under a file are refused before training (and left as they were)."""
    from longctx.train.checkpoint import check_out_dir

    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / TRAINER_STATE).write_bytes(b"")
    for out, want in (
        (a_file, "is a file"),
        (mine, "holds files a save would delete"),
        (run, f"--resume {run}"),
        (a_file / "sub", "cannot be written"),
    ):
        assert main([*RUN, "--out", str(out)]) == 2
        assert want in _err_line(capsys)
    assert a_file.read_text() == "keep" and (mine / "precious.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt", "run"]  # no .old / .tmp
    empty = tmp_path / "empty"
    empty.mkdir()
    check_out_dir(empty, None)
    check_out_dir(tmp_path / "new" / "dir", None)
    check_out_dir(run, resume=run)  # a resumed run saves over its own directory


def test_resume_and_init_from_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    a = tmp_path / "a"
    a.mkdir()
    torch.save({"step": 1, "recipe": {}, "moments": {}}, a / TRAINER_STATE)
    (a / "config.json").write_text(TINY.read_text())
    assert main([*RUN, "--out", str(tmp_path / "b"), "--resume", str(a), "--init-from", str(a)]) == 2
    assert "exclude each other" in _err_line(capsys)


def test_an_unreadable_trainer_state_or_log_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / TRAINER_STATE).write_bytes(b"PK\x03\x04 truncated")
    assert main([*RUN, "--out", str(tmp_path / "b"), "--resume", str(bad)]) == 2
    assert f"cannot read {bad / TRAINER_STATE}" in _err_line(capsys)
    torch.save([1, 2], bad / TRAINER_STATE)
    with pytest.raises(CheckpointError, match="not a trainer state"):
        read_recipe(bad)
    torch.save({"step": 1, "recipe": {}, "moments": {}}, bad / TRAINER_STATE)
    (bad / "train_log.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    with pytest.raises(CheckpointError, match="line 2 is not JSON"):
        read_training(bad)
    assert main([*RUN, "--out", str(tmp_path / "c"), "--resume", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in _err_line(capsys)


def test_a_failed_save_keeps_the_last_checkpoint_and_no_partial_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from longctx.config import ModelConfig
    from longctx.train.model import TrainCausalLM

    m = TrainCausalLM(ModelConfig.from_json(TINY))
    m.init_weights(0)
    opt = build_optimizer(m, loop.TrainConfig(), torch.device("cpu"))
    out = tmp_path / "run"
    save_training(out, m, opt, 3, {}, [{"step": 3}])

    def disk_full(*a: object, **k: object) -> None:
        raise OSError(28, "No space left on device", str(out) + ".tmp")

    monkeypatch.setattr("longctx.train.checkpoint.torch.save", disk_full)
    with pytest.raises(OSError):
        save_training(out, m, opt, 4, {}, [{"step": 3}, {"step": 4}])
    assert read_training(out)["step"] == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # the CLI: one line, exit code 2
    monkeypatch.setattr(loop, "train", lambda cfg: disk_full())
    assert main([*RUN, "--out", str(tmp_path / "b")]) == 2
    assert "No space left on device" in _err_line(capsys)


def _sigint_at(step: int, times: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deliver `times` real SIGINTs to this process during the optimizer step of `step`."""
    real = loop.train_step

    def step_then_sigint(model, opt, batch, cfg, s, device):  # type: ignore[no-untyped-def]
        metrics = real(model, opt, batch, cfg, s, device)
        for _ in range(times if s == step else 0):
            os.kill(os.getpid(), signal.SIGINT)
        return metrics

    monkeypatch.setattr(loop, "train_step", step_then_sigint)


@pytest.fixture
def default_sigint() -> object:
    """Python's own SIGINT handler (what a terminal's python has), restored after the test."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals need the main thread")
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


def test_ctrl_c_saves_the_steps_trained_and_the_run_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, default_sigint: None
) -> None:
    """The first Ctrl-C stops after the step in progress and saves it (exit code 130, one line, no eval);
    the saved run resumes; a second Ctrl-C quits at once, leaving the last save as it was."""
    out = tmp_path / "run"
    args = [*RUN, "--steps", "20", "--log-every", "1", "--save-every", "100", "--eval-samples", "1"]
    _sigint_at(2, 1, monkeypatch)
    assert main([*args, "--out", str(out)]) == 130
    assert "interrupted: saving after this step" in _err_line(capsys)
    st = read_training(out)
    assert st["step"] == 3 and [r["step"] for r in st["log"]] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "interrupted" and "eval" not in summary
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back

    monkeypatch.undo()
    assert main([*args, "--steps", "4", "--eval-samples", "0", "--out", str(out), "--resume", str(out)]) == 0
    assert [r["step"] for r in read_training(out)["log"]] == [1, 2, 3, 4]

    capsys.readouterr()
    _sigint_at(1, 2, monkeypatch)  # twice: quit without saving step 2
    assert main([*args, "--save-every", "1", "--out", str(tmp_path / "b")]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("interrupted: --out holds")
    assert read_training(tmp_path / "b")["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "run"]  # no partial copy
