"""Shared test fixtures: tiny random checkpoints made on the fly."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# Kernels run under the Triton interpreter on CPU; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Intra-op threads: the cores shared among the xdist workers (`make test` runs two on CI's two cores;
# two threads each oversubscribe them), at most 2.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


def heaviest_files_first(items: list, seconds: dict[str, float]) -> None:
    """Sort `items` (stably: a file's tests keep their order) by their file's recorded seconds, longest first;
    a file with no record counts as the median one."""
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 0.0
    items.sort(key=lambda item: -seconds.get(item.path.name, default))


def pytest_collection_modifyitems(config, items):
    """Long test files first (tests/file_seconds.py says why and how to refresh the record)."""
    from .file_seconds import load

    heaviest_files_first(items, load())


def tiny_config(**overrides):
    """configs/tiny.json with overrides (indexer_types / mlp_layer_types follow num_hidden_layers)."""
    from pathlib import Path

    from longctx.config import ModelConfig

    cfg = ModelConfig.from_json(Path(__file__).resolve().parents[1] / "configs" / "tiny.json")
    n = overrides.get("num_hidden_layers", cfg.num_hidden_layers)
    if "indexer_types" not in overrides and n != cfg.num_hidden_layers:
        overrides["indexer_types"] = tuple(("full", "shared")[i % 2] if i else "full" for i in range(n))
    if "mlp_layer_types" not in overrides and n != cfg.num_hidden_layers:
        overrides["mlp_layer_types"] = ("dense",) + ("sparse",) * (n - 1)
    for k in ("indexer_types", "mlp_layer_types"):
        if k in overrides:
            overrides[k] = tuple(overrides[k])
    return dataclasses.replace(cfg, **overrides)


def make_checkpoint(path, cfg, seed: int = 0, fp8: bool = False, dtype: str = "float32"):
    from longctx.checkpoint.init_random import init_random_checkpoint

    return init_random_checkpoint(cfg, path, seed=seed, dtype=dtype, fp8=fp8, std=0.08)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The default tiny model (configs/tiny.json), seed 0."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config())


@pytest.fixture(scope="module")
def eng(tiny_dir):
    """An engine on the tiny model (CPU, prefill chunks of 29), one per test module."""
    from longctx import Engine

    with Engine(tiny_dir, device="cpu", chunk_size=29) as e:
        yield e


def hf_model(model_dir, dtype=torch.float32):
    """transformers' reference model for a checkpoint directory (eager attention)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt from a transformers model, recomputed from scratch each step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def assert_cap_keeps_the_output(d, ids: list[int], cap: int = 24) -> None:
    """Checkpoint `d` under a HiSparse cap of `cap` device tokens (misses swapped in) gives the uncapped
    logits of `ids` and greedy tokens after `ids[:-20]`, with misses."""
    from longctx import Engine

    kw = {"device": "cpu", "kv_pages": 24, "prefill_form": "absorbed"}  # (as tests/test_hisparse.py)
    with Engine(d, **kw) as e:
        want = e.score(ids)
        want_tok = e.generate([ids[:-20]], max_new_tokens=8, ignore_eos=True)[0].token_ids
    with Engine(d, **kw, hisparse_device_tokens=cap) as e:
        got = e.score(ids)
        tok = e.generate([ids[:-20]], max_new_tokens=8, ignore_eos=True)[0].token_ids
        hs = e.stats()["hisparse"]
    assert rel(got, want) <= 1e-6 and tok == want_tok and hs["misses"] > 0


def assert_training_forward_scores(d, ids: list[int], want: torch.Tensor) -> None:
    """The training forward of checkpoint `d` (sparse, both selection forms: fused on a CPU is the
    kernel's reference) gives the engine's logits `want` of `ids`."""
    from longctx.config import ModelConfig
    from longctx.train.checkpoint import load_model_weights
    from longctx.train.model import TrainCausalLM

    m = TrainCausalLM(ModelConfig.from_json(d))
    load_model_weights(m, d, torch.device("cpu"))
    m.eval()
    for form in ("torch", "fused"):
        m.select_form = form
        with torch.no_grad():
            h, _ = m.forward_train(torch.tensor([ids]), sparse=True)
            assert rel(m.logits(h)[0], want) <= 1e-4, form


def rand_ids(n: int, seed: int) -> list[int]:
    """n token ids in [0, 256) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def byte_level_counter():
    """A byte-level BPE HFCounter like longctx's default models' tokenizer.json: one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from longctx.workloads.tokens import HFCounter

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return HFCounter(tok, "byte-level")


def run_requests(eng, prompts, params) -> list[tuple[list[int], str]]:
    """Requests with their own SamplingParams through the step API (as the server drives the engine), run
    to the end together: each one's (output ids, finish reason)."""
    import random

    from longctx.engine.request import Request

    reqs = [Request(f"rr-{i}-{random.random()}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    return [(list(r.output_ids), r.finish_reason.value if r.finish_reason else "") for r in reqs]
