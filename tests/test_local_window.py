"""`index_local_window`: each query's newest W positions always in its selection, the rest of the top-k
by index score, the same in the engine (torch and Triton backends, pipeline stages, HiSparse) and in the
training forward."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from longctx.kernels.topk import topk_indices_ref

from longctx import Engine
from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.model.indexer import local_window_bound, with_local_window
from tests.conftest import (
    assert_cap_keeps_the_output,
    assert_training_forward_scores,
    make_checkpoint,
    rand_ids,
    rel,
    tiny_config,
)

W = 4  # tiny.json: index_topk 16


def brute_force(logits: torch.Tensor, positions: torch.Tensor, k: int, window: int) -> torch.Tensor:
    """Per query: every key when it has at most k, else its newest `window` positions and the k - window
    highest logits before them (ties: the lower position), ascending, -1 padded."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        if p + 1 <= k:
            keep = list(range(p + 1))
        else:
            lo = p - window + 1
            order = sorted(range(lo), key=lambda t: (-float(logits[i, t]), t))
            keep = sorted(order[: k - window] + list(range(lo, p + 1)))
        out[i, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
    return out


@pytest.mark.parametrize("k,window", [(8, 1), (8, 3), (16, 15), (5, 4)])
def test_with_local_window_is_the_window_plus_the_top_before_it(k: int, window: int) -> None:
    g = torch.Generator().manual_seed(k * 31 + window)
    n = 40
    positions = torch.randint(0, n, (60,), generator=g)
    # few distinct values, so ties at the boundary are common
    logits = torch.randint(-3, 4, (60, n), generator=g).float()
    bound = local_window_bound(positions, window)
    top = topk_indices_ref(logits, k - window, bound + 1)
    got = with_local_window(top, positions, k, window)
    assert torch.equal(got, brute_force(logits, positions, k, window))
    assert torch.equal(with_local_window(top, positions, k, 0), top)  # no window: the top-k as it was


def test_config_checks_and_round_trip(tmp_path) -> None:
    cfg = tiny_config(index_local_window=W)
    d = cfg.to_hf_dict()
    assert d["index_local_window"] == W and ModelConfig.from_dict(d).index_local_window == W
    assert "index_local_window" not in tiny_config().to_hf_dict()  # GLM-5's config.json stays theirs
    for bad in (-1, 16, 17, 2.5, True):
        with pytest.raises(ConfigError, match="index_local_window"):
            ModelConfig.from_dict({**d, "index_local_window": bad})
    a = make_checkpoint(tmp_path / "a", tiny_config(), seed=1)
    with pytest.raises(ConfigError, match="index_local_window"):
        Engine(a, device="cpu", index_local_window=16)
    b = make_checkpoint(tmp_path / "b", cfg, seed=1)
    with pytest.raises(ConfigError) as e:  # a top-k override that leaves no room: its fault, not the window's
        Engine(b, device="cpu", index_topk=W)
    assert str(e.value) == (
        f"index_topk {W}: leaves no room for the checkpoint's index_local_window {W} (must be > it); "
        "lower index_local_window or raise index_topk"
    )


@pytest.mark.parametrize("pp", [1, 2])
def test_engine_window_is_the_training_forward(tmp_path, pp: int) -> None:
    """A checkpoint with a window scores as the training forward of the same weights (both selection
    forms), as the same weights with the window given to the engine, and not as without it."""
    own = tiny_config()
    a = make_checkpoint(tmp_path / "a", own, seed=3)
    b = make_checkpoint(tmp_path / "b", dataclasses.replace(own, index_local_window=W), seed=3)
    assert json.loads((b / "config.json").read_text())["index_local_window"] == W
    ids = rand_ids(90, 5)
    with Engine(b, device="cpu", pp=pp, chunk_size=32) as e:
        want = e.score(ids)
        out = e.generate([ids[:70]], max_new_tokens=6, ignore_eos=True)[0].token_ids
    with Engine(a, device="cpu", index_local_window=W) as e:
        assert e.config.index_local_window == W
        assert rel(e.score(ids), want) <= 1e-6
    with Engine(a, device="cpu") as e:
        plain = e.score(ids)
    assert rel(plain, want) > 1e-3  # the window changes what is selected at this length

    assert_training_forward_scores(b, ids, want)
    # greedy decode (the decode form of the indexer) agrees with scoring the prompt and its continuation
    with Engine(b, device="cpu") as e:
        full = e.score(ids[:70] + out[:-1])
    assert full[69:].argmax(-1).tolist() == out


def test_triton_backend_keeps_the_window(tmp_path) -> None:
    """The Triton kernels (interpreter) with a window: prefill chunks through the fused indexer + top-k,
    decode through the logits + top-k kernels, against the torch backend."""
    pytest.importorskip("triton")
    d = make_checkpoint(tmp_path / "w", tiny_config(index_local_window=W), seed=4)
    ids = rand_ids(80, 6)
    with (
        Engine(d, device="cpu", backend="torch", chunk_size=40) as t,
        Engine(d, device="cpu", backend="triton", chunk_size=40) as k,
    ):
        assert rel(k.score(ids), t.score(ids)) <= 1e-3
        a = t.generate([ids[:50]], max_new_tokens=5, ignore_eos=True)[0].token_ids
        b = k.generate([ids[:50]], max_new_tokens=5, ignore_eos=True)[0].token_ids
    assert a == b


def test_hisparse_cap_keeps_the_window(tmp_path) -> None:
    """A HiSparse cap (misses swapped in) gives the uncapped logits with a window."""
    assert_cap_keeps_the_output(
        make_checkpoint(tmp_path / "h", tiny_config(index_local_window=W), seed=5), rand_ids(120, 7)
    )


def test_training_takes_the_window_and_saves_it(tmp_path, capsys) -> None:
    """`--index-local-window` trains with the window and saves it; --init-from a windowed checkpoint
    keeps it; a --long-topk that leaves no room for it is refused."""
    from longctx.train.__main__ import main

    base = [
        "--config", "configs/tiny.json", "--steps", "2", "--device", "cpu", "--tokens-per-step", "1024",
        "--curriculum", "0:512", "--dense-warmup-steps", "0", "--warmup-steps", "1", "--log-every", "1",
        "--kl-rows", "8", "--save-dtype", "float32", "--seed", "3",
    ]  # fmt: skip
    plain = tmp_path / "plain"
    assert main([*base, "--out", str(plain), "--steps", "1"]) == 0
    assert ModelConfig.from_json(plain).index_local_window == 0
    # from weights trained without a window (run 21 from run 17)
    a = tmp_path / "a"
    assert main([*base, "--out", str(a), "--init-from", str(plain), "--index-local-window", str(W)]) == 0
    assert ModelConfig.from_json(a).index_local_window == W
    b = tmp_path / "b"
    assert main([*base, "--out", str(b), "--init-from", str(a), "--steps", "1"]) == 0
    assert ModelConfig.from_json(b).index_local_window == W
    c = tmp_path / "c"  # a resumed run keeps the window its checkpoint has
    assert main([*base, "--out", str(c), "--resume", str(b), "--steps", "2"]) == 0
    assert ModelConfig.from_json(c).index_local_window == W
    capsys.readouterr()
    assert (
        main([*base, "--out", str(tmp_path / "c"), "--index-local-window", str(W), "--long-topk", "128:4"])
        == 2
    )
    assert "--long-topk 4: must be larger than the model's index_local_window (4)" in capsys.readouterr().err
