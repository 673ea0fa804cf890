"""`longctx plan`: parameter accounting against the source articles, the layer partition, the CLI."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.cli import main
from longctx.config import ModelConfig
from longctx.errors import ConfigError, LongctxError
from longctx.model import params as P
from longctx.stages.partition import (
    balanced_split,
    layer_cost,
    partition,
    split_from_boundaries,
    stage_costs,
)
from longctx.stages.plan import parse_bytes, parse_tokens

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
M = 1_048_576


@pytest.fixture(scope="module")
def glm() -> ModelConfig:
    return ModelConfig.from_json(CONFIGS / "glm-5.3.json")


# ---- parameters vs the articles -----------------------------------------------------------------
def test_glm_totals_match_articles(glm: ModelConfig) -> None:
    assert glm.num_hidden_layers == 78
    assert P.n_full_indexer_layers(glm) == 21
    assert abs(P.params_total(glm) / 744e9 - 1) < 0.015
    assert abs(P.params_active(glm) / 40e9 - 1) < 0.05
    # The articles' convention (whole embedding matrix counted as active) is within 5% as well.
    assert abs(P.params_active(glm, full_embedding=True) / 40e9 - 1) < 0.05


def test_glm_components_match_articles(glm: ModelConfig) -> None:
    dense, moe_full, moe_shared = P.layer_params(glm, 0), P.layer_params(glm, 6), P.layer_params(glm, 5)
    assert abs(dense["attention"] / 165e6 - 1) < 0.005
    assert abs(dense["indexer"] / 9.4e6 - 1) < 0.005 and moe_full["indexer"] == dense["indexer"]
    assert moe_shared["indexer"] == 0
    assert dense["dense_mlp"] == 3 * 6144 * 12288  # 226.5M
    assert moe_full["routed_experts"] == 256 * 3 * 6144 * 2048
    assert moe_full["shared_experts"] == 3 * 6144 * 2048
    assert moe_full["router"] == 256 * 6144 + 256
    d = P.params_by_component(glm)
    assert d["embed"] == d["lm_head"] == 154880 * 6144
    assert d["indexer"] == 21 * dense["indexer"]
    assert sum(d.values()) == P.params_total(glm)


def test_deepseek_v32_totals() -> None:
    cfg = ModelConfig.from_json(CONFIGS / "deepseek-v3.2.json")
    assert abs(P.params_total(cfg) / 671e9 - 1) < 0.01
    assert abs(P.params_active(cfg) / 37e9 - 1) < 0.05
    assert P.n_full_indexer_layers(cfg) == cfg.num_hidden_layers  # no IndexShare


def test_weight_bytes_fp8_scales(glm: ModelConfig) -> None:
    w = next(x for x in P.layer_weights(glm, 0) if x.name.endswith("q_a_proj.weight"))
    assert w.shape == (2048, 6144)
    assert w.nbytes("fp8") == 2048 * 6144 + (2048 // 128) * (6144 // 128) * 4
    assert w.nbytes("bf16") == 2 * 2048 * 6144
    norm = next(x for x in P.layer_weights(glm, 0) if x.name.endswith("input_layernorm.weight"))
    assert norm.nbytes("fp8") == 2 * 6144  # norms stay bf16
    bias = next(x for x in P.layer_weights(glm, 3) if x.name.endswith("e_score_correction_bias"))
    assert bias.nbytes("bf16") == 4 * 256
    fp8 = P.model_weight_bytes(glm, "fp8")
    # ~1 byte per parameter, + bf16 embed/lm_head (1.9 GB) + scales (4 B per 16384 params).
    assert 744e9 < fp8 < 748e9
    assert P.model_weight_bytes(glm, "bf16") > 2 * P.params_total(glm) - 1e6


def test_cache_bytes(glm: ModelConfig) -> None:
    assert P.kv_bytes_per_token_per_layer(glm, "fp8_e4m3") == 656
    assert P.kv_bytes_per_token_per_layer(glm, "bf16") == 1152
    assert P.indexer_bytes_per_token(glm, "fp8_e4m3") == 132
    with pytest.raises(ConfigError):
        P.kv_bytes_per_token_per_layer(glm, "int4")


def test_layers_kept_out_of_fp8_cost_bf16_bytes(glm: ModelConfig) -> None:
    """A config's kv_fp8_skip_layers: those layers' rows (and a full layer's index keys) at bf16's bytes in
    an fp8 cache, nothing else changes; a bf16 cache is bf16 throughout."""
    full = next(i for i in range(glm.num_hidden_layers) if glm.is_full_indexer(i))
    kept = replace(glm, kv_fp8_skip_layers=(full,))
    n = glm.num_hidden_layers
    nfull = P.n_full_indexer_layers(glm)
    assert P.kv_bytes_of_layers(kept, 0, n) == ((n - 1) * 656 + 1152, (nfull - 1) * 132 + 256)
    assert P.kv_bytes_of_layers(kept, 0, n, "bf16") == (n * 1152, nfull * 256)
    a, b = partition(glm, 8, M), partition(kept, 8, M)
    assert sum(p.kv_bytes_host for p in b) - sum(p.kv_bytes_host for p in a) == (1152 - 656) * M
    assert sum(p.indexer_bytes for p in b) - sum(p.indexer_bytes for p in a) == (256 - 132) * M


def test_kv_at_1m_exact(glm: ModelConfig) -> None:
    plans = partition(glm, 8, M)
    assert sum(p.kv_bytes_host for p in plans) == 78 * 656 * M  # 53.7 GB
    assert sum(p.kv_bytes_device for p in plans) == 78 * 656 * M
    assert sum(p.indexer_bytes for p in plans) == 21 * 132 * M  # 2.9 GB
    assert round(78 * 656 * M / 1e9, 1) == 53.7 and round(21 * 132 * M / 1e9, 1) == 2.9


# ---- partition -------------------------------------------------------------------------------------
costs_st = st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, pp=st.integers(1, 4), extras=st.tuples(st.floats(0, 50), st.floats(0, 50)))
def test_balanced_split_is_optimal(costs: list[float], pp: int, extras: tuple[float, float]) -> None:
    n = len(costs)
    if pp > n:
        with pytest.raises(ConfigError):
            balanced_split(costs, pp, *extras)
        return
    bounds = balanced_split(costs, pp, *extras)
    assert len(bounds) == pp and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)  # non-empty
    assert all(bounds[s][1] == bounds[s + 1][0] for s in range(pp - 1))  # contiguous
    covered = [i for a, b in bounds for i in range(a, b)]
    assert covered == list(range(n))  # every layer in exactly one stage
    got = max(stage_costs(costs, bounds, *extras))
    brute = min(
        max(stage_costs(costs, split_from_boundaries(cuts, pp, n), *extras))
        for cuts in itertools.combinations(range(1, n), pp - 1)
    )
    assert got <= brute * (1 + 1e-9) + 1e-9


def test_manual_split(glm: ModelConfig) -> None:
    cuts = partition(glm, 4, M, [20, 40, 60])
    full = partition(glm, 4, M, [0, 20, 40, 60, 78])
    assert [p.layers for p in cuts] == [p.layers for p in full] == [(0, 20), (20, 40), (40, 60), (60, 78)]
    for bad in ([20, 40], [0, 20, 40, 60, 77], [1, 20, 40, 60, 78], [20, 20, 60], [40, 20, 60], [20, 40, 78]):
        with pytest.raises(ConfigError) as e:
            partition(glm, 4, M, bad)
        assert "\n" not in str(e.value)


def test_stage_extras_and_memory(glm: ModelConfig) -> None:
    plans = partition(glm, 8, M, host_mem=2 * 10**12)
    assert sum(p.n_layers for p in plans) == 78
    assert sum(p.full_indexer_layers for p in plans) == 21
    # Totals over stages are the whole model as loaded (embed on stage 0, head on the last): the checkpoint
    # plus the absorbed W_UK / W_UV and the fp32 router.
    loaded = P.loaded_weight_bytes(glm, range(78), P.PLAN_ITEMSIZE, True)
    assert sum(p.weight_bytes for p in plans) == loaded > P.model_weight_bytes(glm, "fp8")
    assert all(p.weight_bytes < 140 * 2**30 for p in plans)
    assert plans[-1].headroom_bytes > plans[1].headroom_bytes  # lm_head logits
    # Host limit: every stage is on one node; the pool holds the whole MLA KV per request.
    assert {p.requests_fit_host for p in plans} == {2 * 10**12 // (78 * 656 * M)}
    assert min(p.requests_fit for p in plans) >= 1


def test_tp_splits_weights(glm: ModelConfig) -> None:
    split = [20, 40, 60]
    one, two = partition(glm, 4, M, split, tp=1), partition(glm, 4, M, split, tp=2)
    for a, b in zip(one, two):
        assert a.weight_bytes / 2 < b.weight_bytes < a.weight_bytes  # replicated parts stay whole
        assert a.kv_bytes_device == b.kv_bytes_device  # the MLA latent is shared by all heads
        assert a.kv_bytes_host == b.kv_bytes_host  # host pool once per node, not per rank
    with pytest.raises(ConfigError):
        partition(glm, 2, M, tp=3)  # 64 heads


def test_hisparse_caps_device_kv(glm: ModelConfig) -> None:
    full, cap = partition(glm, 8, M), partition(glm, 8, M, hisparse_device_tokens=65536)
    for a, b in zip(full, cap):
        assert b.kv_bytes_device == b.n_layers * 65536 * 656
        assert b.kv_bytes_host == a.kv_bytes_host and b.indexer_bytes == a.indexer_bytes
        assert b.requests_fit_device > a.requests_fit_device


def test_indexer_layers_cost_more_at_long_context(glm: ModelConfig) -> None:
    assert glm.is_full_indexer(6) and not glm.is_full_indexer(7)
    short = layer_cost(glm, 6, 4096) / layer_cost(glm, 7, 4096)
    long = layer_cost(glm, 6, M) / layer_cost(glm, 7, M)
    assert 1.0 < short < long


def test_parsers() -> None:
    assert parse_bytes("141G") == 141 * 10**9 == parse_bytes("141GB")
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5T") == 1_500_000_000_000
    assert parse_bytes("1024") == 1024
    assert parse_tokens("1M") == M and parse_tokens("128k") == 131072
    for bad in ("", "12X", "iB", "-3G"):
        with pytest.raises(LongctxError):
            parse_bytes(bad)


# ---- CLI -------------------------------------------------------------------------------------------
def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--config", "glm-5.3", "--gpus", "8", "--pp", "4", "--tp", "2", "--context", "1048576",
               "--host-mem", "2T", "--json"])  # fmt: skip
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for k in ("params_total", "params_active", "kv_bytes_per_token_per_layer",
              "indexer_bytes_per_token_per_full_layer", "context", "stages", "kv_bytes_per_request",
              "indexer_bytes_per_request", "requests_fit"):  # fmt: skip
        assert k in r
    assert r["kv_bytes_per_token_per_layer"] == 656 and r["indexer_bytes_per_token_per_full_layer"] == 132
    assert r["kv_bytes_per_request"] == 78 * 656 * M and r["indexer_bytes_per_request"] == 21 * 132 * M
    assert len(r["stages"]) == 4
    for s in r["stages"]:
        for k in ("layers", "weight_bytes", "kv_bytes_device", "kv_bytes_host", "indexer_bytes",
                  "headroom_bytes", "requests_fit"):  # fmt: skip
            assert k in s
    assert r["stages"][0]["layers"][0] == 0 and r["stages"][-1]["layers"][1] == 78
    assert r["requests_fit"] == min(s["requests_fit"] for s in r["stages"])


def test_cli_table_and_path(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--config", str(CONFIGS / "tiny.json"), "--gpus", "2", "--pp", "2", "--context", "4K",
               "--kv-dtype", "bf16", "--layer-split", "3"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "requests that fit" in out and "0-2" in out and "3-5" in out


@pytest.mark.parametrize(
    "extra",
    [
        ["--gpus", "8", "--pp", "4"],  # gpus != pp * tp
        ["--gpus", "8", "--pp", "8", "--gpu-mem", "lots"],
        ["--gpus", "8", "--pp", "8", "--gpu-mem", "0"],
        ["--gpus", "8", "--pp", "8", "--layer-split", "1,2"],
        ["--gpus", "x", "--pp", "8"],
        ["--gpus", "8", "--pp", "8", "--context", "0"],
        ["--gpus", "6", "--pp", "2", "--tp", "3"],
        ["--gpus", "100", "--pp", "100"],  # more stages than layers
    ],
)
def test_cli_bad_args(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--config", "glm-5.3", "--context", "1M", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("longctx plan: error:") and "\n" not in err


def test_cli_unknown_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", "no-such-model", "--gpus", "1", "--pp", "1", "--context", "1K"]) == 2
    err = capsys.readouterr().err.strip()
    assert "glm-5.3" in err and "\n" not in err


def test_plan_reads_dtype_names_as_the_engine_does(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --kv-dtype` takes the engine's list and names (fp8, bfloat16, auto, model: argparse refused all
    but fp8_e4m3 and bf16 here), `--weight-dtype` bf16 and fp8 by the same names."""

    def report(*extra: str) -> tuple[int, int, int]:
        argv = ["plan", "--config", "glm-5.3", "--gpus", "8", "--pp", "8", "--context", "128K", "--json"]
        assert main([*argv, *extra]) == 0
        r = json.loads(capsys.readouterr().out)
        return r["kv_bytes_per_request"], r["indexer_bytes_per_request"], r["model_weight_bytes"]

    fp8 = report()
    assert report("--kv-dtype", "fp8") == report("--kv-dtype", "FP8") == report("--kv-dtype", "auto") == fp8
    bf16 = report("--kv-dtype", "bf16")
    assert report("--kv-dtype", "bfloat16") == report("--kv-dtype", "model") == bf16 != fp8
    assert report("--weight-dtype", "bfloat16") == report("--weight-dtype", "BF16") != fp8
    assert report("--weight-dtype", "fp8_e4m3") == fp8
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", "glm-5.3", "--gpus", "1", "--pp", "1", "--context", "1K", "--kv-dtype", "fp16"])  # fmt: skip
    assert e.value.code == 2 and "invalid choice: 'fp16'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "glm-5.3"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16", "model"])
