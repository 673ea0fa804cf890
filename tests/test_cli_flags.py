"""Every `longctx` subcommand refuses a bad flag value in one line (exit code 2) that names the flag the user
typed and its value (`--min-tokens -1: ...`), also where the Engine, its sampling parameters or the model
config refuse it, whose own messages name the keyword (`min_tokens -1: ...`). CPU; nothing is generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longctx.cli import build_parser, main, said_as
from longctx.engine.args import ENGINE_FIELDS
from longctx.engine.request import SamplingParams
from longctx.errors import RequestError
from longctx.workloads.ruler_tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
WIP = str(ROOT / "models-shipped" / "retrieval-wip")
CPU = ["--model", WIP, "--device", "cpu"]
# each subcommand's good flags, before the bad one ({tmp}: the test's tmp_path); generate and score take
# a prompt after it (unless the bad flag is --token-ids)
START = {
    "generate": ["generate", *CPU],
    "score": ["score", *CPU],
    "serve": ["serve", *CPU, "--port", "0"],
    "init-model": ["init-model", "--config", "tiny", "--out", "{tmp}/m"],
    "plan": ["plan", "--config", "tiny", "--gpus", "1", "--pp", "1", "--context", "1K"],
    "ruler": ["ruler", *CPU, "--lengths", "1k", "--out", "{tmp}/r"],
    "retrieve": ["retrieve", *CPU, "--repo", str(ROOT / "configs"), "--queries", "{tmp}/q.jsonl",
                 "--out", "{tmp}/a.jsonl"],
}  # fmt: skip

BAD_FLAGS = [
    # generate: the sampling flags (SamplingParams) and the engine's
    ("generate", ["--max-new-tokens", "-1"], "--max-new-tokens -1: must be a non-negative integer"),
    ("generate", ["--temperature", "-1"], "--temperature -1.0: must be a number >= 0"),
    ("generate", ["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    ("generate", ["--top-k", "-1"], "--top-k -1: must be a non-negative integer"),
    ("generate", ["--seed", "-5"], "--seed -5: must be a non-negative integer"),
    ("generate", ["--presence-penalty", "3"], "--presence-penalty 3.0: must be between -2 and 2"),
    ("generate", ["--frequency-penalty", "-3"], "--frequency-penalty -3.0: must be between -2 and 2"),
    ("generate", ["--repetition-penalty", "0"], "--repetition-penalty 0.0: must be in (0, 100]"),
    ("generate", ["--min-tokens", "-1"], "--min-tokens -1: must be an integer between 0 and --max-new-tokens (32)"),
    ("generate", ["--min-p", "2"], "--min-p 2.0: must be in [0, 1]"),
    ("generate", ["--logprobs", "30", "--json"], "--logprobs 30: must be between 0 and 20"),
    ("generate", ["--prompt-logprobs", "21", "--json"], "--prompt-logprobs 21: must be between 0 and 20"),
    ("generate", ["--stop", ""], "--stop '': stop strings must not be empty"),
    ("generate", ["--logit-bias", "5"], "--logit-bias '5': expected ID:BIAS pairs"),
    ("generate", ["--logit-bias", "5:x"], "--logit-bias '5:x': expected ID:BIAS pairs"),
    ("generate", ["--logit-bias", "5:1,5:2"], "--logit-bias '5:2': expected ID:BIAS pairs with each ID once"),
    ("generate", ["--logit-bias", "5:200"], "--logit-bias: token 5's bias must be in [-100, 100], got 200.0"),
    ("generate", ["--logit-bias", "5000:1"], "--logit-bias: token id 5000 is outside the vocabulary [0, 320)"),
    ("generate", ["--token-ids", "1,x"], "--token-ids '1,x': expected integers separated by commas or spaces"),
    ("generate", ["--allowed-token-ids", "1;2"], "--allowed-token-ids '1;2': expected integers separated by commas or spaces"),
    ("generate", ["--allowed-token-ids", "5,320"], "--allowed-token-ids: token id 320 is outside the vocabulary [0, 320)"),
    ("generate", ["--bad-word", " "], "--bad-word ' ': must be a word (a string that is not blank)"),
    ("generate", ["--guided-regex", "(a"], "--guided-regex: missing ')' at position 2 of the pattern"),
    ("generate", ["--guided-regex", "a", "--guided-choice", "b"], "--guided-choice: cannot be combined with --guided-regex: at most one guide"),
    ("generate", ["--guided-json", "{"], "--guided-json: is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("generate", ["--json-object", "--min-tokens", "2"], "--min-tokens: cannot be combined with guided decoding"),
    ("generate", ["--device", "tpu"], "--device 'tpu': must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')"),
    ("generate", ["--dtype", "int8"], "--dtype 'int8': must be one of auto, bfloat16, float16, float32 (or bf16, fp16, half, fp32, float)"),
    ("generate", ["--kv-dtype", "int8"], "--kv-dtype 'int8': must be one of auto, model, bf16, fp8_e4m3 (or fp8, bfloat16)"),
    ("generate", ["--backend", "tpu"], "--backend 'tpu': must be one of ('auto', 'torch', 'triton')"),
    ("generate", ["--pp", "0"], "--pp 0: must be a positive integer"),
    ("generate", ["--pp", "99"], "--pp 99: must be in [1, 6] (the layer count)"),
    ("generate", ["--tp", "3"], "--tp 3: must divide num_attention_heads = 8"),
    ("generate", ["--max-context", "0"], "--max-context 0: must be a positive integer"),
    ("generate", ["--chunk-size", "-3"], "--chunk-size -3: must be a positive integer"),  # (was a hang)
    ("generate", ["--max-num-seqs", "0"], "--max-running 0: must be a positive integer"),
    ("generate", ["--kv-pages", "0"], "--kv-pages 0: must be a positive integer"),
    # (said as the keyword, after the weights were read)
    ("generate", ["--hisparse-device-tokens", "256"], "--hisparse-device-tokens 256: must be more than --index-topk (256), the tokens a full layer selects"),
    ("generate", ["--index-topk", "192", "--hisparse-device-tokens", "150"], "--hisparse-device-tokens 150: must be more than --index-topk (192), the tokens a full layer selects"),
    ("generate", ["--hisparse-device-tokens", "0"], "--hisparse-device-tokens 0: must be a positive integer"),
    ("generate", ["--index-topk", "0"], "--index-topk 0: must be >= 1"),
    (  # (its [tokens, index_topk] buffers were allocated: a traceback)
        "generate",
        ["--index-topk", str(2**40), "--index-topk-long", "0"],
        f"--index-topk {2**40}: is more than --max-context (1048576): no query has more keys to select",
    ),
    (
        "generate",
        ["--index-topk", "128"],
        "--index-topk 128: does not fit the checkpoint's index_topk_long 128: must be in (index_local_window "
        "= 64, index_topk = 128); --index-topk-long 0 turns it off",
    ),
    (  # (the checkpoint's window: a flag the user did not type)
        "generate",
        ["--index-topk", "64"],
        "--index-topk 64: leaves no room for the checkpoint's index_local_window 64 (must be > it); lower "
        "--index-local-window or raise --index-topk",
    ),
    ("generate", ["--index-local-window", "999"], "--index-local-window 999: must be an int in [0, index_topk = 256)"),
    ("generate", ["--index-topk-long", "5000"], "--index-topk-long 5000: must be in (index_local_window = 64, index_topk = 256)"),
    ("generate", ["--index-topk-long-from", "5"], "--index-topk-long-from 5: must be >= index_topk = 256"),
    ("generate", ["--kv-fp8-skip-layers", "4,x"], "--kv-fp8-skip-layers '4,x': expected a comma list of layer numbers (e.g. 4 or 1,4) or 'none'"),
    ("generate", ["--kv-fp8-skip-layers", "1,9"], "--kv-fp8-skip-layers 1,9: must be distinct layer numbers in [0, 6)"),
    ("score", ["--chunk-size", "0"], "--chunk-size 0: must be a positive integer"),
    ("score", ["--device", "tpu"], "--device 'tpu': must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')"),
    # serve refuses these before it binds its port: one line, not uvicorn's start and stop around it
    ("serve", ["--pp", "0"], "--pp 0: must be >= 1"),
    ("serve", ["--pp", "99"], "--pp 99: must be in [1, 6] (the layer count)"),
    ("serve", ["--tp", "3"], "--tp 3: must divide num_attention_heads = 8"),
    ("serve", ["--max-queue", "0"], "--max-queue 0: must be >= 1"),
    ("serve", ["--max-num-seqs", "0"], "--max-running 0: must be >= 1"),
    ("serve", ["--kv-pages", "-2"], "--kv-pages -2: must be >= 1"),
    ("serve", ["--chunk-size", "0"], "--chunk-size 0: must be >= 1"),
    ("serve", ["--index-topk-long", "-1"], "--index-topk-long -1: must be >= 0"),
    ("serve", ["--index-topk", "64"], "--index-topk 64: leaves no room for the checkpoint's index_local_window 64 (must be > it); lower --index-local-window or raise --index-topk"),
    ("serve", ["--index-local-window", "999"], "--index-local-window 999: must be an int in [0, index_topk = 256)"),
    ("serve", ["--port", "70000"], "--port 70000: must be in [0, 65535] (0 picks a free port)"),
    ("serve", ["--drain-timeout", "-1"], "--drain-timeout -1.0: must be a number of seconds >= 0"),
    ("serve", ["--api-key", "clé"], "--api-key: must be ASCII"),
    # (the engine process refused it after the port was bound and the weights read)
    ("serve", ["--hisparse-device-tokens", "100"], "--hisparse-device-tokens 100: must be more than --index-topk (256), the tokens a full layer selects"),
    ("serve", ["--kv-fp8-skip-layers", "9"], "--kv-fp8-skip-layers 9: must be distinct layer numbers in [0, 6)"),
    # (a byte not UTF-8 in the command line, read as U+DCFF: the socket's TypeError was a traceback)
    ("serve", ["--host", "\udcff"], "--host '\\udcff': is not a host name or address"),
    ("init-model", ["--seed", "-1"], "--seed -1: must be an integer in [0, 2**63)"),
    ("init-model", ["--seed", str(2**63)], f"--seed {2**63}: must be an integer in [0, 2**63)"),
    ("init-model", ["--seed", "x"], "--seed 'x': must be an integer in [0, 2**63)"),  # (as ruler's; was argparse's usage)
    ("init-model", ["--seed", "1.5"], "--seed '1.5': must be an integer in [0, 2**63)"),
    ("init-model", ["--init-std", "nan"], "--init-std nan: must be a finite number >= 0"),
    ("init-model", ["--max-shard-bytes", "0"], "--max-shard-bytes 0: must be positive"),
    ("plan", ["--gpus", "2"], "--gpus 2: must equal --pp x --tp = 1 x 1 = 1"),
    ("plan", ["--pp", "one"], "--pp 'one': not an integer"),
    ("plan", ["--context", "1X"], "--context '1X': not a token count (examples: 1048576, 1M, 128K)"),
    ("plan", ["--chunk", "-5"], "--chunk '-5': not a token count (examples: 1048576, 1M, 128K)"),
    ("plan", ["--hisparse-device-tokens", "many"], "--hisparse-device-tokens 'many': not a token count (examples: 1048576, 1M, 128K)"),
    ("plan", ["--gpu-mem", "80GX"], "--gpu-mem '80GX': not a byte size (examples: 141G, 80GiB, 2T, 1073741824)"),
    ("plan", ["--host-mem", "2Q"], "--host-mem '2Q': not a byte size (examples: 141G, 80GiB, 2T, 1073741824)"),
    ("plan", ["--layer-split", "1,x"], "--layer-split 'x': not an integer"),
    ("plan", ["--decode-batch", "1.5"], "--decode-batch '1.5': not an integer"),
    ("plan", ["--gpus-per-node", ""], "--gpus-per-node '': not an integer"),
    ("ruler", ["--samples", "0"], "--samples 0: must be >= 1"),
    ("ruler", ["--seed", "-1"], "--seed -1: must be an integer in [0, 2**63)"),
    ("ruler", ["--seed", str(2**63)], f"--seed {2**63}: must be an integer in [0, 2**63)"),
    ("ruler", ["--seed", "x"], "--seed 'x': must be an integer in [0, 2**63)"),  # (the range, as for -1)
    ("ruler", ["--seed", "1.5"], "--seed '1.5': must be an integer in [0, 2**63)"),
    ("ruler", ["--lengths", "1k,4x"], "--lengths '4x': not a length; use e.g. 4k,32k,128k,1m or a token count"),
    ("ruler", ["--lengths", "1k,100"], "--lengths 100: too short; the smallest is 256"),
    ("ruler", ["--indices", "0,x"], "--indices 'x': not a sample index; use e.g. 0,5,15"),
    ("ruler", ["--indices", "3,3"], "--indices 3: given twice"),
    ("ruler", ["--tasks", "vt,nope"], f"--tasks 'nope': unknown task; choose from {', '.join(TASKS)} or 'all'"),
    ("ruler", ["--tasks", " , "], f"--tasks ' , ': no task given; choose from {', '.join(TASKS)} or 'all'"),
    ("ruler", ["--concurrency", "x"], "--concurrency 'x': must be an integer"),
    ("ruler", ["--max-new-tokens-scale", "0"], "--max-new-tokens-scale 0.0: must be a finite number > 0"),
    (  # (scaled a budget to infinity: an OverflowError's traceback)
        "ruler",
        ["--max-new-tokens-scale", "1e308"],
        "--max-new-tokens-scale 1e+308: must be at most 8192 (RULER's largest output budget times it is 1048576 tokens)",
    ),
    ("ruler", ["--index-topk", "0"], "--index-topk 0: must be >= 1"),
    ("ruler", ["--kv-dtype", "fp4"], "--kv-dtype 'fp4': must be one of auto, model, bf16, fp8_e4m3 (or fp8, bfloat16)"),
    ("ruler", ["--kv-fp8-skip-layers", "x"], "--kv-fp8-skip-layers 'x': expected a comma list of layer numbers (e.g. 4 or 1,4) or 'none'"),
    ("ruler", ["--device", "tpu"], "--device 'tpu': must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')"),
    ("ruler", ["--index-topk", "32"], "--index-topk 32: leaves no room for the checkpoint's index_local_window 64 (must be > it); lower --index-local-window or raise --index-topk"),
    ("ruler", ["--index-local-window", "999"], "--index-local-window 999: must be an int in [0, index_topk = 256)"),
    ("retrieve", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    ("retrieve", ["--max-file-bytes", "1k"], "--max-file-bytes '1k': must be an integer"),
    ("retrieve", ["--max-context", "0"], "--max-context 0: must be >= 1"),
    ("retrieve", ["--max-context", "300"], "--max-context 300: leaves no room for the repository after questions and answers"),
    ("retrieve", ["--hisparse-device-tokens", "0"], "--hisparse-device-tokens 0: must be >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "flags", "want"), BAD_FLAGS, ids=[f"{c} {' '.join(f)}" for c, f, _ in BAD_FLAGS]
)
def test_a_bad_flag_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, flags: list[str], want: str
) -> None:
    (tmp_path / "q.jsonl").write_text('{"query": "what is this?"}\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in START[command]] + flags
    prompt = ["hi"] if command in ("generate", "score") and "--token-ids" not in flags else []
    assert main([*argv, *prompt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"longctx {command}: error: {want}"]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--index-topk", "0"], "--index-topk 0: must be >= 1"),
        (["--index-local-window", "-1"], "--index-local-window -1: must be >= 0"),
        (["--index-topk-long", "-1"], "--index-topk-long -1: must be >= 0"),
        (["--index-topk-long-from", "-5"], "--index-topk-long-from -5: must be >= 0"),
    ],
)
def test_serve_refuses_a_selection_flag_alike_with_the_fake_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], want: str
) -> None:
    """`serve --fake-engine` reads no model config (its model dir need hold none), but refuses a selection flag
    out of range in the real engine's words, before it binds a port (one check for both: `_check_selection`)."""
    for argv in (["--model", str(tmp_path), "--fake-engine"], ["--model", WIP]):
        assert main(["serve", *argv, "--port", "0", *flags]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"longctx serve: error: {want}"]


