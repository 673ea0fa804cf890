"""The whole engine path with the Triton kernels in it (CPU: the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from longctx import Engine
from tests.conftest import hf_greedy, hf_model, make_checkpoint, rand_ids, rel, tiny_config

pytest.importorskip("triton")


def test_triton_fp32_matches_reference(tiny_dir):
    ids = rand_ids(70, 0)
    ref = hf_model(tiny_dir)
    with Engine(tiny_dir, device="cpu", backend="triton", chunk_size=40) as e:
        assert e.stats()["backend"] == "triton"
        got = e.score(ids)
        out = e.generate([ids[:30]], max_new_tokens=6, ignore_eos=True)[0].token_ids
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert rel(got, want) <= 1e-3
    assert out == hf_greedy(ref, ids[:30], 6)


@pytest.mark.parametrize(("kv_dtype", "skip"), [("auto", None), ("fp8_e4m3", None), ("fp8_e4m3", (1, 2))])
def test_triton_bf16_matches_torch_bf16(tmp_path, kv_dtype, skip):
    # bf16 rounding differs between kernels and references; compare on a smooth model (dense MLPs,
    # top-k covering the prompt) where no discrete routing/selection choice can amplify it
    cfg = tiny_config(index_topk=128, mlp_layer_types=("dense",) * 6)
    d = make_checkpoint(tmp_path / "smooth", cfg, seed=3)
    ids = rand_ids(90, 1)
    # (skip: layers 1 (shared) and 2 (full, its index keys too) in bf16 beside fp8 ones)
    kw = {"device": "cpu", "dtype": "bfloat16", "kv_dtype": kv_dtype, "kv_fp8_skip_layers": skip}
    with Engine(d, backend="torch", **kw) as t, Engine(d, backend="triton", **kw) as k:
        a, b = t.score(ids), k.score(ids)
    assert rel(b, a) <= 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_triton_sampling_draws_the_torch_paths_tokens(tiny_dir):
    """Seeded sampling through the engine with the Gumbel and penalties kernels (interpreted) gives the torch
    path's tokens: three prompts batched (seeds 3, 4, 5), plain, with top_p, with top_k and min_p, and with
    every penalty."""
    prompts = [rand_ids(10 + 3 * i, 40 + i) for i in range(3)]
    pen = {"presence_penalty": 0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3}
    controls = [{}, {"top_p": 0.9}, {"top_k": 20, "min_p": 0.02}, pen]
    got = {}
    for backend in ("torch", "triton"):
        with Engine(tiny_dir, device="cpu", backend=backend) as e:
            got[backend] = [
                [c.token_ids for c in e.generate(prompts, max_new_tokens=4, temperature=1.0, seed=3, ignore_eos=True, **kw)]
                for kw in controls
            ]  # fmt: skip
    assert got["triton"] == got["torch"]
    assert len({tuple(t) for t in got["torch"][0]}) == 3


def test_moe_layers_make_the_next_layers_input_norm(tiny_dir, monkeypatch):
    """On the Triton path an MoE layer's combine kernel also writes the next layer's input norm (the final norm
    after the last layer): one norm launch fewer per MoE layer, the same logits as the layers norming for
    themselves."""
    from longctx.kernels import norm

    from longctx.model.layer import DecoderLayer

    launches = []
    launch = norm._launch
    monkeypatch.setattr(norm, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    ids = rand_ids(40, 3)
    with Engine(tiny_dir, device="cpu", backend="triton", chunk_size=64) as e:
        n_moe = sum(e.cfg.is_moe(i) for i in range(e.cfg.num_hidden_layers))
        fused = e.score(ids)
        n_fused = len(launches)
        step = DecoderLayer.step
        monkeypatch.setattr(
            DecoderLayer, "step", lambda self, x, ctx, xn=None, nn=None: step(self, x, ctx, xn, None)
        )
        launches.clear()
        plain = e.score(ids)
    assert n_moe >= 2 and len(launches) - n_fused == n_moe
    assert rel(fused, plain) <= 1e-6


def test_batch_one_decode_merges_split_attention_into_w_uv(tmp_path, monkeypatch):
    """On a GPU a batch-1 decode step splits each query's sparse attention over the top-k (the CPU has
    too few "SMs" to): with the splits forced, the splits merge inside W_UV's GEMV (no combine kernel),
    and the greedy tokens and decode logits are the reference's."""
    from dataclasses import replace

    from longctx.kernels import gemv, sparse_mla_heads
    from longctx.kernels import sparse_mla as smla_mod

    monkeypatch.setattr(
        smla_mod,
        "HEADS_KNOBS_ONE_QUERY",
        replace(sparse_mla_heads.HEADS_KNOBS_ONE_QUERY, splits=3, block_n=16),
    )
    merged = []
    real = gemv.merge_head_gemv
    monkeypatch.setattr(smla_mod, "merge_head_gemv", lambda *a, **k: merged.append(1) or real(*a, **k))
    d = make_checkpoint(tmp_path / "k64", tiny_config(index_topk=64), seed=5)  # (3 tiles of 16 to split)
    ids = rand_ids(60, 4)
    ref = hf_model(d)
    with Engine(d, device="cpu", backend="triton") as e:
        out = e.generate([ids], max_new_tokens=3, ignore_eos=True)[0].token_ids
    assert merged  # every layer of each decode step
    assert out == hf_greedy(ref, ids, 3)
