"""Checkpoint package: tokenizer, chat template, init-model, loader, FP8 block scales, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from longctx.checkpoint.chat_template import DEFAULT_CHAT_TEMPLATE, apply_chat_template, load_chat_template
from longctx.checkpoint.fp8 import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block
from longctx.checkpoint.init_random import init_random_checkpoint, random_tensor
from longctx.checkpoint.layout import expected_weights, is_fp8_weight
from longctx.checkpoint.loader import CheckpointReader, iter_weights, validate_checkpoint
from longctx.checkpoint.tokenizer import (
    SPECIAL_TOKENS,
    decode_bytes,
    encode_bytes,
    load_tokenizer,
    make_tokenizer,
)
from longctx.cli import main as cli_main
from longctx.config import ModelConfig
from longctx.errors import CheckpointError, ConfigError, RequestError

REPO = Path(__file__).resolve().parents[1]
TINY = json.loads((REPO / "configs" / "tiny.json").read_text())


def tiny_cfg(**overrides) -> ModelConfig:
    d = {**TINY, **overrides}
    if d["model_type"] == "deepseek_v32":
        d.pop("indexer_types", None)  # DeepSeek-V3.2: every layer runs the indexer
    return ModelConfig.from_dict(d)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(tiny_cfg())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return init_random_checkpoint(tiny_cfg(), tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


# ---- tokenizer + chat template -----------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips_text(tok, s):
    ids = tok.encode(s).ids
    assert tok.decode(ids, skip_special_tokens=False) == s
    if not any(t in s for t in SPECIAL_TOKENS):
        assert ids == list(s.encode("utf-8"))  # id == byte value


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_tokenizer_round_trips_bytes(tok, b):
    ids = encode_bytes(tok, b)
    assert ids == list(b)
    assert decode_bytes(tok, ids) == b


def test_special_tokens(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == 256 + i
    assert tok.get_vocab_size() == 264
    s = "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    ids = tok.encode(s).ids
    assert ids[:3] == [262, 263, 258] and tok.decode(ids, skip_special_tokens=False) == s
    assert (
        decode_bytes(tok, ids) == s.encode() and decode_bytes(tok, ids, skip_special_tokens=True) == b"\nhi\n"
    )
    with pytest.raises(ConfigError, match="vocab_size 200 is too small"):
        make_tokenizer(tiny_cfg(vocab_size=200, eos_token_id=1, pad_token_id=0))


MESSAGES = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "👋"}]},
        {"role": "assistant", "content": "hi\n"},
        {"role": "tool", "content": '{"x": 1}'},
    ],
    [  # a tool call (OpenAI's arguments text, read as a dict for the template) and its answer
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "Pé", "n": [1]}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


@pytest.mark.parametrize("msgs", MESSAGES)
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_builtin_matches_jinja(msgs, gen, tools):
    a = apply_chat_template(msgs, add_generation_prompt=gen, use_jinja=True, tools=tools)
    b = apply_chat_template(msgs, add_generation_prompt=gen, use_jinja=False, tools=tools)
    assert a == b and a.startswith("[gMASK]<sop><|")
    assert a.endswith("<|assistant|>\n") == gen
    assert ('"name": "get"' in a) == bool(tools)
    if msgs is MESSAGES[2]:  # (GLM's call format, which the server reads back under tool_choice "auto")
        want = "<tool_call>get<arg_key>city</arg_key><arg_value>Pé</arg_value><arg_key>n</arg_key><arg_value>[1]</arg_value></tool_call><tool_call>now</tool_call>"
        assert want in a


def test_chat_template_text_and_errors():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert apply_chat_template(msgs) == "[gMASK]<sop><|system|>\ns<|user|>\nu<|assistant|>\n"
    for use_jinja in (True, False):
        with pytest.raises(RequestError, match="unknown role 'robot'"):
            apply_chat_template([{"role": "robot", "content": "x"}], use_jinja=use_jinja)


def test_transformers_autotokenizer_loads_dir(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = load_tokenizer(tiny_dir)
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 257 and hf.pad_token_id == 256
    msgs = MESSAGES[1]
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == apply_chat_template(msgs)
    # with tools and a tool call whose arguments are a dict (what longctx hands the template too)
    calls = [{**m, "tool_calls": [{**tc, "function": {**tc["function"], "arguments": json.loads(tc["function"]["arguments"])}} for tc in m["tool_calls"]]} if m.get("tool_calls") else m for m in MESSAGES[2]]  # fmt: skip
    got = hf.apply_chat_template(calls, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got == apply_chat_template(MESSAGES[2], tools=TOOLS)
    assert hf(text, add_special_tokens=True)["input_ids"] == ours.encode(text).ids
    assert load_chat_template(tiny_dir) == DEFAULT_CHAT_TEMPLATE


def test_load_tokenizer_absent(tmp_path):
    assert load_tokenizer(tmp_path) is None
    assert load_chat_template(tmp_path) is None


# ---- init-model vs transformers ----------------------------------------------------------------
def _hf_reference(hf_sd: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], cfg: ModelConfig, atol=0.0):
    """Compare transformers' (fused-expert) state dict to our per-expert tensors."""
    for k, v in hf_sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            ref = torch.stack(
                [
                    torch.cat([ours[f"{p}{e}.gate_proj.weight"], ours[f"{p}{e}.up_proj.weight"]])
                    for e in range(cfg.n_routed_experts)
                ]
            )
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            ref = torch.stack([ours[f"{p}{e}.down_proj.weight"] for e in range(cfg.n_routed_experts)])
        else:
            ref = ours[k]
        if atol:
            assert torch.allclose(v.float(), ref.float(), atol=atol, rtol=0), k
        else:
            assert v.dtype == ref.dtype and torch.equal(v, ref), k


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_transformers_loads_identical_weights(tmp_path, model_type):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg(model_type=model_type)
    d = init_random_checkpoint(cfg, tmp_path / "m", seed=1)
    assert (d / "model.safetensors").exists() and not (d / "model.safetensors.index.json").exists()
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 257
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    want_cls = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}[model_type]
    assert type(model).__name__ == want_cls
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = dict(iter_weights(d, ModelConfig.from_json(d)))
    assert set(ours) == set(expected_weights(cfg))
    _hf_reference(model.state_dict(), ours, cfg)
    # Norms, the indexer LayerNorm bias and the router correction bias are deliberately non-trivial.
    assert not torch.allclose(ours["model.norm.weight"], torch.ones(cfg.hidden_size))
    assert ours["model.layers.0.self_attn.indexer.k_norm.bias"].abs().min() > 0
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    has_indexer = [
        f"model.layers.{i}.self_attn.indexer.wk.weight" in ours for i in range(cfg.num_hidden_layers)
    ]
    assert has_indexer == [model_type == "deepseek_v32" or t == "full" for t in cfg.indexer_types]