@pytest.mark.parametrize(
    ("options", "want"),
    [
        ('{"bogus": 1}', 'unknown option "bogus" (known: total_pages, prefill_chunk, step_delay_s, prefill_s_per_token, vocab_size, eos_token_id, poison_token, poison_after)'),
        ('{"total_pages": "x"}', 'total_pages "x": must be an integer'),
        ('{"total_pages": 0}', "total_pages 0: must be >= 1"),
        ('{"poison_after": true}', "poison_after true: must be an integer"),
        ('{"step_delay_s": -1}', "step_delay_s -1: must be in [0, 60] seconds"),
        ('{"step_delay_s": 1e300}', "step_delay_s 1e+300: must be in [0, 60] seconds"),
        ('{"prefill_s_per_token": "fast"}', 'prefill_s_per_token "fast": must be a number of seconds'),
        ('{"eos_token_id": 1.5}', "eos_token_id 1.5: must be a token id or null"),
        ('{"vocab_size": 10}', "eos_token_id 257: must be in [0, vocab_size 10)"),
    ],
)  # fmt: skip
def test_serve_refuses_a_bad_fake_engine_option_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: str, want: str
) -> None:
    """A bad `--fake-engine` option is one line naming it, exit code 2, before the port is bound: the engine
    process built the options with a traceback (`unexpected keyword argument`, `'<' not supported`), or
    served with them (a step's sleep of 1e300 s overflows)."""
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--fake-engine", options]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"longctx serve: error: --fake-engine: {want}"]


