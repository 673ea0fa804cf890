"""`longctx generate` and `longctx score` on the CPU: text, token ids, batches, JSON output, the selection
flags, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from longctx import Engine
from longctx.cli import main

WIP = str(Path(__file__).resolve().parents[1] / "models-shipped" / "retrieval-wip")
CPU = ["--model", WIP, "--device", "cpu"]


def test_generate_text_batch_and_json(capsys) -> None:
    prompt = (
        "The special magic number for apple is: 4721. What is the special magic number for apple? Answer:"
    )
    assert main(["generate", *CPU, "--max-new-tokens", "6", "--json", prompt, "hello"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(len(r["token_ids"]) <= 6 and r["finish_reason"] for r in rows)
    with Engine(WIP, device="cpu") as eng:  # the CLI's greedy text is the engine's
        (want,) = eng.generate([prompt], max_new_tokens=6)
    assert rows[0]["text"] == want.text and rows[0]["token_ids"] == want.token_ids
    # the trained model held to a number's form answers with the needle's number, and stops right after it
    assert main(["generate", *CPU, "--json", "--guided-regex", " ?[0-9]{4}", prompt]) == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["text"] == " 4721" and row["finish_reason"] == "stop"
    # --include-stop: the text keeps the stop string that ended it
    assert len(want.text) >= 3, want.text
    stop = want.text[1:3]
    assert (
        main(["generate", *CPU, "--max-new-tokens", "6", "--json", "--stop", stop, "--include-stop", prompt])
        == 0
    )
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["text"] == want.text[: want.text.index(stop) + 2] and row["finish_reason"] == "stop"
    # token ids in, plain text out; a selection flag passes through to the engine
    ids = ",".join(str(b) for b in prompt.encode())
    assert (
        main(["generate", *CPU, "--max-new-tokens", "6", "--token-ids", ids, "--index-local-window", "32"])
        == 0
    )
    assert capsys.readouterr().out.strip()
    # the sampling controls: a bias forces a token, min_tokens holds back the EOS it would end with
    argv = ["generate", *CPU, "--json", "--token-ids", ids, "--max-new-tokens", "5", "--min-p", "0.2"]
    assert main([*argv, "--logit-bias", "88:100, 257:50", "--min-tokens", "3"]) == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["token_ids"] == [88, 88, 88, 88, 88] and row["finish_reason"] == "length"
    assert main([*argv, "--allowed-token-ids", "70, 71", "--temperature", "1.5", "--seed", "2"]) == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert set(row["token_ids"]) <= {70, 71} and len(row["token_ids"]) == 5
    # guided decoding: one of the choices, a JSON object
    assert (
        main([*argv, "--guided-choice", "yes", "--guided-choice", "no", "--temperature", "1", "--seed", "1"])
        == 0
    )
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["text"] in ("yes", "no") and row["finish_reason"] == "stop"
    assert main([*argv, "--json-object", "--max-new-tokens", "40"]) == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["finish_reason"] == "length" or isinstance(json.loads(row["text"]), dict)
    # logprobs of the generated and the prompt tokens, as Engine.generate gives them
    assert main(["generate", *CPU, "--json", "--token-ids", ids, "--max-new-tokens", "3", "--logprobs", "2",
                 "--prompt-logprobs", "1"]) == 0  # fmt: skip
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    with Engine(WIP, device="cpu") as eng:
        (c,) = eng.generate([list(prompt.encode())], max_new_tokens=3, logprobs=2, prompt_logprobs=1)
    assert [x["token_id"] for x in row["logprobs"]] == row["token_ids"] == c.token_ids
    assert all(len(x["top"]) == 2 for x in row["logprobs"])
    assert row["prompt_logprobs"][0] is None and len(row["prompt_logprobs"]) == len(prompt.encode())
    assert [x["logprob"] for x in row["prompt_logprobs"][1:]] == [
        round(x.logprob, 6) for x in c.prompt_logprobs
    ]


def test_score_matches_the_engine(tmp_path, capsys) -> None:
    text = "a b c d e f g a b c d e f g"
    out = tmp_path / "logits.pt"
    assert main(["score", *CPU, "--per-token", "--out", str(out), text]) == 0
    res = json.loads(capsys.readouterr().out)
    logits = torch.load(out)
    with Engine(WIP, device="cpu") as eng:
        ids = eng.encode(text)
        want = eng.score(ids)
    assert res["tokens"] == len(ids) and torch.allclose(logits, want)
    lp = torch.log_softmax(want, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert math.isclose(res["mean_nll"], float(-lp.mean()), rel_tol=1e-5)
    assert res["token_logprobs"][0] is None and len(res["token_logprobs"]) == len(ids)
    # one token predicts nothing: null, and the output stays JSON
    assert main(["score", *CPU, "--token-ids", "5"]) == 0
    assert json.loads(capsys.readouterr().out) == {"tokens": 1, "mean_nll": None, "perplexity": None}


@pytest.mark.parametrize(  # (a bad flag value: tests/test_cli_flags.py)
    "argv, says",
    [
        (["generate", "--model", "/nonexistent/model", "hi"], "model directory not found"),
        (["generate", *CPU, "--token-ids", "99999"], "outside the vocabulary"),
        (["generate", *CPU, ""], "the prompt is empty"),
        (["generate", *CPU, "--prompt-file", "/nonexistent/p.txt"], "prompt file not found"),
        (["generate", *CPU, "--logprobs", "2", "hi"], "--logprobs / --prompt-logprobs need --json"),
        (["score", *CPU, ""], "the prompt is empty"),
        (["generate", *CPU, "--prompt-file", str(Path(__file__).parent)], "(a directory)"),
        (["score", *CPU, "--out", "/nonexistent/dir/l.pt", "hi"], "--out /nonexistent/dir/l.pt: not a file"),
        (["generate", *CPU, "--token-ids", "1,2", "hi"], "not both"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], says: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith(f"longctx {argv[0]}: error:")


def test_a_prompt_file_not_in_utf8_is_one_line(tmp_path, capsys) -> None:
    """(It was decoded with replacement characters and run.)"""
    (tmp_path / "p.bin").write_bytes(b"ok \xff\xfe\x80 abc")
    assert main(["generate", *CPU, "--prompt-file", str(tmp_path / "p.bin")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not valid UTF-8 (byte 3)" in err[0], err


def test_corrupt_config_and_bad_paths_are_one_line(tmp_path, capsys) -> None:
    """A config.json that is JSON but not a config (a list, a field of the wrong type, a size that is not
    positive), and an output path that cannot be made, are one line with exit code 2 in every command
    that reads or writes them (they were tracebacks)."""
    good = json.loads((Path(WIP) / "config.json").read_text())
    bad = {
        "list": [1, 2],
        "type": {**good, "num_hidden_layers": "six"},
        "size": {**good, "vocab_size": -5},
        # values that passed the checks and then crashed in the forward, or ran to NaN (a CLI audit)
        "ngroup": {**good, "n_group": 0},
        "topk": {**good, "num_experts_per_tok": good["n_routed_experts"] + 1},
        "topkgroup": {**good, "topk_group": 5, "n_group": 2},
        "eps": {**good, "rms_norm_eps": "abc"},
        "negeps": {**good, "rms_norm_eps": -1},
        "rope": {**good, "rope_parameters": {**good.get("rope_parameters", {}), "rope_type": "weird"}},
        "theta": {**good, "rope_parameters": {**good.get("rope_parameters", {}), "rope_theta": float("nan")}},
        "eos": {**good, "eos_token_id": "x"},
        "eosvocab": {**good, "eos_token_id": 99999},
        "iheads": {**good, "index_n_heads": 0},
        "dtype": {**good, "dtype": "int7"},
        "mlp": {**good, "mlp_layer_types": ["xx"] * good["num_hidden_layers"]},
        "ctx": {**good, "max_position_embeddings": 0},
    }
    for name, cfg in bad.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        cfg_path = str(tmp_path / name / "config.json")
        for argv in (
            ["generate", "--model", str(tmp_path / name), "--device", "cpu", "hi"],
            ["plan", "--config", cfg_path, "--gpus", "1", "--pp", "1", "--context", "1K"],
            ["init-model", "--config", cfg_path, "--out", str(tmp_path / f"out-{name}")],
        ):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"longctx {argv[0]}: error: "), (argv, err)
            assert cfg_path in err[0] or any(
                w in err[0] for w in (" must ", " is more than ", " may hold ")
            ), err
    (tmp_path / "file").write_text("x")
    assert main(["init-model", "--config", "tiny", "--out", str(tmp_path / "file" / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"longctx init-model: error: Not a directory: {tmp_path / 'file' / 'm'}"], err


def test_flags_are_named_in_full(capsys) -> None:
    """`--prompt TEXT` is not read as `--prompt-file TEXT` (argparse's prefix matching is off)."""
    with pytest.raises(SystemExit) as e:
        main(["generate", *CPU, "--prompt", "hi"])
    assert e.value.code == 2 and "unrecognized arguments: --prompt" in capsys.readouterr().err


def test_dtypes_are_taken_by_their_short_names(tmp_path, capsys) -> None:
    """--dtype bf16 / half / fp32 ... and --kv-dtype bfloat16 (argparse's choices refused them for
    init-model and serve, Engine for generate); an unknown name is one line listing the accepted ones."""
    from longctx.config import check_kv_dtype

    out = tmp_path / "m"
    assert main(["init-model", "--config", "tiny", "--out", str(out), "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    capsys.readouterr()
    tiny = ["--model", str(out), "--device", "cpu"]
    argv = ["generate", *tiny, "--token-ids", "1,2", "--max-new-tokens", "1", "--json"]
    assert main([*argv, "--dtype", "half", "--kv-dtype", "BF16"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 1
    # serve reads them past argparse's choices, then stops at the bad --pp before it binds its port
    assert (
        main(["serve", *tiny, "--port", "0", "--dtype", "fp32", "--kv-dtype", "bfloat16", "--pp", "99"]) == 2
    )
    assert "--pp 99: must be in [1, 6]" in capsys.readouterr().err
    assert check_kv_dtype("bfloat16") == "bf16"  # (ruler / retrieve)
    assert main([*argv, "--dtype", "bf8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "longctx generate: error: --dtype 'bf8': must be one of auto, bfloat16, float16, float32 "
        "(or bf16, fp16, half, fp32, float)"
    ]


def test_kv_dtypes_are_one_list_everywhere(tmp_path, capsys) -> None:
    """--kv-dtype fp8 (fp8_e4m3's other name) was taken by generate (Engine) and refused by serve's argparse
    choices and ruler / retrieve's flag; every --kv-dtype reads one list now (`longctx.config.KV_DTYPE_NAMES`)."""
    from longctx.config import check_kv_dtype

    out = tmp_path / "m"
    assert main(["init-model", "--config", "tiny", "--out", str(out)]) == 0
    capsys.readouterr()
    tiny = ["--model", str(out), "--device", "cpu"]
    assert main(["serve", *tiny, "--port", "0", "--kv-dtype", "fp8", "--pp", "99"]) == 2
    assert "--pp 99: must be in [1, 6]" in capsys.readouterr().err  # (past argparse's choices)
    argv = ["generate", *tiny, "--token-ids", "1,2", "--max-new-tokens", "1", "--json"]
    assert main([*argv, "--kv-dtype", "FP8"]) == 0
    assert check_kv_dtype("fp8") == "fp8_e4m3"
    capsys.readouterr()
    assert main([*argv, "--kv-dtype", "int4"]) == 2
    assert (
        "--kv-dtype 'int4': must be one of auto, model, bf16, fp8_e4m3 (or fp8, bfloat16)"
        in capsys.readouterr().err
    )
