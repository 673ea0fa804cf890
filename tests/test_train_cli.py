"""`python -m longctx.train` on bad input: exit code 2 and one line before any work, nothing already saved
lost, and Ctrl-C saving what was trained. CPU, tiny config, seconds."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import longctx.train.loop as loop
from longctx.errors import CheckpointError, ConfigError
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


BAD_FLAGS = [  # each message names the flag the user typed, and the value, as they typed it
    (["--steps", "-1"], "--steps -1: must be >= 0"),
    (["--lr", "nan"], "--lr nan: must be a finite number > 0"),
    (["--lr", "0"], "--lr 0.0: must be"),
    (["--max-minutes", "-1"], "--max-minutes -1.0: must be"),
    (["--max-minutes", "inf", "--steps", "0"], "--max-minutes inf: must be"),
    (["--save-every", "0"], "--save-every 0: must be >= 1"),
    (["--log-every", "0"], "--log-every 0: must be >= 1"),
    (["--kl-rows", "0"], "--kl-rows 0: must be >= 1"),
    (["--lm-weight", "nan"], "--lm-weight nan: must be a finite number >= 0"),
    (["--kl-weight", "-1"], "--kl-weight -1.0: must be"),
    (["--needle-weight", "inf"], "--needle-weight inf: must be"),
    (["--lead-weight", "inf"], "--lead-weight inf: must be"),
    (["--advance-exact", "2"], "--advance-exact 2.0: must be in [0, 1]"),
    (["--advance-window", "0"], "--advance-window 0: must be >= 1"),
    (["--num-workers", "-1"], "--num-workers -1: must be >= 0"),
    (["--eval-samples", "-1"], "--eval-samples -1: must be >= 0"),
    (["--eval-samples", "1", "--eval-lengths", "1k"], "--eval-lengths '1k': expected lengths"),
    (
        ["--eval-samples", "1", "--eval-lengths", "2000000"],
        "--eval-lengths 2000000: rows of 2000000 positions",
    ),
    (["--eval-samples", "1", "--eval-lengths", "512,0"], "--eval-lengths 512,0: must be >= 1"),
    (["--tokens-per-step", "0"], "--tokens-per-step 0: must be >= 1"),
    (["--text-fraction", "-0.5"], "--text-fraction -0.5: must be in [0, 1]"),
    (["--copy-fraction", "nan"], "--copy-fraction nan: must be in [0, 1]"),
    (["--pose-chunks", "1"], "--pose-chunks 1: must be >= 2"),
    (["--replay-fraction", "1"], "--replay-fraction 1.0: must be in [0, 1)"),
    (["--task-weights", "vt=inf"], "--task-weights 'vt=inf': expected TASK=WEIGHT"),
    (["--task-weights", "niah=1"], "--task-weights 'niah': unknown task (the tasks: niah_single_1"),
    (["--vt-hops", "0,2"], "--vt-hops '0,2': each hop count must be in [1, 16]"),
    (["--curriculum", "0:512,0:1024"], "--curriculum 0:512,0:1024: steps must increase"),
    (["--curriculum", "0-512"], "--curriculum '0-512': expected STEP:LENGTH"),
    (
        ["--curriculum", "0:256"],
        "--curriculum 0:256: sequence length 256 is too short for any retrieval task",
    ),
    (["--pose-max", "2000000"], "--pose-max 2000000: rows of 2000000 positions exceed the model's"),
    (["--long-topk", "8:0"], "--long-topk '8:0': wants a row length and a top-k >= 1"),
    (["--long-topk-prob", "-1"], "--long-topk-prob -1.0: must be in [0, 1]"),
    (["--capitals-from-lowercase"], "--capitals-from-lowercase: needs --init-from"),
    (["--seed", "-1"], "--seed -1: must be an integer in [0, 2**63)"),
    (["--seed", str(2**63)], f"--seed {2**63}: must be an integer in [0, 2**63)"),
    (["--device", "bogus"], "--device 'bogus': must be 'auto', 'cpu' or 'cuda'"),
    (["--device", "meta"], "--device 'meta': must be"),
]


@pytest.mark.parametrize(("flags", "want"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_values_are_one_line_errors_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None, flags: list[str], want: str
) -> None:
    out = tmp_path / "run"
    assert main([*RUN, "--out", str(out), *flags]) == 2
    assert _err_line(capsys).startswith(f"error: {want}")
    assert not out.exists()


def test_rows_longer_than_the_models_positions_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**json.loads(TINY.read_text()), "max_position_embeddings": 256}))
    assert main([*RUN, "--config", str(short), "--out", str(tmp_path / "run")]) == 2
    want = "error: --curriculum 0:512: rows of 512 positions exceed the model's max_position_embeddings (256)"
    assert _err_line(capsys) == want


def test_a_value_from_the_resumed_recipe_is_named_as_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    """A setting a resumed run takes from its saved recipe (no flag given) is named as the recipe's key; the
    same value given as a flag is named as the flag."""
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**json.loads(TINY.read_text()), "max_position_embeddings": 600}))
    a = tmp_path / "a"
    a.mkdir()
    torch.save({"step": 1, "recipe": {"data": {"pose_max": 1024}}, "moments": {}}, a / TRAINER_STATE)
    (a / "config.json").write_text(TINY.read_text())
    run = [*RUN, "--config", str(short), "--out", str(tmp_path / "b")]
    exceed = "rows of 1024 positions exceed the model's max_position_embeddings (600)"
    assert main([*run, "--resume", str(a)]) == 2
    assert _err_line(capsys) == f"error: --resume's recipe pose_max 1024: {exceed}"
    assert main([*run, "--pose-max", "1024"]) == 2
    assert _err_line(capsys) == f"error: --pose-max 1024: {exceed}"


def test_every_flag_sets_the_field_of_its_name() -> None:
    """An error names a field by the flag whose dest it is (`said_as`), so each flag's dest is a field; the
    Python API's messages name the field itself."""
    from longctx.cli import said_as
    from longctx.config import ModelConfig
    from longctx.train.__main__ import build_parser
    from longctx.train.data import DataConfig

    parser = build_parser()
    fields = {f.name for c in (loop.TrainConfig, DataConfig) for f in dataclasses.fields(c)}
    assert {a.dest for a in parser._actions if a.option_strings} - fields == {"help"}
    say = said_as(parser)
    assert [say(n) for n in ("model_config", "tasks", "kl_rows", "long_topk_from")] == [
        "--config",
        "--task-weights",
        "--kl-rows",
        "long_topk_from",  # (no flag of its own: --long-topk S:K sets it)
    ]
    with pytest.raises(ConfigError) as e:
        loop.check_config(dataclasses.replace(loop.TrainConfig(), kl_rows=0), ModelConfig.from_json(TINY))
    assert str(e.value) == "kl_rows 0: must be >= 1" and e.value.named(say) == "--kl-rows 0: must be >= 1"