def test_planner_kv_bytes_are_the_allocated_pools(name: str, kv_dtype: str) -> None:
    """The planner's bytes per token (MLA rows + index keys) are the bytes of the pools the engine allocates
    for the same layers, kinds and layers kept out of fp8 (one formula: `longctx.kv_kinds`)."""
    import torch

    from longctx.kv_kinds import resolve_kv_kinds
    from longctx.kvstore.pool import PagedKVPool

    cfg = ModelConfig.from_json(CONFIGS / f"{name}.json")
    n = cfg.num_hidden_layers
    full = [i for i in range(n) if cfg.is_full_indexer(i)]
    shared = [i for i in range(n) if not cfg.is_full_indexer(i)]
    for skip in ((), (full[-1],), (full[0], shared[0])):
        c = replace(cfg, kv_fp8_skip_layers=skip)
        kinds = resolve_kv_kinds(kv_dtype, "cuda", skip)  # (as the engine resolves them on CUDA)
        for stage in partition(c, 2, 4096, kv_dtype=kv_dtype):
            a, b = stage.layers
            pool = PagedKVPool(c, range(a, b), 1, kinds, torch.bfloat16, torch.device("cpu"))
            per_token = pool.nbytes() // pool.num_slots
            assert sum(P.kv_bytes_of_layers(c, a, b, kv_dtype)) == per_token
            assert stage.kv_bytes_host + stage.indexer_bytes == 4096 * per_token


