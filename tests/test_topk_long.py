"""`index_topk_long` / `index_topk_long_from`: queries from a position on select fewer keys (their window
included), the same through every engine path: one prefill chunk holding rows on both sides, chunks on one
side, decode (rows on both sides of a batch), pipeline stages, the Triton kernels and a HiSparse cap."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from longctx.kernels.topk import narrow_selection, topk_indices_ref

from longctx import Engine
from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.model.indexer import Indexer
from tests.conftest import (
    assert_cap_keeps_the_output,
    assert_training_forward_scores,
    make_checkpoint,
    rand_ids,
    rel,
    tiny_config,
)

K, W, KL, F = 16, 4, 8, 40  # tiny.json's index_topk 16; a window of 4; from position 40 on the top 8


def narrowed(**kw) -> ModelConfig:
    return tiny_config(index_local_window=W, index_topk_long=KL, index_topk_long_from=F, **kw)


def test_config_checks_and_round_trip(tmp_path) -> None:
    cfg = narrowed()
    d = cfg.to_hf_dict()
    assert (d["index_topk_long"], d["index_topk_long_from"]) == (KL, F) and ModelConfig.from_dict(d) == cfg
    assert "index_topk_long" not in tiny_config().to_hf_dict()  # GLM-5's config.json stays theirs
    for bad in (
        {"index_topk_long": K},  # not fewer than index_topk
        {"index_topk_long": W},  # no room past the window
        {"index_topk_long_from": K - 1},  # a query there may have fewer keys than the top-k
        {"index_topk_long": -1},
        {"index_topk_long": True},
        {"index_topk_long_from": 2.5},
        {"index_topk_long": 0},  # a position with no top-k
    ):
        with pytest.raises(ConfigError, match="index_topk_long"):
            ModelConfig.from_dict({**d, **bad})
    a = make_checkpoint(tmp_path / "a", tiny_config(index_local_window=W), seed=1)
    with pytest.raises(ConfigError, match="index_topk_long_from"):  # the override without its position
        Engine(a, device="cpu", index_topk_long=KL)
    b = make_checkpoint(tmp_path / "b", cfg, seed=1)
    # a top-k override below it: the error says how to turn the narrowing off
    with pytest.raises(ConfigError, match="index_topk_long 0 turns it off"):
        Engine(b, device="cpu", index_topk=KL)
    with Engine(b, device="cpu", index_topk=KL, index_topk_long=0, index_topk_long_from=0) as e:
        assert (e.config.index_topk, e.config.index_topk_long) == (KL, 0)
    with Engine(b, device="cpu", index_topk_long=0, index_topk_long_from=0) as e:  # turned off
        assert e.config.index_topk_long == 0
    with Engine(b, device="cpu", index_topk=KL, index_topk_long=0) as e:  # as the hint says: 0 alone
        assert (e.config.index_topk, e.config.index_topk_long, e.config.index_topk_long_from) == (KL, 0, 0)


@pytest.mark.parametrize("window,k,wide", [(0, 8, 16), (4, 8, 16), (4, 5, 16), (64, 128, 256)])
def test_narrow_selection_is_the_narrow_top_k(window: int, k: int, wide: int) -> None:
    """`narrow_selection` of a row's wide selection is the selection with k for every row with more than
    `wide` keys before its window, ties (few distinct values) going to the lower index as the top-k's do."""
    g = torch.Generator().manual_seed(window * 7 + k)
    n = 3 * wide + 50
    positions = torch.randint(wide + window, n, (40,), generator=g)
    logits = torch.randint(-4, 5, (40, n), generator=g).float()
    logits[torch.arange(n)[None] > positions[:, None]] = float("-inf")  # (not causal)
    if window:
        sel = topk_indices_ref(logits, wide - window, None, window, positions)
        want = topk_indices_ref(logits, k - window, None, window, positions)
    else:
        sel, want = topk_indices_ref(logits, wide, positions + 1), topk_indices_ref(logits, k, positions + 1)
    assert torch.equal(narrow_selection(sel, logits, k, window), want)


def _recorded(monkeypatch) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Every full layer's (layer, positions, selection) from here on."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    forward = Indexer.forward

    def record(self, x, q_resid, ctx, x_proj=None):
        out = forward(self, x, q_resid, ctx, x_proj)
        seen.append((self.layer, ctx.positions.clone(), out.clone()))
        return out

    monkeypatch.setattr(Indexer, "forward", record)
    return seen


def test_rows_from_the_position_select_fewer(tmp_path, monkeypatch) -> None:
    """Each row from position F on holds KL keys, its newest W among them; the rows before it K (or all
    of theirs); and layer 0's narrowed selection (its scores do not depend on earlier layers) is part of
    the same row's full one."""
    plain = make_checkpoint(tmp_path / "p", tiny_config(index_local_window=W), seed=2)
    ids = rand_ids(90, 3)
    base: dict[int, set[int]] = {}
    seen = _recorded(monkeypatch)
    with Engine(plain, device="cpu", chunk_size=32) as e:
        e.score(ids)
    for layer, pos, sel in seen:
        if layer == 0:
            base.update({int(p): {int(t) for t in row if t >= 0} for p, row in zip(pos, sel)})
    seen.clear()
    # chunks of 32: [0, 32) all below F, [32, 64) on both sides, [64, 90) all past it
    with Engine(plain, device="cpu", chunk_size=32, index_topk_long=KL, index_topk_long_from=F) as e:
        e.score(ids)
    rows = 0
    for layer, pos, sel in seen:
        assert sel.shape[1] == K
        for p, row in zip(pos.tolist(), sel.tolist()):
            keys = [t for t in row if t >= 0]
            assert row[: len(keys)] == keys == sorted(keys)  # ascending, then -1
            want = KL if p >= F else min(K, p + 1)
            assert len(keys) == want, (layer, p, keys)
            assert set(range(max(p - W + 1, 0), p + 1)) <= set(keys)
            if layer == 0 and p >= F:
                assert set(keys) <= base[p]
                rows += 1
    assert rows == len(ids) - F