def test_save_dtype_takes_the_short_names(tmp_path: Path) -> None:
    """--save-dtype bf16 / fp32 / float, as --dtype takes them (argparse's choices refused them)."""
    from longctx.train.__main__ import build_parser

    for text, want in (("bf16", "bfloat16"), ("fp32", "float32"), ("float", "float32")):
        args = build_parser().parse_args([*RUN, "--out", str(tmp_path), "--save-dtype", text])
        assert args.save_dtype == want


def test_train_config_takes_the_short_dtype_names() -> None:
    """TrainConfig(save_dtype=...) from Python takes what --save-dtype takes (it refused "bf16"), keeps the
    torch name (what a recipe records and the save reads), and check_config still refuses other names."""
    from longctx.config import ModelConfig

    for given, want in (
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("fp32", "float32"),
        (torch.float32, "float32"),
    ):
        cfg = loop.TrainConfig(save_dtype=given)  # type: ignore[arg-type]
        assert cfg.save_dtype == want
        loop.check_config(cfg, ModelConfig.from_json(TINY))
        assert dataclasses.replace(cfg).save_dtype == want
    with pytest.raises(ConfigError) as e:
        loop.check_config(loop.TrainConfig(save_dtype="fp16"), ModelConfig.from_json(TINY))
    assert str(e.value).startswith("save_dtype 'float16': must be one of")


def test_a_seed_wider_than_32_bits_trains_and_each_bit_counts(tmp_path: Path) -> None:
    """--seed takes [0, 2**63): a seed past 2**44 ran out of the KL rows' generator (a traceback at the
    first step), and seeds 2**32 apart started from the same weights (torch's CPU generator keeps 32 bits
    of its seed); a seed below 2**32 still starts from what it did."""
    from longctx.config import ModelConfig
    from longctx.seeds import generator_seed
    from longctx.train.data import DataConfig, make_batch
    from longctx.train.model import TrainCausalLM

    seed = 2**62 + 5
    assert main([*RUN, "--seed", str(seed), "--out", str(tmp_path / "run")]) == 0
    assert read_recipe(tmp_path / "run")["seed"] == seed

    def weights(s: int) -> torch.Tensor:
        m = TrainCausalLM(ModelConfig.from_json(TINY))
        m.init_weights(s)
        return m.lm_head.weight.detach().clone()

    assert not torch.equal(weights(seed), weights(seed + 2**32))
    assert not torch.equal(weights(5), weights(5 + 2**32))
    assert generator_seed(5) == 5 and generator_seed(2**32 - 1) == 2**32 - 1  # (the generators as before)
    data = {"tokens_per_step": 1024, "curriculum": ((0, 512),)}
    assert not torch.equal(
        make_batch(DataConfig(seed=seed, **data), 0).ids,
        make_batch(DataConfig(seed=seed + 2**32, **data), 0).ids,
    )


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


def test_the_nearest_existing_place_of_an_out_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nearest_existing`, which init-model's room check, retrieve's --out check and check_out_dir ask: the
    path itself, else its nearest existing ancestor (absolute), a file included."""
    from longctx.paths import nearest_existing

    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    monkeypatch.chdir(tmp_path)
    assert nearest_existing(a_file) == a_file and nearest_existing(Path("notes.txt")) == Path("notes.txt")
    assert nearest_existing(tmp_path / "new" / "dir") == tmp_path
    assert nearest_existing(Path("new") / "dir") == tmp_path  # (not ".")
    assert nearest_existing(a_file / "sub" / "deeper") == a_file


def test_resume_and_init_from_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    a = tmp_path / "a"
    a.mkdir()
    torch.save({"step": 1, "recipe": {}, "moments": {}}, a / TRAINER_STATE)
    (a / "config.json").write_text(TINY.read_text())
    assert main([*RUN, "--out", str(tmp_path / "b"), "--resume", str(a), "--init-from", str(a)]) == 2
    assert (
        _err_line(capsys) == f"error: --init-from {a}: excludes --resume (a resumed run has its own weights)"
    )


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