def _held_bytes(model) -> int:
    """Bytes of every tensor the model's modules hold (parameters, fp8 scales, the absorbed and stacked
    weights `finalize` derives), each storage once at its largest tensor: what a GPU holds (there the load
    copies a row shard alone; on the CPU it stays a view of the checkpoint tensor). The rotary
    frequencies and the router's 4-byte launch counter (`Router.done`) are not weights."""
    import torch

    from longctx.model.moe import Router
    from longctx.model.rope import RotaryEmbedding

    held: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            continue
        for t in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]:
            if isinstance(m, Router) and t is m.done:
                continue
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                held[key] = max(held.get(key, 0), t.numel() * t.element_size())
    return sum(held.values())


ODD_VOCAB = {
    "vocab_size": 319
}  # tp = 2 splits it 159 / 160: the ranks' embedding and lm_head differ by a row
TIED = {"vocab_size": 319, "tie_word_embeddings": True}


@pytest.mark.parametrize(
    ("fp8", "dtype", "stages", "tp", "extra"),
    [
        (False, "bfloat16", 1, 1, {}),
        (False, "float32", 1, 1, {}),
        (True, "bfloat16", 1, 1, {}),
        (True, "float32", 1, 1, {}),
        (False, "bfloat16", 2, 1, {}),
        (True, "bfloat16", 2, 1, {}),
        (False, "bfloat16", 1, 2, {}),
        (False, "float32", 2, 2, {}),
        (True, "bfloat16", 1, 2, {}),
        (False, "bfloat16", 2, 2, ODD_VOCAB),
        (True, "bfloat16", 1, 2, ODD_VOCAB),
        (
            False,
            "bfloat16",
            1,
            1,
            TIED,
        ),  # (float32 from a float32 checkpoint: both views of one mmap on the CPU)
        (False, "bfloat16", 1, 2, TIED),
        (False, "float32", 2, 2, TIED),
    ],
)
def test_loaded_weight_bytes_are_the_models(
    tmp_path: Path, fp8: bool, dtype: str, stages: int, tp: int, extra: dict
) -> None:
    """`loaded_weight_bytes` (what the engine's room check counts) is what `build_model` holds: in the
    model dtype, or block-fp8 with its scales kept (as on CUDA), for each stage's layers (pp=2: the
    embedding on the first, the head on the last) and the most loaded TP rank's shard. The embedding and
    lm_head are vocab-parallel: a rank holds its vocab / tp rows (rounded either way when tp does not
    divide the vocabulary, the last rank the wider); a tied lm_head is the embedding's parameter where
    the stage holds both, else a copy of its rows."""
    import torch

    from longctx.engine.worker import build_model
    from longctx.stages.runtime import stage_layers
    from longctx.stages.tp import TPShard, shard_range
    from tests.conftest import make_checkpoint, tiny_config

    # fp8 experts need moe_intermediate_size in whole 128-blocks; hidden 160 / q_lora 136: ragged blocks
    over = {"hidden_size": 160, "q_lora_rank": 136, "moe_intermediate_size": 128} if fp8 else {}
    d = make_checkpoint(tmp_path / "m", tiny_config(**over, **extra), fp8=fp8)
    cfg = ModelConfig.from_json(d)
    dt = getattr(torch, dtype)
    split = stage_layers(cfg, stages, tp, 64, 64, None)
    assert len(split) == stages and split[0][0] == 0 and split[-1][1] == cfg.num_hidden_layers
    widest = -(-cfg.vocab_size // tp)
    for a, b in split:
        layers = range(a, b)
        loaded = P.loaded_weight_bytes(cfg, layers, dt.itemsize, fp8, tp)
        # embedding, lm_head (a tied one its own copy only on a stage without the embedding)
        vocab_tensors = (a == 0) + (b == cfg.num_hidden_layers and not (cfg.tie_word_embeddings and a == 0))
        for rank in range(tp):
            shard = TPShard(cfg, rank, tp) if tp > 1 else None
            model = build_model(
                d,
                cfg,
                layers,
                torch.device("cpu"),
                dt,
                fp8,
                shard.shard_weights if shard else None,
                (lambda m, s=shard: s.shard_model(m, lambda t: None, lambda t: t[None])) if shard else None,
            )
            v0, v1 = shard_range(cfg.vocab_size, rank, tp)
            # (the tiny model's other shards divide evenly: only the vocabulary rows set ranks apart)
            short = (widest - (v1 - v0)) * cfg.hidden_size * dt.itemsize * vocab_tensors
            assert loaded - short == _held_bytes(model), rank
            if model.lm_head is not None:
                assert model.lm_head.weight.shape[0] == v1 - v0
                tied_here = cfg.tie_word_embeddings and model.model.embed_tokens is not None
                assert tied_here == (
                    model.model.embed_tokens is not None
                    and model.lm_head.weight is model.model.embed_tokens.weight
                )
            if model.model.embed_tokens is not None:
                assert model.model.embed_tokens.weight.shape[0] == v1 - v0


@pytest.mark.parametrize("name", ["tiny", "small-1m", "glm-5.3", "glm-5.3-layers"])
def test_planner_weights_are_what_the_room_check_counts(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage's weight bytes per GPU in `longctx plan` are the figure the engine's room check counts for
    that stage's TP rank on CUDA (the same split, dtype and fp8 choice): the planner once split the embedding
    and lm_head over TP while the engine held them whole, and counted the router in bf16, so a plan it called
    feasible could be refused."""
    import torch

    import longctx.engine.sizing as sizing
    from longctx.kv_kinds import resolve_kv_kinds

    cfg = ModelConfig.from_json(CONFIGS / f"{name}.json")
    counted: list[tuple[range, int]] = []

    def loaded(cfg: ModelConfig, layers: range, itemsize: int, fp8: bool, tp: int = 1) -> int:
        n = P.loaded_weight_bytes(cfg, layers, itemsize, fp8, tp)
        counted.append((layers, n))
        return n

    monkeypatch.setattr(sizing, "loaded_weight_bytes", loaded)
    monkeypatch.setattr(sizing, "available_memory", lambda device=None: 1 << 62)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    pages = 4096
    context = min(pages * 64, cfg.max_position_embeddings)
    # a CUDA engine's model, dtype and KV kinds, without a checkpoint (CI has no GPU)
    cuda, dtype = torch.device("cuda", 0), torch.bfloat16
    kv_kinds = resolve_kv_kinds("auto", "cuda", cfg.kv_fp8_skip_layers)
    layouts = [(pp, tp) for pp in (1, 2, 3, 4, 8) for tp in (1, 2, 4)]
    layouts = [
        (pp, tp) for pp, tp in layouts if pp <= cfg.num_hidden_layers and cfg.num_attention_heads % tp == 0
    ]
    for pp, tp in layouts:
        counted.clear()
        sizing.check_engine_room(
            cfg,
            cuda,
            dtype,
            kv_kinds,
            num_pages=pages,
            default=False,
            pp=pp,
            tp=tp,
            max_running=1,
            max_context=context,
            hisparse_device_tokens=None,
        )
        plans = partition(cfg, pp, context, tp=tp, gpus_per_node=pp * tp)
        assert [(p.layers, p.weight_bytes) for p in plans] == [((r.start, r.stop), n) for r, n in counted]