@pytest.mark.parametrize("pp", [1, 2])
def test_every_path_selects_the_same(tmp_path, pp: int) -> None:
    """A narrowing checkpoint scores the same in one chunk (both selections, kept per row) as in chunks
    that lie on one side, as the same weights given the narrowing by the engine, and with pipeline stages;
    the rows before F as without it, the rows from it not; greedy decode across F and a decode batch
    with rows on both sides agree with scoring."""
    own = tiny_config(index_local_window=W)
    plain = make_checkpoint(tmp_path / "p", own, seed=4)
    nar = make_checkpoint(
        tmp_path / "n", dataclasses.replace(own, index_topk_long=KL, index_topk_long_from=F), seed=4
    )
    ids = rand_ids(90, 5)
    with Engine(nar, device="cpu", pp=pp, chunk_size=1024) as e:
        want = e.score(ids)
        outs = e.generate([ids[:34], ids[:60]], max_new_tokens=10, ignore_eos=True)
    with Engine(nar, device="cpu", chunk_size=20) as e:
        assert rel(e.score(ids), want) <= 1e-6
        for prompt, out in zip((ids[:34], ids[:60]), outs):
            full = e.score(prompt + out.token_ids[:-1])
            assert full[len(prompt) - 1 :].argmax(-1).tolist() == out.token_ids
    with Engine(plain, device="cpu", index_topk_long=KL, index_topk_long_from=F) as e:
        assert rel(e.score(ids), want) <= 1e-6
    with Engine(plain, device="cpu") as e:
        without = e.score(ids)
    assert rel(without[:F], want[:F]) <= 1e-6 and rel(without[F:], want[F:]) > 1e-3


def test_training_forward_narrows_as_the_engine(tmp_path) -> None:
    """The training forward of a narrowing checkpoint (the 1M benches' reference) scores as the engine,
    with both selection forms."""
    d = make_checkpoint(tmp_path / "n", narrowed(), seed=10)
    ids = rand_ids(90, 11)
    with Engine(d, device="cpu") as e:
        assert_training_forward_scores(d, ids, e.score(ids))


def test_triton_backend_narrows_the_same(tmp_path) -> None:
    """The Triton kernels (interpreter): prefill chunks through the fused indexer + top-k on both sides
    of F, decode rows on both sides in one batch, against the torch backend."""
    pytest.importorskip("triton")
    d = make_checkpoint(tmp_path / "n", narrowed(), seed=6)
    ids = rand_ids(56, 7)
    with (  # chunks [0, 24) before F, [24, 48) across it, [48, 56) past it
        Engine(d, device="cpu", backend="torch", chunk_size=24) as t,
        Engine(d, device="cpu", backend="triton", chunk_size=24) as k,
    ):
        assert rel(k.score(ids), t.score(ids)) <= 1e-3
        prompts = [ids[:38], ids[:50]]  # (the first one's decode steps cross F)
        a = [o.token_ids for o in t.generate(prompts, max_new_tokens=4, ignore_eos=True)]
        b = [o.token_ids for o in k.generate(prompts, max_new_tokens=4, ignore_eos=True)]
    assert a == b


def test_hisparse_cap_narrows_the_same(tmp_path) -> None:
    """A HiSparse cap (misses swapped in) gives the uncapped logits and tokens with the narrowing."""
    assert_cap_keeps_the_output(make_checkpoint(tmp_path / "h", narrowed(), seed=8), rand_ids(120, 9))


def test_training_from_a_narrowed_checkpoint_keeps_it(tmp_path) -> None:
    """Trained from weights whose config narrows (the shipped model), the saved model narrows the same,
    as it keeps their window: it is then scored past the position as they were."""
    from longctx.train.__main__ import main

    src = make_checkpoint(tmp_path / "src", narrowed(), seed=2)
    args = [
        "--config", "configs/tiny.json", "--out", str(tmp_path / "out"), "--steps", "1", "--device", "cpu",
        "--init-from", str(src), "--tokens-per-step", "1024", "--curriculum", "0:512",
        "--dense-warmup-steps", "0", "--warmup-steps", "1", "--kl-rows", "8", "--save-dtype", "float32",
    ]  # fmt: skip
    assert main(args) == 0
    got = ModelConfig.from_json(tmp_path / "out")
    assert (got.index_local_window, got.index_topk_long, got.index_topk_long_from) == (W, KL, F)


def test_decode_can_keep_the_wide_selection(tmp_path, monkeypatch) -> None:
    """`LONGCTX_TOPK_LONG_DECODE=0` (`indexer.NARROW_DECODE`): a prompt that ends before F and a greedy
    decode across it give what the same weights give without the narrowing (the decode passes select K);
    with the default the tokens' logprobs past F differ (the check has teeth)."""
    from longctx.model import indexer

    own = tiny_config(index_local_window=W)
    plain = make_checkpoint(tmp_path / "p", own, seed=6)
    ids = rand_ids(F - 10, 7)

    def run(**kw) -> tuple[list[int], list[float]]:
        with Engine(plain, device="cpu", **kw) as e:
            (c,) = e.generate([ids], max_new_tokens=24, ignore_eos=True, logprobs=1)
        return c.token_ids, [lp.logprob for lp in c.logprobs]

    wide = run()
    narrow = {"index_topk_long": KL, "index_topk_long_from": F}
    assert run(**narrow) != wide
    monkeypatch.setattr(indexer, "NARROW_DECODE", False)
    assert run(**narrow) == wide
