"""Vocab-parallel embedding and lm_head under tensor parallelism (`longctx.stages.tp`): each rank holds its
vocabulary rows only (vocabularies tp does not divide, tied embeddings), over real gloo groups the hooks
give the replicated lookup and the ranks' logits exactly, and an engine at tp = 2 / 3 matches tp = 1."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx import Engine
from longctx.checkpoint.loader import iter_weights
from longctx.config import ModelConfig
from longctx.engine.worker import build_model
from longctx.stages.collectives import group_gather, group_reduce
from longctx.stages.tp import TPShard, shard_range
from tests.conftest import make_checkpoint, tiny_config

# 6 heads: tp 2 and 3 both divide them; 319 rows: neither divides the vocabulary (159/160, 106/106/107 rows)
VOCAB = 319
PROMPT = [(i * 37 + 11) % 256 for i in range(70)]
GEN_PROMPTS = [PROMPT[:23], PROMPT[30:61]]
NEW = 6


def _config(tied: bool) -> ModelConfig:
    return tiny_config(vocab_size=VOCAB, num_attention_heads=6, tie_word_embeddings=tied)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vocab"), _config(request.param))


def _rank_model(d: Path, cfg: ModelConfig, rank: int, tp: int, reduce, gather):
    shard = TPShard(cfg, rank, tp)
    return build_model(
        d,
        cfg,
        range(cfg.num_hidden_layers),
        torch.device("cpu"),
        torch.float32,
        False,
        shard.shard_weights,
        lambda m: shard.shard_model(m, reduce, gather),
    )


@pytest.mark.parametrize("tp", [2, 3])
def test_each_rank_holds_its_vocab_rows(model_dir: Path, tp: int) -> None:
    """The embedding's and lm_head's parameters are the rank's rows of the checkpoint's matrices (a tied
    lm_head the embedding's same rows), sizes vocab / tp rounded either way, together the whole."""
    cfg = ModelConfig.from_json(model_dir)
    full = dict(iter_weights(model_dir, cfg))
    head = full.get("lm_head.weight", full["model.embed_tokens.weight"])
    sizes = []
    for rank in range(tp):
        model = _rank_model(model_dir, cfg, rank, tp, lambda t: None, lambda t: t[None])
        v0, v1 = shard_range(VOCAB, rank, tp)
        emb = model.model.embed_tokens
        assert emb is not None and model.lm_head is not None
        assert emb.weight.shape == model.lm_head.weight.shape == (v1 - v0, cfg.hidden_size)
        assert torch.equal(emb.weight, full["model.embed_tokens.weight"][v0:v1])
        assert torch.equal(model.lm_head.weight, head[v0:v1])
        assert (model.lm_head.weight is emb.weight) == cfg.tie_word_embeddings  # tied: one parameter
        sizes.append(v1 - v0)
    assert sum(sizes) == VOCAB and max(sizes) - min(sizes) == 1
    assert {VOCAB // tp, -(-VOCAB // tp)} == set(sizes)


def _hooks_rank(d: str, tp: int, rank: int, store: str, out: multiprocessing.Queue) -> None:
    """One gloo rank: the gather primitive, then the sharded model's embedding and logits against the
    replicated ones computed from the checkpoint's whole matrices."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
        group = dist.new_group(list(range(tp)))
        gather = group_gather(group)
        got = gather(torch.full((2, 3), float(rank)))
        assert got.shape == (tp, 2, 3) and torch.equal(
            got, torch.arange(tp).float()[:, None, None].expand(tp, 2, 3)
        )
        cfg = ModelConfig.from_json(d)
        model = _rank_model(Path(d), cfg, rank, tp, group_reduce(group), gather)
        full = dict(iter_weights(d, cfg))
        emb_w = full["model.embed_tokens.weight"]
        head_w = full.get("lm_head.weight", emb_w)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (37,), generator=gen)
        ids[:3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])  # both ends and the middle of the vocabulary
        h = torch.randn(5, cfg.hidden_size, generator=gen)
        with torch.inference_mode():
            emb = model.model.embed_tokens(ids)
            logits = model.logits(h)
        assert torch.equal(emb, F.embedding(ids, emb_w)), "embedding"
        # the gather moves values, never changes them: every rank's shard product, column for column
        shards = [shard_range(VOCAB, r, tp) for r in range(tp)]
        parts = torch.cat([F.linear(h, head_w[a:b]) for a, b in shards], dim=-1).float()
        assert logits.shape == (5, VOCAB) and torch.equal(logits, parts), "logits"
        # the whole product agrees to the BLAS's rounding: its kernels for another width (N) may sum
        # a column's K products in another order (1 ulp on the CPU's fp32 at 319 vs 160 columns)
        torch.testing.assert_close(logits, F.linear(h, head_w).float(), rtol=1e-5, atol=1e-5)
        out.put((rank, None))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        out.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_is_the_replicated_lookup_and_logits(model_dir: Path, tmp_path: Path, tp: int) -> None:
    """Over a real gloo group: the masked lookups summed are the embedding bit for bit, and the
    all-gathered logits (the narrower shards padded) are each rank's shard product bit for bit."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_hooks_rank, args=(str(model_dir), tp, r, store, out)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        errors = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert errors == dict.fromkeys(range(tp)), "\n".join(e for e in errors.values() if e)


def _run(model_dir: Path, tp: int) -> tuple[torch.Tensor, list[list[int]]]:
    with Engine(model_dir, device="cpu", kv_pages=16, chunk_size=29, tp=tp) as e:
        logits = e.score(PROMPT)
        tokens = [c.token_ids for c in e.generate(GEN_PROMPTS, max_new_tokens=NEW, ignore_eos=True)]
    return logits, tokens


def test_engine_tp_matches_tp1(model_dir: Path) -> None:
    """Stage processes at tp = 2 and 3 (vocabulary shards of different sizes) score and generate as tp = 1:
    logits of every position within float rounding (the layers' all-reduces sum in another order),
    the same greedy tokens."""
    ref_logits, ref_tokens = _run(model_dir, 1)
    assert ref_logits.shape == (len(PROMPT), VOCAB)
    tied = ModelConfig.from_json(model_dir).tie_word_embeddings
    for tp in (2,) if tied else (2, 3):  # (tp 3 once: each engine is a few seconds of CI)
        logits, tokens = _run(model_dir, tp)
        assert logits.shape == ref_logits.shape
        assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() <= 1e-5, tp
        assert tokens == ref_tokens, tp