def test_dtype_and_router_precision(tmp_path):
    cfg = tiny_cfg()
    d = init_random_checkpoint(cfg, tmp_path / "m", dtype="bfloat16")
    assert ModelConfig.from_json(d).torch_dtype == "bfloat16"
    with CheckpointReader(d) as r:
        assert r.get("model.layers.0.self_attn.q_a_proj.weight").dtype == torch.bfloat16
        assert r.get("model.layers.1.mlp.gate.weight").dtype == torch.float32
    w = dict(iter_weights(d, cfg, layers=range(1, 2), dtype=torch.bfloat16))
    assert w["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert w["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16


# ---- sharding and lazy stage reads -------------------------------------------------------------
def test_sharded_write_and_stage_reads(tmp_path, tiny_dir):
    cfg = tiny_cfg()
    d = init_random_checkpoint(cfg, tmp_path / "m", seed=3, max_shard_bytes=60_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and not (d / "model.safetensors").exists()
    for f in files:  # a tensor larger than the limit (the embedding here) gets a shard of its own
        members = [n for n, g in index["weight_map"].items() if g == f]
        assert len(members) == 1 or (d / f).stat().st_size <= 60_000 + 8192  # + safetensors header
    assert validate_checkpoint(d).files == tuple(files)
    # Same seed, different sharding: identical tensors.
    a, b = dict(iter_weights(d, cfg)), dict(iter_weights(tiny_dir, cfg))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A stage reads only its own layers, and opens only the shards that hold them.
    with CheckpointReader(d) as r:
        mid = dict(iter_weights(r, cfg, layers=range(2, 4)))
        assert set(r._handles) == {index["weight_map"][n] for n in mid}
        assert len(r._handles) < len(files)
    assert all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in mid)
    first = list(iter_weights(d, cfg, layers=range(0, 2)))
    assert first[0][0] == "model.embed_tokens.weight" and "lm_head.weight" not in dict(first)
    last = [n for n, _ in iter_weights(d, cfg, layers=range(4, 6))]
    assert last[-2:] == ["model.norm.weight", "lm_head.weight"] and "model.embed_tokens.weight" not in last
    assert [n for n, _ in iter_weights(d, cfg, layers=[], embed=False, head=True)] == last[-2:]


def test_init_is_deterministic_and_seeded():
    a = random_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), seed=0)
    assert torch.equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), seed=0))
    assert not torch.equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), seed=1))
    assert not torch.equal(a, random_tensor("model.layers.1.mlp.up_proj.weight", (8, 4), seed=0))


