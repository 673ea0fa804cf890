"""The engine's logits and tokens against transformers' GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM."""

from __future__ import annotations

import pytest
import torch

from longctx import Engine
from tests.conftest import hf_greedy, hf_model, make_checkpoint, tiny_config

TOL = 1e-3  # fp32: max |diff| / max |logit|

# Parity is exact up to rounding except where a discrete choice is tied: the top-k takes the lower
# index among keys of equal score (longctx.kernels.topk) while torch.topk's order among ties is
# unspecified. Exact ties come from relu zeroing every indexer head of a key (probability 2^-heads),
# so these configs use 16 indexer heads, and fixed checkpoint seeds (not Python's salted `hash`).
SEEDS = {"tiny": 11, "dense-full": 12, "shared-groups": 13}

CONFIGS = {
    # the default tiny: F S F S S F, dense + MoE, 2 groups
    "tiny": dict(index_n_heads=16),
    # dense-heavy, all full indexers, one expert group, wider heads, tied embeddings
    "dense-full": dict(
        num_hidden_layers=4,
        indexer_types=("full",) * 4,
        mlp_layer_types=("dense", "dense", "sparse", "sparse"),
        n_group=1,
        topk_group=1,
        num_attention_heads=2,
        index_n_heads=16,
        index_topk=24,
        norm_topk_prob=False,
        tie_word_embeddings=True,  # lm_head is the embedding (one parameter here, transformers' tying there)
    ),
    # many shared layers, 4 groups pick 2, more experts, larger rope
    "shared-groups": dict(
        num_hidden_layers=5,
        indexer_types=("full", "shared", "shared", "shared", "full"),
        mlp_layer_types=("sparse",) * 5,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        qk_rope_head_dim=16,
        index_n_heads=16,
        index_topk=8,
        routed_scaling_factor=1.5,
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_pair(request, tmp_path_factory):
    cfg = tiny_config(**CONFIGS[request.param])
    d = make_checkpoint(tmp_path_factory.mktemp(request.param), cfg, seed=SEEDS[request.param])
    return d, cfg, hf_model(d)


def test_score_matches_reference(model_pair):
    d, cfg, ref = model_pair
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (100,)).tolist()
    assert cfg.index_topk < len(ids) // 2  # sparse selection really selects
    with Engine(d, device="cpu", chunk_size=37) as eng:
        got = eng.score(ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert got.shape == want.shape
    assert rel_err(got, want) <= TOL


def test_greedy_generate_matches_reference(model_pair):
    d, cfg, ref = model_pair
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (40,)).tolist()
    with Engine(d, device="cpu") as eng:
        out = eng.generate([prompt], max_new_tokens=18, ignore_eos=True)[0]
    assert out.token_ids == hf_greedy(ref, prompt, 18)
    assert out.finish_reason == "length"