def test_a_flag_not_for_a_server_names_both_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ruler", "--base-url", "http://127.0.0.1:9", "--out", "x", "--index-topk", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "longctx ruler: error: --index-topk: is for --model (a server runs the engine it was started with)"
    )


def test_each_engine_flag_sets_the_keyword_of_its_name() -> None:
    """An error names an Engine keyword by the flag whose dest it is (`said_as`); the Python API's
    messages name the keyword itself."""
    parser = build_parser()
    args = parser.parse_args(["generate", "--model", WIP, "hi"])
    say = said_as(args.parser)
    assert all(say(k) == "--" + k.replace("_", "-") for k in (*ENGINE_FIELDS, "chunk_size", "min_tokens"))
    with pytest.raises(RequestError) as e:
        SamplingParams(max_new_tokens=4, min_tokens=9).validate()
    assert str(e.value) == "min_tokens 9: must be an integer between 0 and max_new_tokens (4)"
    assert e.value.named(say) == "--min-tokens 9: must be an integer between 0 and --max-new-tokens (4)"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["generate", *CPU, "--max-new-tokens", "x", "hi"], "longctx generate: error: argument --max-new-tokens: invalid int value: 'x'"),
        (["serve", *CPU, "--port", "http"], "longctx serve: error: argument --port: invalid int value: 'http'"),
        (["serve", *CPU, "--tool-call-parser", "hermes"], "longctx serve: error: argument --tool-call-parser: invalid choice: 'hermes' (choose from 'auto', 'glm', 'deepseek_v31', 'deepseek_v32')"),
        (["init-model", "--config", "tiny", "--out", "m", "--init-std", "big"], "longctx init-model: error: argument --init-std: invalid float value: 'big'"),
        (["init-model", "--config", "tiny"], "longctx init-model: error: the following arguments are required: --out"),
        (["plan", "--config", "tiny", "--kv-dtype", "fp16"], "longctx plan: error: argument --kv-dtype: invalid choice: 'fp16' (choose from 'auto', 'model', 'bf16', 'fp8_e4m3')"),
        (["bogus"], "longctx: error: argument COMMAND: invalid choice: 'bogus' (choose from 'serve', 'generate', 'score', 'plan', 'init-model', 'ruler', 'retrieve')"),
    ],
)  # fmt: skip
def test_argparses_own_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], want: str
) -> None:
    """A value argparse itself refuses (`--max-new-tokens x`, an unknown choice, a missing flag) is one line as
    the CLI's other errors are, exit code 2 (argparse printed the whole usage before it: a dozen lines)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [want]


@pytest.mark.parametrize("command", ["generate", "score"])
def test_a_prompt_that_is_not_utf8_is_one_line(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """A command line's byte that is not UTF-8 reads as a lone surrogate (U+DCFF for 0xff), which the
    tokenizer refused with a TypeError: a traceback."""
    assert main([command, *CPU, "ab\udcff"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"longctx {command}: error: the prompt is not valid Unicode: an unpaired surrogate U+DCFF "
        "(byte 0xFF, not UTF-8) at character 2"
    ]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_score_out_that_cannot_be_written_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """torch.save's own open of --out failed as a RuntimeError (a traceback) where a directory takes no new
    file (/proc; a read-only one, as any user but root sees it): the OSError of opening it is one line."""
    out = "/proc/longctx-score.pt"  # (its directory exists: past the check before the model loads)
    assert main(["score", *CPU, "--out", out, "hi"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"longctx score: error: No such file or directory: {out}"]


def test_model_files_that_are_not_utf8_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json (or --config), a chat template, a tokenizer_config.json or a safetensors index that is not
    UTF-8 failed in read_text with a UnicodeDecodeError (a traceback); a tokenizer_config.json that is not an
    object failed with an AttributeError."""
    import shutil

    from longctx.checkpoint.chat_template import load_chat_template
    from longctx.checkpoint.loader import CheckpointReader
    from longctx.errors import CheckpointError

    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"model_type": "\xff"}')
    for argv in (
        ["init-model", "--config", str(bad), "--out", str(tmp_path / "m")],
        ["plan", "--config", str(bad), "--gpus", "1", "--pp", "1", "--context", "1K"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"longctx {argv[0]}: error: {bad} is not valid JSON: 'utf-8' codec can't decode byte "
                       "0xff in position 16: invalid start byte"]  # fmt: skip
    model = tmp_path / "model"
    shutil.copytree(WIP, model)
    (model / "tokenizer_config.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not valid JSON: 'utf-8' codec"):
        load_chat_template(model)
    (model / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is not a JSON object$"):
        load_chat_template(model)
    (model / "chat_template.jinja").write_bytes(b"{{ x }}\xff")
    with pytest.raises(CheckpointError, match=r"chat_template.jinja is not valid UTF-8 \(byte 7\)$"):
        load_chat_template(model)
    (model / "model.safetensors.index.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a safetensors index: "):
        CheckpointReader(model)
    for weight_map in ([["a", "model.safetensors"]], {"a": 1}, "model.safetensors"):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match="index: weight_map must map tensor names to files$"):
            CheckpointReader(model)
    (model / "config.json").write_bytes(b"\xff")
    assert main(["generate", "--model", str(model), "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"longctx generate: error: {model / 'config.json'} is not valid JSON"
    )


def test_engine_size_flags_reach_the_engine_keywords() -> None:
    """--kv-pages, --chunk-size, --max-running (vLLM's --max-num-seqs) and --no-cuda-graphs (vLLM's
    --enforce-eager) are Engine keywords for generate / score and serve alike; left out, the Engine's defaults."""
    from longctx.engine.args import engine_kwargs

    parser = build_parser()
    for cmd in ("generate", "serve"):
        tail = ["hi"] if cmd == "generate" else []
        kw = engine_kwargs(parser.parse_args([cmd, "--model", WIP, *tail]))
        assert (kw["kv_pages"], kw["chunk_size"], kw["max_running"], kw["cuda_graphs"]) == (
            None,
            None,
            64,
            None,
        )
        for flags, want in (
            (["--kv-pages", "40", "--chunk-size", "96", "--max-num-seqs", "3", "--enforce-eager"], (40, 96, 3, False)),
            (["--max-running", "5", "--no-cuda-graphs"], (None, None, 5, False)),
            (["--cuda-graphs"], (None, None, 64, True)),
        ):  # fmt: skip
            kw = engine_kwargs(parser.parse_args([cmd, "--model", WIP, *flags, *tail]))
            assert (kw["kv_pages"], kw["chunk_size"], kw["max_running"], kw["cuda_graphs"]) == want, (
                cmd,
                flags,
            )