# ---- FP8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (64, 32), (128, 128), (200, 130), (257, 384)])
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_quant_dequant_bounds(shape, block):
    g = torch.Generator().manual_seed(sum(shape) * 131 + sum(block))
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])  # wide dynamic range
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    back = dequantize_fp8_block(q, s, block, torch.float32)
    # Tile scale = amax/448: e4m3 rounding is at most 2^-4 relative for normals, plus half the
    # smallest subnormal step (2^-10 * scale) near zero.
    srep = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    assert ((back - w).abs() <= w.abs() / 16 + srep * 2**-10 + 1e-12).all()
    # The tile maximum is represented exactly (it maps to 448).
    assert torch.isclose(back.abs().max(), w.abs().max(), rtol=1e-6)
    # DeepSeek weight_dequant semantics, element by element.
    i, j = shape[0] - 1, shape[1] - 1
    assert back[i, j] == q[i, j].float() * s[i // block[0], j // block[1]]


def test_fp8_zero_tile_and_bad_scale():
    q, s = quantize_fp8_block(torch.zeros(130, 10))
    assert torch.equal(s, torch.ones(2, 1)) and not dequantize_fp8_block(q, s).any()
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_block(q, torch.ones(1, 1))


def test_fp8_checkpoint(tmp_path, tiny_dir):
    # hidden 160 / q_lora 136 make several weights span two 128-blocks with ragged edges.
    cfg = tiny_cfg(hidden_size=160, q_lora_rank=136)
    ref_dir = init_random_checkpoint(cfg, tmp_path / "ref", seed=5, dtype="float32")
    d = init_random_checkpoint(cfg, tmp_path / "fp8", seed=5, fp8=True, dtype="bfloat16")
    disk = ModelConfig.from_json(d)
    assert disk.quant_block == (128, 128) and disk.torch_dtype == "bfloat16"
    assert json.loads((d / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    summary = validate_checkpoint(d)
    assert summary.num_fp8 == sum(map(is_fp8_weight, expected_weights(cfg)))
    with CheckpointReader(d) as r:
        kept = {n: r.get(n).dtype for n in r.names()}
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.0.self_attn.indexer.k_norm.bias",
        "model.layers.0.self_attn.q_a_layernorm.weight",
    ):
        assert kept[name] == torch.bfloat16, name
    assert kept["model.layers.1.mlp.gate.weight"] == torch.float32
    for name in (
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
    ):
        assert kept[name] == FP8_DTYPE and kept[name + "_scale_inv"] == torch.float32, name
    ref = dict(iter_weights(ref_dir, cfg))
    deq = dict(iter_weights(d, disk))
    assert deq.keys() == ref.keys()
    for n, w in ref.items():
        tol = w.abs().max() / 16 if is_fp8_weight(n) else w.abs().max() / 128  # fp8 vs bf16 rounding
        assert (deq[n] - w).abs().max() <= tol, n
    # keep_fp8: the fp8 weight then its scales, nothing dequantised.
    raw = list(iter_weights(d, disk, layers=range(0, 1), keep_fp8=True, embed=False, head=False))
    names = [n for n, _ in raw]
    i = names.index("model.layers.0.self_attn.o_proj.weight")
    assert names[i + 1] == "model.layers.0.self_attn.o_proj.weight_scale_inv"
    assert raw[i][1].dtype == FP8_DTYPE and tuple(raw[i + 1][1].shape) == (2, 1)


def test_transformers_loads_fp8_checkpoint(tmp_path):
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it; it dequantises on CPU
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg()
    d = init_random_checkpoint(cfg, tmp_path / "m", fp8=True, dtype="float32")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _hf_reference(model.state_dict(), dict(iter_weights(d, ModelConfig.from_json(d))), cfg, atol=1e-6)


# ---- loader errors -----------------------------------------------------------------------------
def _rewrite(d: Path, fn) -> None:
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_error_missing_tensor(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.3.mlp.gate.weight"))
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(d)
    assert _one_line_error(e) == "checkpoint is missing model.layers.3.mlp.gate.weight"
    with pytest.raises(CheckpointError, match="missing model.layers.3.mlp.gate.weight"):
        list(iter_weights(d, tiny_cfg(), layers=range(3, 4)))
    list(iter_weights(d, tiny_cfg(), layers=range(0, 3)))  # other stages still load


def test_error_unexpected_tensor_and_mtp_ignored(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path)

    def add(t):
        t["model.layers.6.self_attn.q_a_proj.weight"] = torch.zeros(2, 2)  # MTP layer: ignored
        t["model.layers.6.eh_proj.weight"] = torch.zeros(2, 2)

    _rewrite(d, add)
    validate_checkpoint(d)
    _rewrite(d, lambda t: t.__setitem__("model.layers.1.self_attn.indexer.wk.weight", torch.zeros(16, 64)))
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(d)
    assert "unexpected tensor model.layers.1.self_attn.indexer.wk.weight" in _one_line_error(e)


def test_error_shape_mismatch(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path)
    _rewrite(d, lambda t: t.__setitem__("model.layers.2.self_attn.o_proj.weight", torch.zeros(64, 32)))
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(d)
    assert _one_line_error(e) == (
        "model.layers.2.self_attn.o_proj.weight has shape [64, 32] in the checkpoint, expected [64, 64] from the config"
    )
    with pytest.raises(CheckpointError, match=r"o_proj.weight has shape \[64, 32\]"):
        list(iter_weights(d, tiny_cfg(), layers=[2]))


def test_error_fp8_without_scale(tmp_path):
    cfg = tiny_cfg()
    d = init_random_checkpoint(cfg, tmp_path / "m", fp8=True)
    _rewrite(d, lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale_inv"))
    for call in (lambda: validate_checkpoint(d), lambda: list(iter_weights(d, ModelConfig.from_json(d)))):
        with pytest.raises(CheckpointError) as e:
            call()
        assert _one_line_error(e) == (
            "model.layers.0.mlp.up_proj.weight is fp8 but the checkpoint has no "
            "model.layers.0.mlp.up_proj.weight_scale_inv"
        )


def test_error_missing_files(tmp_path, tiny_dir):
    d = init_random_checkpoint(tiny_cfg(), tmp_path / "sh", max_shard_bytes=200_000)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(d)
    assert (
        _one_line_error(e) == f"shard {shard.name} named by model.safetensors.index.json is missing from {d}"
    )

    empty = tmp_path / "empty"
    shutil.copytree(tiny_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights in"):
        validate_checkpoint(empty)
    (empty / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json in"):
        validate_checkpoint(empty)
    with pytest.raises(CheckpointError, match="model directory not found"):
        CheckpointReader(tmp_path / "nowhere")


def test_error_unknown_model_type(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConfigError) as e:
        validate_checkpoint(d)
    assert _one_line_error(e).startswith("unknown model_type 'llama'")


def test_error_layer_out_of_range():
    with pytest.raises(ConfigError, match="layer 6 is out of range"):
        expected_weights(tiny_cfg(), layers=range(4, 7))


# ---- CLI ---------------------------------------------------------------------------------------
def test_cli_init_model(tmp_path, capsys, tiny_dir):
    out = tmp_path / "m"
    assert cli_main(["init-model", "--config", "tiny", "--out", str(out), "--seed", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    a, b = dict(iter_weights(out, tiny_cfg())), dict(iter_weights(tiny_dir, tiny_cfg()))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A non-empty --out is refused without --force.
    assert cli_main(["init-model", "--config", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not empty" in err
    assert (
        cli_main(
            [
                "init-model",
                "--config",
                str(REPO / "configs/tiny.json"),
                "--out",
                str(out),
                "--force",
                "--fp8",
                "--max-shard-bytes",
                "100000",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert not (out / "model.safetensors").exists()  # stale single file removed by --force
    assert validate_checkpoint(out).num_fp8 > 0


def test_cli_init_model_refuses_a_checkpoint_that_does_not_fit(tmp_path, capsys, monkeypatch):
    """A config too large for the memory or the disk is one line before anything is written or replaced (it
    was a traceback at the first tensor too large to allocate, or a full disk hours in)."""
    huge, out = tmp_path / "huge.json", tmp_path / "m"
    huge.write_text(json.dumps({**TINY, "vocab_size": 10**9, "hidden_size": 10**6}))  # a 4e15-byte embedding
    assert cli_main(["init-model", "--config", str(huge), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "longctx init-model: error: this checkpoint needs at least 8,000,000.0 GB of memory, "
    )
    assert "\n" not in err and not out.exists()
    # the disk: --force over a bfloat16 checkpoint, a float32 one (twice its size) where nothing else is free
    assert cli_main(["init-model", "--config", "tiny", "--out", str(out), "--dtype", "bfloat16"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    assert cli_main(["init-model", "--config", "tiny", "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"GB of disk space in {out}, 0.0 GB available" in err and "\n" not in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_cli_bad_config_subprocess(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longctx.cli",
            "init-model",
            "--config",
            "no-such-config",
            "--out",
            str(tmp_path / "m"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config 'no-such-config' not found" in lines[0]
    assert not (tmp_path / "m").exists()
