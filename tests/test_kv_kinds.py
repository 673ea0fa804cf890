"""Per-layer KV kinds: an fp8 cache that keeps some layers' KV in the model dtype (`kv_fp8_skip_layers`)."""

from __future__ import annotations

import json

import pytest
import torch
from longctx.kernels import kv_layout as kvl

from longctx import Engine
from longctx.cli import build_parser
from longctx.config import ModelConfig
from longctx.errors import ConfigError, KernelInputError
from longctx.kv_kinds import (
    KVKinds,
    dense_dtype,
    index_kind,
    index_row_bytes,
    is_fp8,
    mla_row_bytes,
    resolve_kv_kinds,
)
from longctx.kvstore.host_pool import HostKVLayout, HostKVSpec, HostPool, HostPoolError
from longctx.kvstore.pool import PagedKVPool
from longctx.workloads.cli_args import embedded_engine_kwargs
from tests.conftest import make_checkpoint, rand_ids, rel, tiny_config

SKIP = (1, 2)  # tiny.json: layer 1 shares layer 0's top-k, layer 2 runs its own indexer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kinds"), tiny_config(), seed=5)


def test_kinds_per_layer_and_pool_layouts():
    cfg = tiny_config()
    kinds = resolve_kv_kinds("fp8_e4m3", torch.device("cpu"), SKIP)
    assert [kinds.mla(i) for i in range(6)] == ["fp8", "auto", "auto", "fp8", "fp8", "fp8"]
    assert [kinds.index(i) for i in range(6)] == ["fp8", "auto", "auto", "fp8", "fp8", "fp8"]
    # only an fp8 cache keeps layers out of it: the model-dtype and bf16 caches are one kind throughout
    for kv_dtype, base in (("auto", "auto"), ("bf16", "bf16"), ("model", "auto")):
        assert resolve_kv_kinds(kv_dtype, torch.device("cpu"), SKIP) == KVKinds(base)
    with pytest.raises(ValueError, match="unknown KV kind"):
        KVKinds("int4")
    pool = PagedKVPool(cfg, range(6), 2, kinds, torch.float32, torch.device("cpu"))
    for i in range(6):
        fp8 = i not in SKIP
        assert pool.mla_pool(i).dtype == (torch.uint8 if fp8 else torch.float32)
        if cfg.is_full_indexer(i):
            assert pool.index_pool(i).dtype == (torch.uint8 if fp8 else torch.float32)
    fp8 = PagedKVPool.bytes_per_token(cfg, range(6), "fp8", torch.float32)
    model = PagedKVPool.bytes_per_token(cfg, range(6), "auto", torch.float32)
    mixed = PagedKVPool.bytes_per_token(cfg, range(6), kinds, torch.float32)
    assert fp8 < mixed < model and pool.nbytes() == mixed * pool.num_slots
    assert PagedKVPool(cfg, range(6), 2, "fp8", torch.float32, torch.device("cpu")).kinds == KVKinds("fp8")


def test_host_spec_with_rows_of_two_sizes():
    spec = HostKVSpec(3, 6, 10, (656, 1152, 656))
    assert [spec.rows_of(i) for i in (3, 4, 5)] == [656, 1152, 656]
    assert [spec.layer_offset(i) for i in (3, 4, 5)] == [0, 8192, 8192 + 12288]
    assert spec.nbytes == 8192 + 12288 + 8192 and not spec.uniform
    with pytest.raises(HostPoolError, match="different sizes"):
        _ = spec.layer_stride
    with pytest.raises(HostPoolError):
        spec.rows_of(6)
    pool, _ = HostPool.create(spec.nbytes, "mixed")
    with pool:
        layout = HostKVLayout(pool, spec)
        assert [tuple(layout.layer_view(i).shape) for i in (3, 4, 5)] == [(10, 656), (10, 1152), (10, 656)]
        layout.layer_view(4).fill_(7)
        assert int(layout.layer_view(3).max()) == 0 and int(layout.layer_view(5).max()) == 0
        with pytest.raises(HostPoolError, match="2 row sizes for 3 layers"):
            HostKVLayout(pool, HostKVSpec(3, 6, 10, (656, 656)))
    assert HostKVSpec(0, 2, 10, (656, 656)).layer_stride == 8192  # (one size: one stride)


def test_engine_skip_layers_from_the_checkpoint_or_the_caller(ckpt, tmp_path):
    ids = rand_ids(120, 3)
    runs = {}
    for name, kw in (
        ("model", {}),
        ("fp8", {"kv_dtype": "fp8_e4m3"}),
        ("all", {"kv_dtype": "fp8_e4m3", "kv_fp8_skip_layers": list(range(6))}),
        ("mixed", {"kv_dtype": "fp8_e4m3", "kv_fp8_skip_layers": SKIP}),
    ):
        with Engine(ckpt, device="cpu", **kw) as e:
            runs[name] = e.score(ids)
            stats = e.stats()
        assert stats["kv_fp8_skip_layers"] == (list(kw.get("kv_fp8_skip_layers", ())) if kw else [])
    assert torch.equal(runs["all"], runs["model"])  # every layer kept: the model-dtype cache exactly
    # keeping two layers exact moves the logits towards the model-dtype cache's
    assert 0 < rel(runs["mixed"], runs["model"]) < rel(runs["fp8"], runs["model"])
    # a checkpoint that names its layers gets them by default; an explicit [] turns them off
    cfg = json.loads((ckpt / "config.json").read_text())
    named = tmp_path / "named"
    named.mkdir()
    for f in ckpt.iterdir():
        (named / f.name).symlink_to(f)
    (named / "config.json").unlink()
    (named / "config.json").write_text(json.dumps({**cfg, "kv_fp8_skip_layers": [2, 1]}))
    assert ModelConfig.from_json(named).kv_fp8_skip_layers == (1, 2)
    assert ModelConfig.from_json(named).to_hf_dict()["kv_fp8_skip_layers"] == [1, 2]
    assert "kv_fp8_skip_layers" not in ModelConfig.from_json(ckpt).to_hf_dict()
    with Engine(named, device="cpu", kv_dtype="fp8_e4m3") as e:
        assert e.stats()["kv_fp8_skip_layers"] == [1, 2]
        assert torch.equal(e.score(ids), runs["mixed"])
    with Engine(named, device="cpu", kv_dtype="fp8_e4m3", kv_fp8_skip_layers=[]) as e:
        assert torch.equal(e.score(ids), runs["fp8"])
    with Engine(named, device="cpu") as e:  # (the CPU default cache is the model dtype throughout)
        assert e.stats()["kv_fp8_skip_layers"] == [] and torch.equal(e.score(ids), runs["model"])


@pytest.mark.parametrize("bad", [[6], [1, 1], [-1], "4", [True], 4])
def test_bad_skip_layers_are_refused(ckpt, tmp_path, bad):
    with pytest.raises(
        ConfigError, match="kv_fp8_skip_layers .+: must be distinct layer numbers in \\[0, 6\\)"
    ):
        Engine(ckpt, device="cpu", kv_dtype="fp8_e4m3", kv_fp8_skip_layers=bad)
    cfg = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ConfigError, match="kv_fp8_skip_layers"):
        ModelConfig.from_dict({**cfg, "kv_fp8_skip_layers": bad})


def test_a_kind_past_the_boundary_is_its_exact_name():
    """A user's kv_dtype is read in any case once (`check_kv_dtype`); past it a kind is compared by name, so
    another spelling is refused, not read as some other kind (index_kind took "FP8" or "fp8_e4m3" for the
    model dtype, dense_dtype "BF16" for bfloat16 and an fp8 kind for the model dtype)."""
    for bad in ("FP8_E4M3", "FP8", "BF16", "Half", "AUTO", "int4"):
        for use in (
            is_fp8,
            dense_dtype,
            index_kind,
            KVKinds,
            lambda k: mla_row_bytes(512, 64, k),
            lambda k: index_row_bytes(128, k),
            lambda k: kvl.alloc_mla_pool(64, 32, 8, k, torch.float32, "cpu"),
            lambda k: kvl.alloc_index_pool(64, 16, k, torch.float32, "cpu"),
        ):
            with pytest.raises(KernelInputError, match=f"unknown KV kind '{bad}'"):
                use(bad)
    assert index_kind("fp8_e4m3") == index_kind("fp8") == "fp8"
    assert index_kind("bf16") == index_kind("auto") == "auto"
    assert dense_dtype("half") == "float16" and dense_dtype("auto", "float32") == "float32"
    with pytest.raises(KernelInputError, match="quantised"):
        dense_dtype("fp8_e4m3")


def test_a_kv_dtype_in_capitals_is_the_same_cache(ckpt):
    """FP8_E4M3 / BF16 given to the Engine or a command line make the pools fp8_e4m3 / bf16 make."""
    ids = rand_ids(70, 4)
    for canonical, other in (("fp8_e4m3", "FP8_E4M3"), ("bf16", "BF16")):
        pools, scores = [], []
        for name in (canonical, other):
            with Engine(ckpt, device="cpu", kv_dtype=name) as e:
                kv = e.runner.worker.kv
                pools.append((e.kv_kinds, [(kv.mla_pool(i).dtype, kv.mla_pool(i).shape) for i in range(6)]))
                scores.append(e.score(ids))
        assert pools[0] == pools[1] and torch.equal(scores[0], scores[1])
        parser = build_parser()
        for argv in (
            ["generate", "--model", "m", "--kv-dtype", other, "hi"],
            ["serve", "--model", "m", "--kv-dtype", other],
            ["plan", "--config", "tiny", "--gpus", "1", "--pp", "1", "--context", "1K", "--kv-dtype", other],
        ):
            assert parser.parse_args(argv).kv_dtype == canonical
        ruler = parser.parse_args(["ruler", "--model", "m", "--kv-dtype", other])
        assert embedded_engine_kwargs(ruler)["kv_dtype"] == canonical
