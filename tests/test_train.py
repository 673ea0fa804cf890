"""Training: the loss falls, the indexer learns by KL, checkpoints load in the engine with the same
logits as the training forward, and resume continues. CPU, tiny configs, well under a minute."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.train.__main__ import main
from longctx.train.checkpoint import MODEL_FILES, TRAINER_STATE, load_model_weights, read_training
from longctx.train.data import ANSWER, EOS_ID, DataConfig, DataError, answer_text, make_batch, pose_positions
from longctx.train.loop import TrainConfig, build_optimizer, compute_loss, kl_rows
from longctx.train.model import Needle, TrainCausalLM, selection_mask, sparse_attention_train
from longctx.workloads.ruler_tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.json"
CPU = torch.device("cpu")


def _model(seed: int = 0, std: float = 0.02) -> TrainCausalLM:
    torch.manual_seed(seed)
    m = TrainCausalLM(ModelConfig.from_json(TINY))
    m.init_weights(seed, std)
    return m


def _spy_topk(m: TrainCausalLM) -> list[int]:
    """Record the top-k of every sparse-stage selection `m` makes from now on."""
    picked: list[int] = []
    select = m._selection

    def spy(qi, ki, wi, topk):  # type: ignore[no-untyped-def]
        picked.append(topk)
        return select(qi, ki, wi, topk)

    m._selection = spy  # type: ignore[method-assign]
    return picked


def test_batches_are_deterministic_and_mark_answers() -> None:
    cfg = DataConfig(
        seed=3, tokens_per_step=2048, curriculum=((0, 512), (2, 1024)), text_fraction=0.0, copy_fraction=0.0
    )
    a, b = make_batch(cfg, 1), make_batch(cfg, 1)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.kind, b.kind) and a.tasks == b.tasks
    assert a.ids.shape == (4, 512) and make_batch(cfg, 2).ids.shape == (2, 1024)
    assert not torch.equal(a.ids, make_batch(cfg, 0).ids)
    for r, task in enumerate(a.tasks):
        assert task in TASKS
        ans = a.targets[r][a.kind[r] == ANSWER].tolist()
        assert ans[-1] == EOS_ID  # the answer ends the sample
        text = bytes(ans[:-1]).decode()
        assert text.startswith(" ") and text == answer_text(
            task, tuple(text.strip(" .").split(", ")) if TASKS[task].family != "vt" else tuple(text.split())
        )
        # inputs are the targets shifted by one
        assert torch.equal(a.ids[r, 1:], a.targets[r, :-1])
        # the needle: the first answer value's bytes where they stand in the prompt
        first = (
            text.strip().split()[0].rstrip(",.")
            if TASKS[task].family == "vt"
            else text.strip(" .").split(", ")[0]
        )
        at = a.needle[r].nonzero().squeeze(1)
        assert bytes(a.ids[r, at].tolist()).decode() == first and int(at[-1] - at[0]) == len(first) - 1
        assert int(at[-1]) < int((a.kind[r] == ANSWER).nonzero()[0])  # in the prompt, before the answer
    c = make_batch(dataclasses.replace(cfg, text_fraction=0.5, copy_fraction=0.5), 1)
    assert not c.needle.any() and c.needle.shape == c.ids.shape  # no retrieval rows: no needle


def test_overfits_a_fixed_batch_through_sparse_attention() -> None:
    m = _model()
    data = DataConfig(tokens_per_step=512, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    cfg = TrainConfig(data=data, dense_warmup_steps=0, kl_rows=16, lr=3e-3, warmup_steps=1, steps=20)
    batch = make_batch(data, 0)
    assert batch.ids.shape[1] > m.cfg.index_topk  # the selection really drops keys
    opt = build_optimizer(m, cfg, CPU)
    losses = []
    for step in range(20):
        loss, metrics, loads = compute_loss(m, batch, cfg, step, CPU)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        m.update_router_bias(loads, 1e-3)
        losses.append(float(metrics["loss_answer"]))
    assert losses[-1] < 0.5 * losses[0], losses
    bias = m.model.layers["1"].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0  # the balancing rule moved the router bias


@pytest.mark.parametrize("T,hd,E,inter,k,groups", [(300, 64, 8, 32, 2, (1, 1)), (257, 48, 16, 24, 4, (4, 2))])
def test_dense_experts_are_the_reference_function_with_its_gradients(T, hd, E, inter, k, groups) -> None:
    """moe_experts_dense == moe_experts_ref (fp32, float rounding) in value and in the gradients w.r.t.
    x, the routing weights and both expert matrices; an expert no token chose gets exactly zero."""
    from longctx.kernels.moe import moe_experts_ref, moe_router_ref

    from longctx.train.model import moe_experts_dense

    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, hd, generator=g)
    bias = torch.zeros(E)
    bias[-1] = -1e3  # the last expert is never chosen
    ids, w = moe_router_ref(x, torch.randn(E, hd, generator=g) * 0.1, bias, k, *groups, True, 2.5)
    assert int((ids == E - 1).sum()) == 0
    wgu = torch.randn(E, 2 * inter, hd, generator=g) * hd**-0.5
    wd = torch.randn(E, hd, inter, generator=g) * inter**-0.5
    dy = torch.randn(T, hd, generator=g)
    got, want = [], []
    for fn, out in ((moe_experts_dense, got), (moe_experts_ref, want)):
        leaves = [t.clone().requires_grad_() for t in (x, w, wgu, wd)]
        y = fn(leaves[0], ids, *leaves[1:])
        (y * dy).sum().backward()
        out += [y.detach()] + [t.grad for t in leaves]
    for name, a, b in zip(("y", "dx", "dw", "dgate_up", "ddown"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=name)
    assert not got[3][-1].any() and not got[4][-1].any()


def test_batched_selection_is_the_per_row_selection(monkeypatch) -> None:
    """The batched top-k mask equals the old per-row, per-chunk one bit for bit, whichever way the
    budget cuts the batch (whole rows several at a time, one row in query chunks), ties included."""
    import longctx.train.model as model_mod
    from bench.train_speed import ReferenceTrainCausalLM

    B, S, Hi, D, topk = 5, 96, 4, 8, 16
    g = torch.Generator().manual_seed(0)
    qi, ki = torch.randn(B, S, Hi, D, generator=g), torch.randn(B, S, D, generator=g)
    wi = torch.rand(B, S, Hi, generator=g)
    tied = (qi.round(), ki.round().clamp(0, 1), wi.round() + 1)  # integer logits: many ties at the boundary
    m = TrainCausalLM(ModelConfig.from_json(TINY))
    for budget in (Hi * S * 2 * S, Hi * S * 40, 1 << 27):  # 2 rows (of 5) a chunk, 40-query chunks, all
        monkeypatch.setattr(model_mod, "_SELECT_ELEMS", budget)
        for q, k_, w_ in ((qi, ki, wi), tied):
            got = selection_mask(m._select(q, k_, w_, topk), S)
            assert torch.equal(got, selection_mask(ReferenceTrainCausalLM._select(m, q, k_, w_, topk), S))
            assert int(got[:, -1].sum(-1).min()) == topk  # the last query really selects top-k of S
            assert not (got & (torch.arange(S)[None, :] > torch.arange(S)[:, None])).any()  # causal


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fused_selection_is_the_chunked_selection(backend: str, monkeypatch) -> None:
    """select_form "fused" (the engine's fused indexer + top-k over the keys as a paged fp32 pool) picks
    what `_select` picks: bit for bit where the logits are exact whatever the summation order (integer
    values, many ties: the same lowest-index tie-break), and all but a few near-ties on random floats.
    backend auto: the kernel's torch reference on a CPU; triton: the kernels under the interpreter."""
    B, S, Hi, D, topk = 2, 80, 4, 16, 8
    g = torch.Generator().manual_seed(1)
    qi, ki = torch.randn(B, S, Hi, D, generator=g), torch.randn(B, S, D, generator=g)
    wi = torch.rand(B, S, Hi, generator=g)
    tied = (qi.round(), ki.round().clamp(0, 1), wi.round() + 1)
    m = TrainCausalLM(ModelConfig.from_json(TINY))
    m.select_form, m.select_backend = "fused", backend
    for q, k_, w_, exact in ((*tied, True), (qi, ki, wi, False)):
        want, got = m._select(q, k_, w_, topk), m._select_fused(q, k_, w_, topk)
        assert got.shape == want.shape == (B, S, topk) and got.dtype == want.dtype == torch.int64
        a, b = selection_mask(got, S), selection_mask(want, S)
        if exact:
            assert torch.equal(got, want)
            import longctx.train.model as model_mod

            with monkeypatch.context() as mp:  # the queries in several calls (a 1M-token row's way)
                mp.setattr(model_mod, "_FUSED_QUERIES", 37)
                assert torch.equal(m._select_fused(q, k_, w_, topk), want)
        else:
            assert (a != b).sum() <= 4 and torch.equal(a.sum(-1), b.sum(-1))
    assert m._selects_fused(S)
    m.select_form, m.measured_selects = "auto", {S: "fused"}
    assert m._selects_fused(S) and not m._selects_fused(2 * S)  # auto: what the probe measured, else torch
    m.select_form = "bogus"
    with pytest.raises(ValueError, match="select_form"):
        m._selects_fused(S)


def test_needle_loss_trains_the_indexer_toward_the_needle() -> None:
    """The needle loss: -log of the index softmax's mass on the needle at answer rows. Only the indexer
    gets its gradient, and a few steps on one batch raise that mass (the selection moves to it)."""
    m = _model(seed=1)
    data = DataConfig(tokens_per_step=512, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    batch = make_batch(data, 0)
    assert batch.needle.any()
    rows = kl_rows(batch.kind, 64, torch.Generator().manual_seed(0))
    needle = Needle(batch.needle, torch.gather(batch.kind, 1, rows) == ANSWER)
    for n, p in m.named_parameters():
        p.requires_grad_(".indexer." in n)
    idx_params = [p for n, p in m.named_parameters() if ".indexer." in n]
    opt = torch.optim.AdamW(idx_params, lr=1e-2)
    nlls = []
    for _ in range(12):
        _, aux = m.forward_train(batch.ids, sparse=False, kl_rows=rows, needle=needle)
        assert len(aux.indexer_needle) == len(aux.indexer_kl) > 0
        nll = torch.stack(aux.indexer_needle).mean()
        opt.zero_grad()
        nll.backward()
        opt.step()
        nlls.append(float(nll.detach()))
    assert nlls[-1] < 0.7 * nlls[0], nlls
    _, aux = m.forward_train(batch.ids, sparse=False, kl_rows=rows)  # without needle: none computed
    assert aux.indexer_needle == []
    # through the training loss: weighted in, and logged
    cfg = TrainConfig(data=data, needle_weight=2.0, kl_rows=64, dense_warmup_steps=10**6)
    loss, metrics, _ = compute_loss(m, batch, cfg, 0, CPU)
    _, off, _ = compute_loss(m, batch, dataclasses.replace(cfg, needle_weight=0.0), 0, CPU)
    assert float(metrics["indexer_needle"]) > 0 and float(off["indexer_needle"]) == 0.0
    assert abs(float(metrics["loss"] - off["loss"]) - 2.0 * float(metrics["indexer_needle"])) < 1e-4


def test_needle_bytes_form_pulls_every_needle_byte_in_past_the_selection() -> None:
    """--needle-form bytes: the mean over the needle's bytes of each one's -log index probability over every
    causal key, selected or not. A needle byte outside the allowed keys (the sparse stage's selection) gets
    a gradient from it and none from the "set" form, which a needle's other bytes can satisfy alone."""
    g = torch.Generator().manual_seed(3)
    B, S, H, D, R = 2, 24, 3, 8, 5
    qi = torch.randn(B, S, H, D, generator=g)
    ki = torch.randn(B, S, D, generator=g, requires_grad=True)
    wi = torch.rand(B, S, H, generator=g)
    rows = torch.tensor([[6, 10, 15, 20, 23], [3, 9, 12, 18, 22]])
    pos = torch.arange(S)
    allowed = pos[None, None, :] <= rows[..., None]
    allowed = allowed & (pos != 4)[None, None, :]  # needle byte 4 ranked out of every row's selection
    p = torch.softmax(torch.randn(B, R, S, generator=g).masked_fill(~allowed, float("-inf")), -1)
    needle_pos = torch.zeros(B, S, dtype=torch.bool)
    needle_pos[:, 2:6] = True  # bytes 2..5
    at_rows = torch.tensor([[False, True, True, True, False], [False, True, False, True, True]])
    grads, nlls = {}, {}
    for form in ("set", "bytes"):
        ki.grad = None
        kl, nll = TrainCausalLM._kl_loss(qi, ki, wi, rows, allowed, p, Needle(needle_pos, at_rows, form))
        assert nll is not None
        nll.backward()
        assert ki.grad is not None
        grads[form], nlls[form] = ki.grad.clone(), nll.detach()
    assert float(grads["set"][:, 4].abs().max()) == 0.0  # ranked out: the set form cannot reach it
    assert float(grads["bytes"][:, 4].abs().min()) > 0.0
    # the reference: per marked row, the index logits over its causal keys, each needle byte's log softmax
    with torch.no_grad():
        logits = (torch.relu(torch.einsum("bshd,btd->bsht", qi, ki)) * wi[..., None]).sum(2)  # [B, S, S]
        terms = []
        for b in range(B):
            for j in range(R):
                if at_rows[b, j]:
                    t = int(rows[b, j])
                    logq = torch.log_softmax(logits[b, t, : t + 1], -1)
                    terms.append(-logq[needle_pos[b, : t + 1]].mean())
        torch.testing.assert_close(nlls["bytes"], torch.stack(terms).mean(), rtol=1e-5, atol=1e-6)
    # a marked row before the needle sees none of it and does not count
    early = torch.zeros_like(at_rows)
    early[:, 0] = True
    rows_early = rows.clone()
    rows_early[:, 0] = 1
    _, nll = TrainCausalLM._kl_loss(qi, ki, wi, rows_early, allowed, p, Needle(needle_pos, early, "bytes"))
    assert nll is not None and float(nll.detach()) == 0.0


def test_needle_form_reaches_the_loss_and_is_checked(tmp_path: Path) -> None:
    """TrainConfig.needle_form through compute_loss (the bytes form differs from the set form on the same
    batch), --needle-form on the CLI (saved in the recipe), and an unknown form refused."""
    from longctx.train.checkpoint import read_recipe

    m = _model(seed=1)
    data = DataConfig(tokens_per_step=512, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    batch = make_batch(data, 0)
    cfg = TrainConfig(data=data, needle_weight=1.0, kl_rows=64, dense_warmup_steps=0)
    _, a, _ = compute_loss(m, batch, cfg, 0, CPU)
    _, b, _ = compute_loss(m, batch, dataclasses.replace(cfg, needle_form="bytes"), 0, CPU)
    assert float(b["indexer_needle"]) > float(a["indexer_needle"]) > 0  # each byte's share < the set's
    out = tmp_path / "run"
    args = ["--config", str(TINY), "--out", str(out), "--steps", "2", "--device", "cpu",
            "--tokens-per-step", "1024", "--curriculum", "0:512", "--needle-weight", "1",
            "--needle-form", "bytes", "--eval-samples", "0", "--dense-warmup-steps", "0"]  # fmt: skip
    assert main(args) == 0
    assert read_recipe(str(out))["needle_form"] == "bytes"
    from longctx.train.loop import train

    with pytest.raises(ConfigError, match="needle_form"):
        train(TrainConfig(needle_form="bogus", model_config=str(TINY), out=str(tmp_path / "bad")))


def test_lead_weight_weighs_the_first_value_byte_of_each_answer(tmp_path: Path) -> None:
    """--lead-weight: the answer loss weighs each retrieval row's first value byte (the target after the
    answer's leading space) W times, others once; W = 1 is the plain mean; answer_lead_acc is logged."""
    from longctx.train.loop import lead_targets, train

    data = DataConfig(tokens_per_step=2048, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    batch = make_batch(data, 0)
    ans = batch.kind == ANSWER
    lead = lead_targets(ans)
    assert lead.sum(1).tolist() == [1] * ans.shape[0]  # one a row, every row has an answer
    for r in range(ans.shape[0]):
        first = int(ans[r].nonzero()[0])
        assert int(lead[r].nonzero()) == first + 1 and batch.targets[r, first] == ord(" ")
        value_first = bytes(batch.ids[r, batch.needle[r]].tolist())[:1]
        assert bytes([int(batch.targets[r, first + 1])]) == value_first
    none = torch.zeros(2, 8, dtype=torch.bool)
    last = none.clone()
    last[1, 7] = True  # an answer of one target at the row's end has no value byte after it
    assert not lead_targets(none).any() and not lead_targets(last).any()
    m = _model(seed=2)
    cfg = TrainConfig(data=data, kl_weight=0.0, dense_warmup_steps=10**6)
    base_loss, base, _ = compute_loss(m, batch, cfg, 0, CPU)
    _, heavy, _ = compute_loss(m, batch, dataclasses.replace(cfg, lead_weight=5.0), 0, CPU)
    with torch.no_grad():
        h, _ = m.forward_train(batch.ids, sparse=False)
        ce = torch.nn.functional.cross_entropy(
            m.logits(h).flatten(0, 1), batch.targets.flatten(), reduction="none"
        )
    ce = ce.view_as(batch.targets)
    w = ans.float() + 4.0 * lead.float()
    assert abs(float(heavy["loss_answer"]) - float((ce * w).sum() / w.sum())) < 1e-5
    assert abs(float(base["loss_answer"]) - float(ce[ans].mean())) < 1e-5
    right = m.logits(h).argmax(-1) == batch.targets
    assert float(base["answer_lead_acc"]) == float(right[lead].float().mean())
    with pytest.raises(ConfigError, match="lead_weight"):
        train(dataclasses.replace(cfg, lead_weight=-1.0, model_config=str(TINY), out=str(tmp_path)))


def test_long_topk_selects_fewer_at_long_rows(tmp_path: Path) -> None:
    """--long-topk S:K: from rows of S tokens on the sparse stage selects the top K (on a --long-topk-prob
    share of steps, drawn per step from the seed), shorter rows the config's top-k; bad specs refuse."""
    from longctx.train.__main__ import main as train_main
    from longctx.train.__main__ import parse_long_topk
    from longctx.train.loop import step_topk, train

    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    cfg = TrainConfig(data=data, kl_weight=0.0, dense_warmup_steps=0, long_topk_from=400, long_topk=4)
    assert step_topk(cfg, 0, 399) is None and step_topk(cfg, 0, 400) == 4
    half = dataclasses.replace(cfg, long_topk_prob=0.5)
    draws = [step_topk(half, s, 512) for s in range(200)]
    assert set(draws) == {None, 4} and 70 < draws.count(4) < 130
    assert draws == [step_topk(half, s, 512) for s in range(200)]  # the same draws on a resume
    assert step_topk(TrainConfig(), 0, 10**6) is None  # off by default
    m = _model(seed=3)
    batch = make_batch(data, 0)
    picked = _spy_topk(m)
    loss_k4, _, _ = compute_loss(m, batch, cfg, 0, CPU)
    own = m.model.layers["0"].self_attn.indexer.topk
    assert picked and set(picked) == {4} and own > 4
    picked.clear()
    loss_own, _, _ = compute_loss(m, batch, dataclasses.replace(cfg, long_topk_from=0), 0, CPU)
    assert set(picked) == {own} and float(loss_k4.detach()) != float(loss_own.detach())
    assert parse_long_topk(None) == (0, 0) and parse_long_topk("65536:32") == (65536, 32)
    for bad in ("65536", "x:32", "0:32", "65536:0"):
        with pytest.raises(ConfigError, match="long_topk"):
            parse_long_topk(bad)
    assert train_main(["--config", str(TINY), "--out", str(tmp_path / "x"), "--long-topk", "12q"]) == 2
    with pytest.raises(ConfigError, match="long_topk_prob"):
        train(dataclasses.replace(cfg, long_topk_prob=1.5, model_config=str(TINY), out=str(tmp_path)))


def test_kl_local_reaches_recent_positions_out_of_the_selection(tmp_path: Path) -> None:
    """--kl-local W: the sparse stage's indexer KL covers each KL row's selection plus its last W causal
    positions, so an unselected recent key gets a gradient (none without it); keys neither selected nor
    recent still get none, and W >= the row is the dense stage's KL over every causal key."""
    from longctx.train.__main__ import main as train_main
    from longctx.train.loop import train

    m = _model(seed=4)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, S, Hi, D, H = 2, 40, 3, 8, 2
    # positive queries and keys: every relu(q . k) is live, so each key in the KL's set has a gradient
    qi, wi = torch.rand(B, S, Hi, D, generator=g), torch.rand(B, S, Hi, generator=g)
    scores = torch.randn(B, H, S, S, generator=g)
    rows = torch.tensor([[39, 20], [30, 39]])
    sel = torch.full((B, S, 4), -1)
    sel[:, :, :4] = torch.arange(4)  # every query selects the first 4 keys only

    def main_scores(bi: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return scores[bi, :, r].transpose(1, 2)  # [B, H, R, S]

    def key_grad(local: int, selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ki = torch.rand(B, S, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        kl, _ = m._indexer_kl(qi, ki, wi, main_scores, selection, rows, 1.0, None, local)
        kl.backward()
        assert ki.grad is not None
        return kl.detach(), ki.grad.abs().sum(-1)  # [B, S]

    _, g0 = key_grad(0, sel)
    assert float(g0[:, 4:].sum()) == 0.0 and float(g0[:, :4].sum()) > 0  # the selection only
    _, g6 = key_grad(6, sel)
    for b in range(B):
        for r in rows[b].tolist():
            assert float(g6[b, r - 5 : r + 1].min()) > 0  # the row's last 6 positions, unselected
        recent = torch.zeros(S, dtype=torch.bool)
        recent[:4] = True
        for r in rows[b].tolist():
            recent[r - 5 : r + 1] = True
        assert float(g6[b, ~recent].sum()) == 0.0  # neither selected nor recent: no gradient
    dense, _ = key_grad(0, None)
    assert torch.allclose(key_grad(S, sel)[0], dense, rtol=1e-6, atol=0)
    # through the training step: the flag reaches every full layer's KL
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    cfg = TrainConfig(data=data, dense_warmup_steps=0)
    batch = make_batch(data, 0)
    _, own, _ = compute_loss(m, batch, cfg, 0, CPU)
    _, wide, _ = compute_loss(m, batch, dataclasses.replace(cfg, kl_local=64), 0, CPU)
    assert float(own["indexer_kl"]) != float(wide["indexer_kl"])
    assert train_main(["--config", str(TINY), "--out", str(tmp_path / "x"), "--kl-local", "-1"]) == 2
    cfg = TrainConfig(kl_local=-1, model_config=str(TINY), out=str(tmp_path / "y"))
    with pytest.raises(ConfigError, match="kl_local"):
        train(cfg)


def test_kl_share_targets_the_mean_of_each_index_share_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kl-share: each full layer's KL target is the mean of its own and its IndexShare layers' head-mean
    attention over the same allowed keys (tiny: groups {0, 1}, {2, 3, 4}, {5}), in the sparse and the dense
    stage; a full layer with no IndexShare layer after it keeps its own KL bit for bit; the CLI flag
    reaches the training step."""
    m = _model(seed=5)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, S = 2, 48  # > tiny's top-k 16: the sparse stage selects
    ids = torch.randint(0, 256, (B, S), generator=g)
    rows = torch.tensor([[47, 30], [40, 47]])
    bi = torch.arange(B)[:, None]
    seen: list[torch.Tensor] = []  # every layer's own target, computed here from its attention logits
    passed: list[torch.Tensor] = []  # the targets the KLs were computed against

    def probe(main_scores, sel, scale):  # type: ignore[no-untyped-def]
        ok = torch.arange(S)[None, None, :] <= rows[..., None]
        if sel is not None:
            ok = ok & selection_mask(sel[bi, rows], S)
        sc = (main_scores(bi, rows).float() * scale).masked_fill(~ok[:, None], float("-inf"))
        seen.append(torch.softmax(sc, -1).mean(1))

    kl_loss = m._kl_loss

    def spy(qi, ki, wi, r, allowed, p, needle):  # type: ignore[no-untyped-def]
        passed.append(p)
        return kl_loss(qi, ki, wi, r, allowed, p, needle)

    m.attention_probe = probe
    m._kl_loss = spy  # type: ignore[method-assign]
    groups = [[0, 1], [2, 3, 4], [5]]  # configs/tiny.json: full, shared, full, shared, shared, full
    for sparse in (True, False):
        got = {}
        for share in (False, True):
            seen.clear()
            passed.clear()
            with torch.no_grad():
                _, aux = m.forward_train(ids, sparse=sparse, kl_rows=rows, kl_share=share)
            assert len(seen) == 6 and len(passed) == len(aux.indexer_kl) == 3
            for j, grp in enumerate(groups):
                want = torch.stack([seen[i] for i in grp]).mean(0) if share else seen[grp[0]]
                assert torch.allclose(passed[j], want, rtol=1e-5, atol=1e-7), (sparse, share, j)
            got[share] = [float(k) for k in aux.indexer_kl]
        assert got[True][2] == got[False][2]  # layer 5 alone: its own target either way
        assert got[True][0] != got[False][0] and got[True][1] != got[False][1]
    # through the training step and the CLI
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    cfg = TrainConfig(data=data, dense_warmup_steps=0)
    batch = make_batch(data, 0)
    m.attention_probe = None
    _, own, _ = compute_loss(m, batch, cfg, 0, CPU)
    _, shared, _ = compute_loss(m, batch, dataclasses.replace(cfg, kl_share=True), 0, CPU)
    assert float(own["indexer_kl"]) != float(shared["indexer_kl"])
    taken: list[TrainConfig] = []
    monkeypatch.setattr("longctx.train.loop.train", lambda c: taken.append(c) or {})
    for flag, want in (([], False), (["--kl-share"], True), (["--no-kl-share"], False)):
        main(["--config", str(TINY), "--out", "unused", *flag])
        assert taken[-1].kl_share is want


def test_indexer_warmup_kl_decreases() -> None:
    # a sharp (large-init) frozen main model; only the indexer trains, as in DSA's dense warm-up
    m = _model(seed=1, std=0.3)
    idx_params = [p for n, p in m.named_parameters() if ".indexer." in n]
    for n, p in m.named_parameters():
        p.requires_grad_(".indexer." in n)
    opt = torch.optim.AdamW(idx_params, lr=1e-2)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(48)[None]
    kls = []
    for _ in range(20):
        _, aux = m.forward_train(ids, sparse=False, kl_rows=rows)
        kl = torch.stack(aux.indexer_kl).mean()
        opt.zero_grad()
        kl.backward()
        opt.step()
        kls.append(float(kl.detach()))
    assert kls[0] > 0.05 and kls[-1] < 0.6 * kls[0], kls


def _train_cli(out: Path, steps: int, resume: Path | None = None) -> dict:
    args = [
        "--config", str(TINY), "--out", str(out), "--steps", str(steps), "--device", "cpu",
        "--tokens-per-step", "1024", "--curriculum", "0:512", "--dense-warmup-steps", "2",
        "--warmup-steps", "2", "--save-every", "3", "--log-every", "1", "--kl-rows", "32",
        "--save-dtype", "float32", "--seed", "5",
    ]  # fmt: skip
    if resume is not None:
        args += ["--resume", str(resume)]
    assert main(args) == 0
    return json.loads((out / "summary.json").read_text())


def test_checkpoint_loads_in_engine_with_training_logits_and_resumes(tmp_path: Path) -> None:
    from longctx import Engine

    a = tmp_path / "a"
    s = _train_cli(a, steps=4)
    assert s["step"] == 4 and s["stopped"] == "steps"
    assert all((a / f).exists() for f in MODEL_FILES) and (a / TRAINER_STATE).exists()
    log = [json.loads(x) for x in (a / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4] and {r["stage"] for r in log} == {"dense", "sparse"}
    assert {"loss", "answer_acc", "lr", "tokens_per_s"} <= set(log[0])
    assert "pose_rows" not in log[0] and read_training(a)["recipe"]["data"]["pose_max"] == 0  # PoSE off

    # the saved checkpoint through the real engine == the training forward (eval mode, fp32)
    cfg = ModelConfig.from_json(a)
    m = TrainCausalLM(cfg)
    load_model_weights(m, a, CPU)
    m.eval()
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h, _ = m.forward_train(ids, sparse=True)
        train_logits = m.logits(h)[0]
        h_dense, _ = m.forward_train(ids, sparse=False)
        dense_logits = m.logits(h_dense)[0]
    with Engine(a, device="cpu", dtype="float32") as eng:
        eng_logits = eng.score(ids[0].tolist())
    scale = eng_logits.abs().max()
    assert float((train_logits - eng_logits).abs().max() / scale) <= 1e-4
    # and the selection matters at this length: dense attention would not match
    assert ids.shape[1] > cfg.index_topk
    assert float((dense_logits - eng_logits).abs().max() / scale) > 1e-3

    # resume continues from the saved step, with the saved weights and optimizer state
    b = tmp_path / "b"
    s2 = _train_cli(b, steps=6, resume=a)
    assert s2["step"] == 6 and s2["steps_done"] == 2
    st = read_training(b)
    assert st["step"] == 6 and [r["step"] for r in st["log"]] == [1, 2, 3, 4, 5, 6]
    assert st["moments"] and all("exp_avg_sq" in v for v in st["moments"].values())


def _fp8_engine_case(
    tmp_path: Path, skip: tuple[int, ...] = (), **engine_kw: int
) -> tuple[TrainCausalLM, torch.Tensor, torch.Tensor]:
    """A random tiny model saved to tmp_path (eval mode; its config's kv_fp8_skip_layers `skip`), a prompt
    of 70-130 tokens, and the engine's logits of it with an fp8 KV cache (fp32 compute)."""
    from longctx import Engine
    from longctx.train.checkpoint import save_model

    m = TrainCausalLM(dataclasses.replace(ModelConfig.from_json(TINY), kv_fp8_skip_layers=skip))
    m.init_weights(int(torch.randint(0, 1000, ())))
    save_model(m, tmp_path, torch.float32)
    m.eval()
    ids = torch.randint(0, 256, (1, int(torch.randint(70, 130, ()))))
    with Engine(tmp_path, device="cpu", dtype="float32", kv_dtype="fp8_e4m3", **engine_kw) as eng:
        want = eng.score(ids[0].tolist())
    return m, ids, want


def test_a_tied_model_trains_one_matrix_and_saves_what_the_engine_loads(tmp_path: Path) -> None:
    """tie_word_embeddings: lm_head is the embedding's parameter (one matrix, one gradient: the lm_head's
    and the lookup's parts add), the checkpoint holds it once under the embedding's name, and the engine
    loading it (both on one stage) shares it again and gives the training forward's logits."""
    from longctx import Engine
    from longctx.train.checkpoint import save_model

    cfg = dataclasses.replace(ModelConfig.from_json(TINY), tie_word_embeddings=True)
    m = TrainCausalLM(cfg)
    m.init_weights(int(torch.randint(0, 1000, ())))
    assert m.lm_head is not None and m.model.embed_tokens is not None
    assert m.lm_head.weight is m.model.embed_tokens.weight
    names = [n for n, _ in m.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    ids = torch.randint(0, 200, (1, int(torch.randint(40, 90, ()))))  # (ids 200 on: no lookup's gradient)
    m.logits(m.forward_train(ids, sparse=False)[0]).float().pow(2).mean().backward()
    g = m.model.embed_tokens.weight.grad
    assert g is not None and float(g[200:].abs().sum()) > 0  # rows no id looks up: lm_head's part
    save_model(m, tmp_path, torch.float32)
    m.eval()
    with torch.no_grad():
        want = m.logits(m.forward_train(ids, sparse=False)[0])[0]
    with Engine(tmp_path, device="cpu", dtype="float32", index_topk=256) as eng:
        got = eng.score(ids[0].tolist())
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4


def _recipe_records(tmp_path: Path, flag: str, key: str) -> None:
    """A one-step CLI run with `flag` (and --kv-fp8) records `key` true in its recipe."""
    out = tmp_path / "run"
    args = ["--config", str(TINY), "--out", str(out), "--steps", "1", "--device", "cpu", "--tokens-per-step",
            "512", "--curriculum", "0:512", "--dense-warmup-steps", "0", "--kv-fp8", flag]  # fmt: skip
    assert main(args) == 0 and read_training(out)["recipe"][key] is True


def test_kv_fp8_training_sees_the_engines_fp8_cache(tmp_path: Path) -> None:
    """--kv-fp8: the training forward's logits equal the engine's with an fp8 KV cache (fp32 compute,
    a top-k that covers the prompt, so the fp8 index keys select nothing else), where without it they
    differ by the quantisation; the gradient passes straight through the rounding."""
    m, ids, want = _fp8_engine_case(tmp_path, index_topk=256)
    scale = want.abs().max()
    with torch.no_grad():
        plain = m.logits(m.forward_train(ids, sparse=False)[0])[0]
        m.kv_fp8 = True
        seen = m.logits(m.forward_train(ids, sparse=False)[0])[0]
    assert float((seen - want).abs().max() / scale) <= 1e-4
    assert float((plain - want).abs().max() / scale) > 1e-3
    m.train()
    m.zero_grad()
    m.logits(m.forward_train(ids, sparse=False)[0]).float().pow(2).mean().backward()
    grads = [p.grad for name, p in m.named_parameters() if name.endswith("kv_a_proj_with_mqa.weight")]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    _recipe_records(tmp_path, "--kv-fp8", "kv_fp8")  # the CLI flag reaches the run's recipe


@pytest.mark.parametrize("skip", [(), (1, 2)])
def test_index_fp8_training_selects_what_the_engines_fp8_cache_selects(tmp_path: Path, skip) -> None:  # type: ignore[no-untyped-def]
    """--index-fp8 (with --kv-fp8): the indexers score the keys the engine's fp8 index cache holds, so
    the sparse training forward's logits equal the engine's with an fp8 KV cache (fp32 compute) where the
    top-k is smaller than the prompt; with the MLA rows alone rounded the selection differs; the indexer's
    key projection still gets a gradient through the rounding. A config that keeps layers out of fp8
    (kv_fp8_skip_layers: layer 1 shared, layer 2 full) trains them exact, as the engine keeps them."""
    from longctx.kernels.kv_layout import index_fp8_roundtrip

    m, ids, want = _fp8_engine_case(tmp_path, skip)
    n = ids.shape[1]
    assert n > m.cfg.index_topk
    scale = want.abs().max()
    m.kv_fp8 = True
    with torch.no_grad():
        rows_only = m.logits(m.forward_train(ids, sparse=True)[0])[0]
        m.index_fp8 = True
        seen = m.logits(m.forward_train(ids, sparse=True)[0])[0]
    assert float((seen - want).abs().max() / scale) <= 1e-4
    assert float((rows_only - want).abs().max() / scale) > 1e-3
    m.train()
    m.zero_grad()
    _, aux = m.forward_train(ids, sparse=True, kl_rows=torch.arange(n - 8, n)[None])
    sum(aux.indexer_kl).backward()
    grads = [p.grad for name, p in m.named_parameters() if name.endswith("indexer.wk.weight")]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    # the round trip: one scale per key, e4m3's 3 mantissa bits; a partial page is padded, not read
    k = torch.randn(int(torch.randint(1, 100, ())), m.cfg.index_head_dim)
    k8 = index_fp8_roundtrip(k)
    assert k8.shape == k.shape and float(((k8 - k).abs() / k.abs().amax(-1, keepdim=True)).max()) <= 2**-4
    _recipe_records(tmp_path, "--index-fp8", "index_fp8")


@pytest.mark.parametrize("length", [640])
def test_niah_eval_runs_through_engine(tmp_path: Path, length: int) -> None:
    from longctx.train.checkpoint import save_model
    from longctx.train.evaluate import niah_eval

    m = _model()
    save_model(m, tmp_path, torch.float32)
    r = niah_eval(
        tmp_path, lengths=(length,), tasks=("niah_single_1",), samples=2, device="cpu", max_new_tokens=4
    )
    assert set(r) == {f"niah_single_1@{length}", "avg", "examples"}
    assert 0.0 <= r["avg"] <= 100.0
    # a task that cannot fit a length is skipped and listed, the rest still scored (the seventh
    # session's H200 eval died on niah_multikey_1 at 512)
    r = niah_eval(
        tmp_path,
        lengths=(512,),
        tasks=("niah_single_1", "niah_multikey_1"),
        samples=1,
        device="cpu",
        max_new_tokens=4,
    )
    assert r["skipped"] == ["niah_multikey_1@512"] and "niah_single_1@512" in r
    # dense=True: the same weights with an index_topk (Engine(index_topk=...)) that covers every prompt
    d = niah_eval(tmp_path, lengths=(length,), tasks=("niah_single_1",), samples=2, device="cpu",
                  max_new_tokens=4, dense=True)  # fmt: skip
    assert set(d) == {f"niah_single_1@{length}", "avg", "examples"}
    assert json.loads((tmp_path / "config.json").read_text())["index_topk"] < length  # the source untouched


def test_schedule_fits_the_budget() -> None:
    from longctx.train.loop import NOMINAL_STEPS, fit_schedule

    data = DataConfig(curriculum=((0, 1024), (1500, 4096), (4000, 8192), (6000, 16384)))
    cfg = TrainConfig(data=data, steps=0, max_minutes=10)
    step_s = {1024: 0.05, 4096: 0.08, 8192: 0.1, 16384: 0.2}
    fitted = fit_schedule(cfg, step_s, 600.0)
    n, cur = fitted.steps, fitted.data.curriculum
    assert [S for _, S in cur] == [1024, 4096, 8192, 16384] and cur[0][0] == 0
    # the phases keep their proportions of the schedule
    for (first, _), (got, _) in zip(data.curriculum, cur):
        assert abs(got - first * n / NOMINAL_STEPS) <= 1
    bounds = [a for a, _ in cur] + [n]
    spent = sum((b - a) * step_s[S] for a, b, (_, S) in zip(bounds, bounds[1:], cur))
    assert 0.85 * 600 <= spent <= 600
    # the dense warm-up scales with the schedule; one past the nominal end keeps the run dense
    assert abs(fitted.dense_warmup_steps - cfg.dense_warmup_steps * n / NOMINAL_STEPS) <= 1
    always = fit_schedule(dataclasses.replace(cfg, dense_warmup_steps=10**9), step_s, 600.0)
    assert always.dense_warmup_steps == 10**9


def test_replay_steps_go_back_to_shorter_lengths_and_the_fit_counts_them() -> None:
    """replay_fraction: about that share of the steps past the first phase take one of the shorter
    lengths begun before (each alike, the same in every run), batches keep the tokens per step, and
    the time fit's budget holds with the replayed steps' own seconds."""
    from longctx.train.loop import fit_schedule

    cur = ((0, 512), (100, 1024), (200, 2048))
    plain, mixed = DataConfig(curriculum=cur), DataConfig(curriculum=cur, replay_fraction=0.3, seed=3)
    assert all(plain.seq_len(s) == plain.curriculum_len(s) for s in range(300))
    assert all(mixed.seq_len(s) == 512 for s in range(100))  # nothing shorter to go back to
    later = [mixed.seq_len(s) for s in range(200, 2200)]
    share = sum(S != 2048 for S in later) / len(later)
    assert 0.25 <= share <= 0.35
    assert abs(later.count(512) - later.count(1024)) < 0.25 * (later.count(512) + later.count(1024))
    assert {mixed.seq_len(s) for s in range(100, 200)} == {512, 1024}
    assert [mixed.seq_len(s) for s in range(200, 260)] == [
        DataConfig(curriculum=cur, replay_fraction=0.3, seed=3).seq_len(s) for s in range(200, 260)
    ]
    step = next(s for s in range(200, 300) if mixed.seq_len(s) == 512)
    b = make_batch(dataclasses.replace(mixed, tokens_per_step=4096), step)
    assert b.ids.shape == (8, 512)
    with pytest.raises(DataError):
        DataConfig(curriculum=cur, replay_fraction=1.0)
    step_s = {512: 0.01, 1024: 0.04, 2048: 0.16}
    cfg = TrainConfig(data=DataConfig(curriculum=((0, 512), (3000, 1024), (6000, 2048)), replay_fraction=0.5))
    fitted = fit_schedule(cfg, step_s, 60.0)
    n = fitted.steps
    spent = sum(step_s[fitted.data.seq_len(s)] for s in range(n))
    assert 0.8 * 60 <= spent <= 60 * 1.02
    # without replay's cheaper steps in the estimate the same budget fits fewer steps
    no_replay = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, replay_fraction=0.0))
    assert fit_schedule(no_replay, step_s, 60.0).steps < n


def test_auto_schedule_from_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "auto"
    args = [
        "--config", str(TINY), "--out", str(out), "--steps", "0", "--max-minutes", "0.3", "--device", "cpu",
        "--tokens-per-step", "1024", "--curriculum", "0:512,5000:768", "--dense-warmup-steps", "2",
        "--warmup-steps", "2", "--log-every", "1", "--kl-rows", "16", "--save-dtype", "float32",
    ]  # fmt: skip
    assert main(args) == 0
    st = read_training(out)
    steps, cur = st["recipe"]["steps"], st["recipe"]["data"]["curriculum"]
    assert steps > 2 and [S for _, S in cur] == [512, 768] and cur[1][0] == round(5000 * steps / 10000)
    # --sparse-attention auto: the probe timed the sparse forms and the plan keeps the faster per length
    forms = dict(st["recipe"]["sparse_forms"])
    assert forms.keys() == {512, 768} and set(forms.values()) <= {"gather", "mask"}
    # a resumed --steps 0 run keeps that plan
    s2 = main(args[:3] + [str(tmp_path / "b")] + args[4:] + ["--resume", str(out), "--max-minutes", "0.05"])
    assert s2 == 0
    recipe2 = read_training(tmp_path / "b")["recipe"]
    assert recipe2["steps"] == steps and dict(recipe2["sparse_forms"]) == forms


def test_probe_takes_the_faster_sparse_form_and_gathers_where_the_mask_does_not_fit(monkeypatch) -> None:
    """ "auto" times both sparse forms at each length, shortest first; a masked form that runs out of
    memory (or loses to the gathered one) leaves that length and every longer one to the gathered form."""
    import longctx.train.loop as loop
    import longctx.train.model as model_mod

    # phases begin at halves and three quarters of the nominal schedule, so the time fit below keeps
    # them whatever a loaded machine's timings make of the fitted length
    half, three_q = loop.NOMINAL_STEPS // 2, loop.NOMINAL_STEPS * 3 // 4
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 640), (half, 512), (three_q, 768)))
    cfg = TrainConfig(device="cpu", kl_rows=16, dense_warmup_steps=0, warmup_steps=2, data=data)
    model = _model(seed=1)
    seconds, forms = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert seconds.keys() == forms.keys() == {512, 640, 768} and set(forms.values()) <= {"gather", "mask"}
    assert model.measured_forms == forms and all(t > 0 for t in seconds.values())
    assert all(model._gathers(S) == (f == "gather") for S, f in forms.items())
    # once the gathered form wins, the longer lengths are not timed masked
    firsts = sorted(forms)
    won = next((S for S in firsts if forms[S] == "gather"), None)
    assert won is None or all(forms[S] == "gather" for S in firsts if won < S)

    # the masked attention's S x S mask does not fit from 640-token rows on: gathered there and beyond
    real = model_mod.selection_mask

    def oom_from_640(sel: torch.Tensor, S: int) -> torch.Tensor:
        if sel.shape[1] == S >= 640:  # the attention's mask (the indexer KL's has kl_rows rows)
            raise torch.OutOfMemoryError("simulated")
        return real(sel, S)

    monkeypatch.setattr(model_mod, "selection_mask", oom_from_640)
    model.measured_forms = {}
    model.sparse_attention = "auto"
    _, forms = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert forms[640] == forms[768] == "gather" and forms[512] in ("gather", "mask")
    # ... and where the gathered form does not fit either (768), that length and any longer get no
    # seconds, and the time fit plans without them
    real_gather = model_mod.sparse_attention_train

    def gather_oom_at_768(q, kv, sel, *a, **k):
        if sel.shape[1] >= 768:
            raise torch.OutOfMemoryError("simulated")
        return real_gather(q, kv, sel, *a, **k)

    monkeypatch.setattr(model_mod, "sparse_attention_train", gather_oom_at_768)
    model.measured_forms = {}
    seconds, forms = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert seconds.keys() == forms.keys() == {512, 640} and 768 not in model.measured_forms
    timed = dataclasses.replace(cfg, steps=0, max_minutes=10.0)
    fitted = loop._auto_schedule(timed, model, torch.device("cpu"), None, loop._monotonic(), 0.0)
    # (_auto_schedule probes again: 512's form is whichever timed faster this time)
    planned = dict(fitted.sparse_forms)
    assert [S for _, S in fitted.data.curriculum] == [640, 512] and planned.keys() == {512, 640}
    assert planned[640] == "gather" and planned[512] in ("gather", "mask")
    assert fitted.data.curriculum[0][0] == 0 and fitted.steps > 0
    with monkeypatch.context() as m:
        m.setattr(loop, "probe_step_seconds", lambda *a, **k: ({}, {}))
        with pytest.raises(ConfigError, match="fits a training step"):
            loop._auto_schedule(timed, model, torch.device("cpu"), None, loop._monotonic(), 0.0)
    monkeypatch.setattr(model_mod, "sparse_attention_train", real_gather)
    # a fixed form is timed alone and measures nothing
    model.measured_forms, model.sparse_attention = {}, "mask"
    monkeypatch.setattr(model_mod, "selection_mask", real)
    seconds, forms = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert forms == {} and seconds.keys() == {512, 640, 768} and model.measured_forms == {}


def test_probe_times_the_fused_selection_and_falls_back_when_it_fails(monkeypatch) -> None:
    """select "auto": from _FUSED_FROM-token rows on the probe also times the step with the fused
    selection, keeps the faster per length in measured_selects, and a fused step that fails (here a
    kernel error) leaves that length to the torch selection; the time fit records them (select_forms)."""
    import longctx.train.loop as loop
    import longctx.train.model as model_mod

    monkeypatch.setattr(loop, "_FUSED_FROM", 640)
    half = loop.NOMINAL_STEPS // 2
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512), (half, 640)))
    cfg = TrainConfig(
        device="cpu", kl_rows=16, dense_warmup_steps=0, warmup_steps=2, data=data, select="auto"
    )
    model = _model(seed=1)
    model.select_form = "auto"
    seconds, _ = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert seconds.keys() == {512, 640} and model.measured_selects.keys() == {640}  # 512: torch, untimed
    assert model.measured_selects[640] in ("torch", "fused")
    calls = []

    def broken(self, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise RuntimeError("out of resources: shared memory (simulated)")

    monkeypatch.setattr(model_mod.TrainCausalLM, "_select_fused", broken)
    model.measured_selects = {}
    seconds, _ = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert calls and model.measured_selects == {640: "torch"} and seconds.keys() == {512, 640}
    timed = dataclasses.replace(cfg, steps=0, max_minutes=10.0)
    fitted = loop._auto_schedule(timed, model, torch.device("cpu"), None, loop._monotonic(), 0.0)
    assert fitted.select_forms == ((640, "torch"),)


def test_probe_stops_timing_a_form_twice_as_slow(monkeypatch) -> None:
    """A timed rep over twice the faster form's median ends that form's timing (the seventeenth
    session's fused top-32 steps took 69 s at 128K against 6.8: four of them ate the budget)."""
    import longctx.train.loop as loop

    monkeypatch.setattr(loop, "_FUSED_FROM", 512)
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),))
    cfg = TrainConfig(device="cpu", kl_rows=16, dense_warmup_steps=0, warmup_steps=2, data=data)
    model = _model(seed=3)
    model.sparse_attention, model.select_form = "gather", "auto"
    fused_calls: list[float] = []  # each fused step's seconds
    real = loop.compute_loss

    def slow_fused(model, batch, *a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = real(model, batch, *a, **k)
        if model.measured_selects.get(512) == "fused":
            # 7x the loss's own time and more (so twice the whole step's with its backward) on a busy CPU
            # too, where one step once took 9 s
            time.sleep(6 * (time.perf_counter() - t0) + 0.2)
            fused_calls.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(loop, "compute_loss", slow_fused)
    seconds, _ = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=3)
    assert len(fused_calls) == 2  # the warm-up and one timed rep, not 1 + 3
    assert model.measured_selects == {512: "torch"} and seconds[512] < min(fused_calls)
    # rows from _PROBE_ONE_REP_FROM tokens on: one timed rep after the warm-up, whatever `reps` says
    calls: list[int] = []
    monkeypatch.setattr(loop, "compute_loss", lambda m, b, *a, **k: calls.append(1) or real(m, b, *a, **k))
    monkeypatch.setattr(loop, "_PROBE_ONE_REP_FROM", 512)
    model.select_form = "torch"
    loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=3)
    assert len(calls) == 2


def test_probe_times_the_fused_selection_alone_after_a_clear_win(monkeypatch) -> None:
    """Once the fused selection's step beat the chunked one's by FUSED_ALONE_LEAD at a length, longer
    lengths time the fused one alone (the H200's chunked 256K probe steps would cost ~1 minute of the
    budget); where the fused one then fails, that length times both again and keeps the chunked one."""
    import longctx.train.loop as loop
    import longctx.train.model as model_mod

    monkeypatch.setattr(loop, "_FUSED_FROM", 512)
    third = loop.NOMINAL_STEPS // 3
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512), (third, 640), (2 * third, 768)))
    cfg = TrainConfig(device="cpu", kl_rows=16, dense_warmup_steps=0, warmup_steps=2, data=data)
    model = _model(seed=4)
    model.sparse_attention, model.select_form = "gather", "auto"
    chunked: list[int] = []  # the row length of every step run with the chunked selection
    real = loop.compute_loss

    def slow_chunked(model, batch, *a, **k):  # type: ignore[no-untyped-def]
        S = batch.ids.shape[1]
        if model.measured_selects.get(S) != "fused":
            chunked.append(S)
            time.sleep(0.3)  # the chunked selection loses by far more than the lead
        return real(model, batch, *a, **k)

    monkeypatch.setattr(loop, "compute_loss", slow_chunked)
    seconds, _ = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert seconds.keys() == {512, 640, 768}
    assert model.measured_selects == {512: "fused", 640: "fused", 768: "fused"}
    assert set(chunked) == {512}  # 640 and 768: the fused selection alone
    fused = model_mod.TrainCausalLM._select_fused

    def broken_at_768(self, qi, *a, **k):  # type: ignore[no-untyped-def]
        if qi.shape[1] == 768:
            raise RuntimeError("out of resources: shared memory (simulated)")
        return fused(self, qi, *a, **k)

    monkeypatch.setattr(model_mod.TrainCausalLM, "_select_fused", broken_at_768)
    chunked.clear()
    model.measured_selects = {}
    seconds, _ = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert seconds.keys() == {512, 640, 768} and set(chunked) == {512, 768}
    assert model.measured_selects == {512: "fused", 640: "fused", 768: "torch"}


def test_probe_times_the_own_topk_under_long_topk() -> None:
    """With --long-topk the probe's steps select each indexer's own top-k, not step 0's draw."""
    import longctx.train.loop as loop

    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),))
    cfg = TrainConfig(device="cpu", kl_rows=16, dense_warmup_steps=0, warmup_steps=2, data=data,
                      long_topk_from=256, long_topk=4)  # fmt: skip
    assert loop.step_topk(cfg, 0, 512) == 4  # step 0 would draw the small one
    model = _model(seed=5)
    model.sparse_attention = "gather"
    picked = _spy_topk(model)
    loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert picked and set(picked) == {model.model.layers["0"].self_attn.indexer.topk}


def test_fused_selection_falls_back_to_exact_products(monkeypatch) -> None:
    """The trainer's fused selection asks for tf32x3 products; where they fail (a Triton that cannot
    compile them) it says so once and selects with exact ones from then on, the same positions."""
    import longctx.kernels.indexer_topk as it

    m = _model(seed=6)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    qi, ki, wi = (
        torch.randn(1, 300, 4, 16, generator=g),
        torch.randn(1, 300, 16, generator=g),
        torch.rand(1, 300, 4, generator=g),
    )
    want = m._select(qi, ki, wi, 8)
    real = it.indexer_topk_paged
    asked: list[str] = []

    def no_tf32x3(*a, **k):  # type: ignore[no-untyped-def]
        asked.append(k["fp32_dot"])
        if k["fp32_dot"] == "tf32x3":
            raise RuntimeError("PassManager::run failed (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(it, "indexer_topk_paged", no_tf32x3)
    assert m.select_dot == "tf32x3"
    assert torch.equal(m._select_fused(qi, ki, wi, 8), want) and m.select_dot == "ieee"
    assert torch.equal(m._select_fused(qi, ki, wi, 8), want)
    assert asked == ["tf32x3", "ieee", "ieee"]  # one failed try, then exact products only


def test_probe_times_each_phase_at_its_own_length_under_replay(monkeypatch) -> None:
    """With replay the step a phase begins at may draw a shorter length; the probe still times a row
    of the phase's own length (the H200 probe of run 15 timed a 16K row for the 64K phase)."""
    import longctx.train.loop as loop

    half = loop.NOMINAL_STEPS // 2
    data = DataConfig(tokens_per_step=1536, curriculum=((0, 512), (half, 768)), replay_fraction=0.9, seed=0)
    first = next(f for f in range(half, half + 100) if data.seq_len(f) != 768)  # a replayed first step
    data = dataclasses.replace(data, curriculum=((0, 512), (first, 768)))
    assert data.seq_len(first) == 512
    cfg = TrainConfig(device="cpu", kl_rows=16, dense_warmup_steps=0, warmup_steps=2, data=data)
    timed: list[int] = []
    real = loop.compute_loss

    def spy(model, batch, *a, **k):  # type: ignore[no-untyped-def]
        timed.append(batch.ids.shape[1])
        return real(model, batch, *a, **k)

    monkeypatch.setattr(loop, "compute_loss", spy)
    model = _model(seed=2)
    model.sparse_attention = "mask"
    seconds, _ = loop.probe_step_seconds(model, cfg, torch.device("cpu"), reps=1)
    assert seconds.keys() == {512, 768} and sorted(set(timed)) == [512, 768] and timed[-1] == 768


def test_gate_waits_for_exact_match_over_the_window() -> None:
    from longctx.train.loop import gate_ready, next_length, realized_curriculum

    cfg = TrainConfig(advance_exact=0.8, advance_window=3, advance_min_steps=20,
                      data=DataConfig(curriculum=((0, 512), (10, 768), (20, 1024))))  # fmt: skip
    rows = [{"step": s, "answer_exact": e} for s, e in [(10, 0.2), (20, 0.9), (30, 0.9), (40, 0.7)]]
    assert not gate_ready(rows[:3], 0, cfg)  # the window's mean is 0.67
    assert gate_ready(rows[:3] + [{"step": 40, "answer_exact": 0.95}], 0, cfg)
    assert gate_ready(rows, 0, cfg)  # (0.9 + 0.9 + 0.7) / 3 >= 0.8
    assert not gate_ready(rows + [{"step": 50, "answer_exact": 0.3}], 0, cfg)
    assert not gate_ready([{"step": s, "answer_exact": 1.0} for s in (31, 32, 33)], 20, cfg)  # too soon
    assert gate_ready([{"step": s, "answer_exact": 1.0} for s in (38, 39, 40)], 20, cfg)
    assert realized_curriculum(cfg, None) == ((0, 512),)
    assert next_length(cfg, ((0, 512),)) == 768 and next_length(cfg, ((0, 512), (5, 768), (9, 1024))) is None
    st = {"recipe": {"realized_curriculum": [[0, 512], [7, 768]]}}
    assert realized_curriculum(cfg, st) == ((0, 512), (7, 768))


def test_gated_dense_warmup_follows_its_length() -> None:
    """Under the gate, attention turns sparse as many steps into the same length as planned."""
    from longctx.train.loop import NEVER, gated_dense_warmup

    cur = ((0, 512), (10, 768), (20, 1024))
    cfg = TrainConfig(steps=100, dense_warmup_steps=12, data=DataConfig(curriculum=cur))
    assert gated_dense_warmup(cfg, ((0, 512),)) == NEVER  # 768 not reached: dense
    assert gated_dense_warmup(cfg, ((0, 512), (7, 768))) == 9
    assert gated_dense_warmup(cfg, ((0, 512), (40, 768), (41, 1024))) == 42  # may fall in a later length
    assert gated_dense_warmup(dataclasses.replace(cfg, dense_warmup_steps=5), ((0, 512),)) == 5
    assert (
        gated_dense_warmup(dataclasses.replace(cfg, dense_warmup_steps=25), ((0, 512), (7, 768), (40, 1024)))
        == 45
    )
    assert gated_dense_warmup(dataclasses.replace(cfg, dense_warmup_steps=10**6), cur) == 10**6  # all dense
    assert gated_dense_warmup(cfg, cur) == 12  # realized as planned: the plain schedule


def test_gate_counts_only_steps_at_the_curriculum_length_under_replay(tmp_path: Path, monkeypatch) -> None:
    """With replay a log row's answer exact match mixes in shorter, easier replayed steps: the gate
    reads the row's mean over the steps at the curriculum's own length and skips rows that had none;
    the training log carries that mean (None where a row's steps were all replayed)."""
    import longctx.train.loop as loop

    cfg = TrainConfig(advance_exact=0.8, advance_window=2, advance_min_steps=1)
    rows = [
        {"step": 1, "answer_exact": 0.95, loop.AT_LEN: 0.5},
        {"step": 2, "answer_exact": 0.9, loop.AT_LEN: 0.6},
    ]
    assert not loop.gate_ready(rows, 0, cfg)  # 0.925 overall, 0.55 at the length
    rows += [
        {"step": 3, "answer_exact": 1.0, loop.AT_LEN: 0.9},
        {"step": 4, "answer_exact": 1.0, loop.AT_LEN: None},
    ]
    assert not loop.gate_ready(rows, 0, cfg)  # (0.6 + 0.9) / 2: step 4's row does not count
    assert loop.gate_ready(rows + [{"step": 5, "answer_exact": 0.2, loop.AT_LEN: 0.8}], 0, cfg)

    # a gated run with replay, the gate open after one step: 640 from step 1, 512 replayed after it
    monkeypatch.setattr(loop, "gate_ready", lambda rows, start, cfg: rows[-1]["step"] - start >= 1)
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512), (1000, 640)), replay_fraction=0.6, seed=1)
    gated = TrainConfig(model_config=str(TINY), out=str(tmp_path / "g"), steps=8, device="cpu",
                        warmup_steps=2, dense_warmup_steps=0, log_every=1, kl_rows=16, save_every=100,
                        save_dtype="float32", advance_exact=0.5, data=data)  # fmt: skip
    loop.train(gated)
    log = read_training(tmp_path / "g")["log"]
    assert all(loop.AT_LEN in r for r in log)
    replayed = [r for r in log if r["seq_len"] == 512 and r["step"] > 1]  # log_every 1: one step a row
    assert replayed and all(r[loop.AT_LEN] is None for r in replayed)
    assert all(r[loop.AT_LEN] == r["answer_exact"] for r in log if r["seq_len"] == 640)


def test_gated_curriculum_advances_restarts_the_data_and_resumes(tmp_path: Path, monkeypatch) -> None:
    """With the gate open every 3 steps: lengths 512 -> 640 -> 768 at steps 3 and 6 (the batches
    after an advance are at the new length, not prefetched old ones), the realized curriculum is
    saved, and a resumed run keeps it."""
    import longctx.train.loop as loop

    monkeypatch.setattr(loop, "gate_ready", lambda rows, start, cfg: rows[-1]["step"] - start >= 3)
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512), (1000, 640), (2000, 768)))
    cfg = TrainConfig(model_config=str(TINY), out=str(tmp_path / "g"), steps=10, device="cpu",
                      warmup_steps=2, dense_warmup_steps=1001, log_every=1, kl_rows=16, save_every=100,
                      save_dtype="float32", advance_exact=0.5, data=data)  # fmt: skip
    loop.train(cfg)
    st = read_training(tmp_path / "g")
    lens = [r["seq_len"] for r in st["log"]]
    assert lens == [512] * 3 + [640] * 3 + [768] * 4
    # planned sparse 1 step into 640 (1001 = 1000 + 1): 640 came at step 3, so sparse from step 4
    assert [r["stage"] for r in st["log"]] == ["dense"] * 4 + ["sparse"] * 6
    assert [tuple(x) for x in st["recipe"]["realized_curriculum"]] == [(0, 512), (3, 640), (6, 768)]
    resumed = dataclasses.replace(cfg, out=str(tmp_path / "r"), resume=str(tmp_path / "g"), steps=12)
    loop.train(resumed)
    st2 = read_training(tmp_path / "r")
    assert [r["seq_len"] for r in st2["log"]][10:] == [768, 768]
    assert [r["stage"] for r in st2["log"]][10:] == ["sparse", "sparse"]


def test_a_step_out_of_memory_ends_the_run_with_its_weights_saved(tmp_path: Path, monkeypatch) -> None:
    """A training step that runs out of device memory (a long row the probe let through) stops the run
    where it is: the steps before it are saved as a loadable checkpoint and the summary says why."""
    import longctx.train.loop as loop

    real = loop.train_step

    def step_or_oom(model, opt, batch, cfg, step, device):  # type: ignore[no-untyped-def]
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, opt, batch, cfg, step, device)

    monkeypatch.setattr(loop, "train_step", step_or_oom)
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),))
    cfg = TrainConfig(
        model_config=str(TINY), out=str(tmp_path / "o"), steps=6, device="cpu", data=data, warmup_steps=1,
        dense_warmup_steps=0, log_every=1, kl_rows=16, save_dtype="float32", eval_samples=0,
    )  # fmt: skip
    summary = loop.train(cfg)
    assert summary["stopped"] == "out of memory at step 3 (rows 2 x 512)" and summary["step"] == 3
    st = read_training(tmp_path / "o")
    assert st["step"] == 3 and len(st["log"]) == 3
    assert all((tmp_path / "o" / f).exists() for f in MODEL_FILES)
    m = TrainCausalLM(ModelConfig.from_json(tmp_path / "o"))
    load_model_weights(m, tmp_path / "o", CPU)  # the weights of step 3 load


def test_a_masked_step_out_of_memory_retries_gathered_and_goes_on(tmp_path: Path, monkeypatch) -> None:
    """A step whose rows took the masked form (the probe's choice) and ran out of memory is tried again in
    the gathered form, which that length and the longer masked ones keep; the run goes on to its planned
    steps and the recipe records the fallback. A gathered step that runs out of memory still ends the run."""
    import longctx.train.loop as loop

    real = loop.train_step
    tried: list[tuple[int, int, bool]] = []

    def mask_ooms(model, opt, batch, cfg, step, device):  # type: ignore[no-untyped-def]
        S = batch.ids.shape[1]
        tried.append((step, S, model._gathers(S)))
        if S == 640 and not model._gathers(S):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, opt, batch, cfg, step, device)

    monkeypatch.setattr(loop, "train_step", mask_ooms)
    data = DataConfig(tokens_per_step=1280, curriculum=((0, 512), (2, 640), (4, 768)))
    cfg = TrainConfig(
        model_config=str(TINY), out=str(tmp_path / "o"), steps=6, device="cpu", data=data, warmup_steps=1,
        dense_warmup_steps=0, log_every=1, kl_rows=16, save_dtype="float32", eval_samples=0,
        sparse_forms=((512, "mask"), (640, "mask"), (768, "mask")),
    )  # fmt: skip
    summary = loop.train(cfg)
    assert summary["stopped"] == "steps" and summary["step"] == 6
    assert tried[:2] == [(0, 512, False), (1, 512, False)]
    assert tried[2:4] == [(2, 640, False), (2, 640, True)]  # the same step again, gathered
    assert [g for _, S, g in tried[4:]] == [True] * 3 and [S for _, S, _ in tried[4:]] == [640, 768, 768]
    st = read_training(tmp_path / "o")
    assert st["recipe"]["oom_fallbacks"] == [{"step": 2, "seq_len": 640, "gather_from_now": [640, 768]}]
    assert dict(st["recipe"]["sparse_forms"]) == {512: "mask", 640: "gather", 768: "gather"}  # for a resume
    assert len(st["log"]) == 6
    # a length the probe left unmeasured ("auto" masks it) is switched too, not only the measured longer ones
    tried.clear()
    unmeasured = dataclasses.replace(cfg, out=str(tmp_path / "u"), sparse_forms=((768, "mask"),))
    assert loop.train(unmeasured)["stopped"] == "steps"
    assert tried[2:4] == [(2, 640, False), (2, 640, True)]
    fallbacks = read_training(tmp_path / "u")["recipe"]["oom_fallbacks"]
    assert fallbacks == [{"step": 2, "seq_len": 640, "gather_from_now": [640, 768]}]

    def gathered_ooms(model, opt, batch, cfg, step, device):  # type: ignore[no-untyped-def]
        if step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, opt, batch, cfg, step, device)

    monkeypatch.setattr(loop, "train_step", gathered_ooms)
    gathered = dataclasses.replace(cfg, out=str(tmp_path / "g"), sparse_forms=(), sparse_attention="gather")
    assert loop.train(gathered)["stopped"] == "out of memory at step 1 (rows 2 x 512)"


def test_gated_time_fitted_run_uses_its_time_at_the_final_lr(tmp_path: Path, monkeypatch) -> None:
    """A gated `--steps 0` run whose gate holds reaches its planned steps early; it then goes on at the
    schedule's final lr until the deadline instead of stopping (run 7 left 30% of its time unused)."""
    import longctx.train.loop as loop

    monkeypatch.setattr(loop, "probe_step_seconds", lambda model, cfg, device: ({512: 0.01, 640: 0.01}, {}))
    monkeypatch.setattr(loop, "fit_schedule", lambda cfg, step_s, left: dataclasses.replace(cfg, steps=3))
    monkeypatch.setattr(loop, "gate_ready", lambda rows, start, cfg: False)
    monkeypatch.setattr(loop, "EXTEND_MIN_S", 1.0)
    # a clock that moves one second per training step: the run's time is 12 steps whatever the
    # machine's speed (a wall clock let a busy CI machine reach the deadline before step 3)
    clock = [0.0]
    step_fn = loop.train_step

    def timed_step(*a, **k):
        clock[0] += 1.0
        return step_fn(*a, **k)

    monkeypatch.setattr(loop, "_monotonic", lambda: clock[0])
    monkeypatch.setattr(loop, "train_step", timed_step)
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512), (5000, 640)))
    cfg = TrainConfig(model_config=str(TINY), out=str(tmp_path / "x"), steps=0, max_minutes=0.2,
                      device="cpu", warmup_steps=1, log_every=1, kl_rows=16, save_every=100,
                      save_dtype="float32", advance_exact=0.5, data=data)  # fmt: skip
    summary = loop.train(cfg)
    st = read_training(tmp_path / "x")
    assert summary["stopped"] == "deadline" and st["step"] == 12, summary
    assert st["recipe"]["steps"] == 3 and st["recipe"]["extended_from"] == 3
    lrs = [r["lr"] for r in st["log"] if r["step"] > 3]
    assert lrs and all(abs(x - cfg.lr * cfg.min_lr_ratio) < 1e-12 for x in lrs)
    # an explicit step count is kept: no extension
    fixed = dataclasses.replace(cfg, out=str(tmp_path / "y"), steps=3)
    assert loop.train(fixed)["stopped"] == "steps" and read_training(tmp_path / "y")["step"] == 3


def test_train_only_indexer_moves_the_indexers_alone(tmp_path: Path) -> None:
    """--train-only indexer: the indexers' weights change (their KL falls on a fixed batch's stream),
    every other weight and the router bias stay exactly as loaded."""
    from safetensors.torch import load_file

    a = tmp_path / "a"
    _train_cli(a, steps=1)
    b = tmp_path / "b"
    args = [
        "--config", str(TINY), "--out", str(b), "--steps", "4", "--device", "cpu", "--init-from", str(a),
        "--tokens-per-step", "1024", "--curriculum", "0:512", "--dense-warmup-steps", "100",
        "--warmup-steps", "1", "--lr", "1e-2", "--kl-rows", "32", "--save-dtype", "float32",
        "--train-only", "indexer", "--log-every", "1",
    ]  # fmt: skip
    assert main(args) == 0
    before, after = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".indexer." in k for k in moved), sorted(moved)
    assert any("indexer.wq_b" in k for k in moved)
    with pytest.raises(SystemExit):  # argparse: one line naming the choices, exit code 2
        main([*args[:3], str(tmp_path / "c"), *args[4:-6], "--train-only", "bogus"])


def test_copy_rows_recur_and_init_from_starts_at_step_zero(tmp_path: Path) -> None:
    cfg = DataConfig(tokens_per_step=4096, curriculum=((0, 512),), copy_fraction=1.0)
    b = make_batch(cfg, 0)
    assert set(b.tasks) == {"copy"}
    words = bytes(b.ids[0].tolist()).decode().split()
    assert len(set(words)) < len(words)  # strings recur
    a = tmp_path / "a"
    _train_cli(a, steps=2)
    # (the layers an fp8 cache keeps exact go on with the weights, as their window and narrowing do)
    a_cfg = json.loads((a / "config.json").read_text())
    (a / "config.json").write_text(json.dumps({**a_cfg, "kv_fp8_skip_layers": [1]}))
    b_dir = tmp_path / "b"
    args = [
        "--config", str(TINY), "--out", str(b_dir), "--steps", "2", "--device", "cpu", "--init-from", str(a),
        "--tokens-per-step", "1024", "--curriculum", "0:512", "--copy-fraction", "0.5", "--kl-rows", "16",
        "--save-dtype", "float32",
    ]  # fmt: skip
    assert main(args) == 0
    assert read_training(b_dir)["step"] == 2
    assert ModelConfig.from_json(b_dir).kv_fp8_skip_layers == (1,)


def test_hex_copy_rows_pool_uuids_and_leave_other_rows_alone() -> None:
    """--copy-hex-fraction: that share of the copy rows pools UUIDs (recurring, 8-4-4-4-12 lowercase
    hex); at 0 the rows are the old generator's bit for bit (no extra draw); out of [0, 1] is refused."""
    import random
    import re

    from longctx.train.data import _copy_row

    def old_copy_row(rng: random.Random, n: int) -> list[int]:  # the generator before the flag
        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
        pool = ["".join(rng.choices(alphabet, k=rng.randint(8, 48))) for _ in range(rng.randint(4, 24))]
        out: list[str] = []
        size = 0
        while size <= n:
            w = rng.choice(pool)
            out.append(w)
            size += len(w) + 1
        return list(" ".join(out).encode("ascii")[:n])

    for seed in range(5):
        assert _copy_row(random.Random(seed), 700) == old_copy_row(random.Random(seed), 700)
    cfg = DataConfig(tokens_per_step=4096, curriculum=((0, 1024),), copy_fraction=1.0, copy_hex_fraction=1.0)
    b = make_batch(cfg, 0)
    assert set(b.tasks) == {"copy"}
    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    for row in b.ids.tolist():
        words = bytes(row).decode().split()[:-1]  # (the last one may be cut off)
        assert words and all(uuid.fullmatch(w) for w in words) and len(set(words)) < len(words)
    half = [_copy_row(random.Random(i), 300, 0.5) for i in range(40)]
    hexed = sum(bool(uuid.match(bytes(r).decode())) for r in half)
    assert 8 < hexed < 32  # about half the rows
    for bad in (-0.1, 1.5):
        with pytest.raises(DataError):
            DataConfig(copy_hex_fraction=bad)
        with pytest.raises(DataError):
            DataConfig(copy_upper_fraction=bad)
    # capital-letter pools (vt's names are capitals): recurring words of 5-16 capitals, about the share
    # asked of the rows not drawn for UUIDs; at 0 no draw, so the rows are the old ones
    cfg = DataConfig(
        tokens_per_step=4096, curriculum=((0, 1024),), copy_fraction=1.0, copy_upper_fraction=1.0
    )
    for row in make_batch(cfg, 0).ids.tolist():
        words = bytes(row).decode().split()[:-1]
        assert words and all(re.fullmatch(r"[A-Z]{5,16}", w) for w in words) and len(set(words)) < len(words)
    upper = re.compile(r"[A-Z]{5,16} ")
    half = [_copy_row(random.Random(i), 300, 0.0, 0.5) for i in range(40)]
    assert 8 < sum(bool(upper.match(bytes(r).decode())) for r in half) < 32
    assert all(
        _copy_row(random.Random(i), 300, 0.5, 0.0) == _copy_row(random.Random(i), 300, 0.5) for i in range(8)
    )
    both = [bytes(_copy_row(random.Random(i), 300, 0.5, 1.0)).decode() for i in range(40)]
    assert all(uuid.match(r) or upper.match(r) for r in both)  # (a row not drawn for UUIDs is capitals)


def test_pair_copy_rows_write_each_string_twice_among_random_chunks() -> None:
    """--copy-pairs-fraction: that share of the copy rows, in the alphabet the other fractions drew, writes
    each string at most twice with a random chunk of that alphabet before every string; at 0 the rows
    are the pooled ones bit for bit (no draw); the CLI takes the flag and refuses one out of [0, 1]."""
    import random
    import re
    from collections import Counter

    from longctx.train.__main__ import main
    from longctx.train.data import _copy_row

    for alphabet, hexf, upper in (("[a-z0-9]", 0.0, 0.0), ("[A-Z]", 0.0, 1.0), ("[0-9a-f-]", 1.0, 0.0)):
        for seed in range(6):
            ids = _copy_row(random.Random(seed), 1500, hexf, upper, 1.0)
            assert len(ids) == 1500
            words = bytes(ids).decode().split(" ")[:-1]
            assert all(re.fullmatch(alphabet + "+", w) for w in words), words
            chunks, strings = words[0::2], words[1::2]  # a chunk, then a string, alternately
            assert all(1 <= len(c) <= 24 for c in chunks)
            counts = Counter(strings)
            assert max(counts.values()) <= 2 < len(strings) and sum(v == 2 for v in counts.values()) >= 3
            if upper:
                assert all(5 <= len(w) <= 16 for w in strings)
    for seed in range(5):  # 0: the pooled rows, bit for bit
        r = random.Random(seed)
        assert _copy_row(random.Random(seed), 700, 0.3, 0.5, 0.0) == _copy_row(r, 700, 0.3, 0.5)
    some = [bytes(_copy_row(random.Random(i), 1500, 0.0, 0.0, 0.5)).decode() for i in range(40)]
    pooled = sum(len(set(x.split())) <= 25 for x in some)  # (a pool holds at most 24 strings)
    assert 8 < pooled < 32  # about half the rows pooled, the others pairs
    with pytest.raises(DataError):
        DataConfig(copy_pairs_fraction=1.5)
    assert (
        main(["--copy-pairs-fraction", "2", "--steps", "1", "--device", "cpu", "--out", "/nonexistent/x"])
        == 2
    )


def test_task_weights_pick_the_retrieval_rows(capsys) -> None:
    """--task-weights: the named tasks' weights over the default mix; a task at 0 is never drawn, the mix
    of one task gives only its rows; bad specs are DataError (the CLI: exit 2, one line)."""
    from longctx.train.__main__ import main
    from longctx.train.data import DEFAULT_TASKS, parse_task_weights

    w = dict(parse_task_weights("niah_multikey_1=3, vt=0"))
    assert w["niah_multikey_1"] == 3.0 and w["vt"] == 0.0 and len(w) == len(DEFAULT_TASKS)
    only = ",".join(f"{t}=0" for t, _ in DEFAULT_TASKS if t != "niah_multikey_1")
    cfg = DataConfig(tokens_per_step=8192, curriculum=((0, 1024),), text_fraction=0.0, copy_fraction=0.0,
                     tasks=parse_task_weights(only))  # fmt: skip
    assert set(make_batch(cfg, 0).tasks) == {"niah_multikey_1"}
    for bad in ("niah_multikey_1", "vt=-1", "vt=x", "=2", ",".join(f"{t}=0" for t, _ in DEFAULT_TASKS)):
        with pytest.raises(DataError):
            DataConfig(tasks=parse_task_weights(bad))
    with pytest.raises(DataError, match="unknown task"):
        DataConfig(tasks=parse_task_weights("nope=1"))
    capsys.readouterr()
    assert main(["--out", "/nonexistent/x", "--task-weights", "vt=x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --task-weights 'vt=x': expected TASK=WEIGHT,... with finite weights >= 0"]


def test_vt_hops_draw_shorter_chains(capsys) -> None:
    """--vt-hops: each vt row's chain has one of the given hop counts (its answer that many names plus
    one, all in the prompt); without it the rows are RULER's four-hop chains, and the generator's
    variant of a task is drawn apart from the task's own; bad counts are DataError (the CLI: exit 2)."""
    import dataclasses

    from longctx.errors import LongctxError
    from longctx.train.__main__ import main
    from longctx.train.data import ANSWER, DEFAULT_TASKS, parse_task_weights, parse_vt_hops
    from longctx.workloads.ruler_tasks import TASKS, RulerGenerator
    from longctx.workloads.tokens import ByteCounter

    only_vt = parse_task_weights(",".join(f"{t}=0" for t, _ in DEFAULT_TASKS if t != "vt"))
    base = dict(tokens_per_step=16384, curriculum=((0, 2048),), text_fraction=0.0, copy_fraction=0.0,
                tasks=only_vt, chat_fraction=0.0, document_fraction=0.0)  # fmt: skip

    def answers(cfg: DataConfig) -> list[list[str]]:
        b = make_batch(cfg, 3)
        assert set(b.tasks) == {"vt"}
        out = []
        for ids, targets, kind in zip(b.ids.tolist(), b.targets.tolist(), b.kind.tolist()):
            text = bytes(t for t, k in zip(targets, kind) if k == ANSWER and t < 256).decode()
            prompt = bytes(t for t in ids if t < 256).decode()
            names = text.split()
            assert names and all(prompt.count(f"VAR {n} =") == 1 for n in names), (text, prompt[-200:])
            out.append(names)
        return out

    assert {len(a) for a in answers(DataConfig(**base))} == {5}
    assert {len(a) for a in answers(DataConfig(**base, vt_hops=(1,)))} == {2}
    assert {len(a) for a in answers(DataConfig(**base, vt_hops=(1, 2, 3)))} <= {2, 3, 4}
    gen = RulerGenerator(ByteCounter(), seed=5, max_new_tokens_scale=0.5)
    own = gen.sample("vt", 2048, 1)
    assert gen.sample("vt", 2048, 1, TASKS["vt"]) == own  # the task's own spec: its own samples
    two = gen.sample("vt", 2048, 1, dataclasses.replace(TASKS["vt"], num_hops=2))
    assert len(two.outputs) == 3 and two.input != own.input
    assert 0.98 * 2048 <= two.prompt_tokens + two.max_new_tokens <= 2048
    with pytest.raises(LongctxError):
        gen.sample("vt", 2048, 0, TASKS["niah_single_1"])  # another task's spec
    for bad in ("0", "1,x", "17", ""):
        with pytest.raises(DataError):
            parse_vt_hops(bad)
    with pytest.raises(DataError):
        DataConfig(vt_hops=(0,))
    capsys.readouterr()
    assert main(["--out", "/nonexistent/x", "--vt-hops", "1,x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --vt-hops '1,x': expected hop counts like 1,2,3,4"]


def test_shipped_wip_checkpoint_loads_and_retrieves_at_1024() -> None:
    """The part-trained retrieval model (models-shipped/retrieval-wip) through the real engine on the CPU:
    it must keep finding the needle in niah_single_1/2 prompts of 1,024 tokens, through the top-256
    selection (run 10's weights: 8 of 8 each, and at 2,048 too; run 8's: 2 and 1 of 8)."""
    from longctx.train.evaluate import niah_eval

    wip = ROOT / "models-shipped" / "retrieval-wip"
    r = niah_eval(wip, lengths=(1024,), tasks=("niah_single_1", "niah_single_2"), samples=4, device="cpu",
                  dtype="float32", max_new_tokens=12)  # fmt: skip
    assert r["niah_single_1@1024"] >= 75 and r["niah_single_2@1024"] >= 75, r


@pytest.mark.parametrize("chunks", [2, 3])
def test_pose_positions_skip_inside_the_window(chunks: int) -> None:
    """PoSE position ids: start at 0, strictly increasing, at most `chunks - 1` jumps with consecutive
    positions between them, last < pose_max, about pose_prob of the rows skipped, skips spread from
    short to long (log-uniform); deterministic per (seed, step); off (or S >= pose_max) is 0..S-1."""
    S, pose_max, B, steps = 128, 8192, 16, 60
    cfg = DataConfig(seed=7, pose_max=pose_max, pose_prob=0.75, pose_chunks=chunks)
    pos = torch.cat([pose_positions(cfg, step, B, S) for step in range(steps)])
    assert pos.dtype == torch.int64 and pos.shape == (B * steps, S)
    d = pos.diff(dim=1)
    assert (pos[:, 0] == 0).all() and (d >= 1).all() and int(pos.max()) <= pose_max - 1
    jumps = (d > 1).sum(1)
    assert int(jumps.max()) == chunks - 1  # the pieces between jumps keep consecutive positions
    skipped = pos[:, -1] > S - 1
    assert abs(float(skipped.float().mean()) - 0.75) < 0.06, float(skipped.float().mean())
    if chunks == 2:
        assert torch.equal(jumps > 0, skipped)  # two pieces: every skipped row has its one jump
    total = pos[skipped, -1] - (S - 1)  # the total skip K of each skipped row
    assert int((total < 64).sum()) > 20 and int((total > 1024).sum()) > 20  # near and far both
    assert torch.equal(pos[:B], pose_positions(cfg, 0, B, S))
    assert not torch.equal(pos[:B], pose_positions(cfg, 1, B, S))
    plain = torch.arange(S).repeat(B, 1)
    assert torch.equal(pose_positions(dataclasses.replace(cfg, pose_max=0), 0, B, S), plain)
    assert torch.equal(pose_positions(dataclasses.replace(cfg, pose_max=S), 0, B, S), plain)
    assert torch.equal(pose_positions(dataclasses.replace(cfg, pose_prob=0.0), 0, B, S), plain)
    # batches: the same tokens with or without skips; no positions at all when off
    on = DataConfig(tokens_per_step=2048, curriculum=((0, 512),), pose_max=4096, pose_prob=1.0)
    a, b = make_batch(on, 3), make_batch(dataclasses.replace(on, pose_max=0), 3)
    assert b.positions is None and a.positions is not None and torch.equal(a.ids, b.ids)
    assert (a.positions[:, -1] > 511).all() and torch.equal(a.positions, pose_positions(on, 3, 4, 512))
    with pytest.raises(DataError):
        DataConfig(pose_chunks=1)


def test_pose_far_draws_far_skips_uniformly() -> None:
    """--pose-far F: that share of the skipped rows draws its total skip uniformly over the range (the
    top octave as often as its share of the range), the rest log-uniformly; the same rows are skipped
    and cut at the same points; 0 is the log-uniform draw bit for bit; outside [0, 1] is refused."""
    S, pose_max, B, steps = 128, 1 << 20, 16, 80
    base = DataConfig(seed=3, pose_max=pose_max, pose_prob=0.75)
    far = dataclasses.replace(base, pose_far=1.0)
    a = torch.cat([pose_positions(base, step, B, S) for step in range(steps)])
    b = torch.cat([pose_positions(far, step, B, S) for step in range(steps)])
    skipped = a[:, -1] > S - 1
    assert torch.equal(skipped, b[:, -1] > S - 1)  # the same rows skipped
    assert torch.equal((a.diff(dim=1) > 1), (b.diff(dim=1) > 1))  # cut at the same points
    budget = pose_max - S
    top_log = float((a[skipped, -1] - (S - 1) > budget // 2).float().mean())
    top_far = float((b[skipped, -1] - (S - 1) > budget // 2).float().mean())
    assert top_log < 0.15 and abs(top_far - 0.5) < 0.08, (top_log, top_far)
    assert int(b.max()) <= pose_max - 1 and (b.diff(dim=1) >= 1).all()
    half = torch.cat([pose_positions(dataclasses.replace(base, pose_far=0.5), s, B, S) for s in range(steps)])
    top_half = float((half[skipped, -1] - (S - 1) > budget // 2).float().mean())
    assert top_log < top_half < top_far
    assert torch.equal(pose_positions(dataclasses.replace(base, pose_far=0.0), 5, B, S), a[5 * B : 6 * B])
    with pytest.raises(DataError):
        DataConfig(pose_far=1.5)


def test_forward_train_positions_are_the_rotary_positions() -> None:
    """positions = 0..S-1 is the old path bit for bit; shifting every position by a constant leaves
    the logits unchanged (rotary attention sees only differences: main attention and indexer, so the
    top-k too) while a skip inside the row changes them after it and not before it; each row of a
    batch takes its own positions."""
    m = _model(seed=3, std=0.1)
    m.eval()
    B, S, at = 2, 96, 50
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(4))
    plain = torch.arange(S).repeat(B, 1)
    skipped = plain.clone()
    skipped[:, at:] += 700

    def logits(sparse: bool, positions: torch.Tensor | None, x: torch.Tensor = ids) -> torch.Tensor:
        with torch.no_grad():
            return m.logits(m.forward_train(x, sparse=sparse, positions=positions)[0])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    assert m.cfg.index_topk < S  # sparse: the selection really drops keys
    for sparse in (False, True):
        ref = logits(sparse, None)
        assert torch.equal(logits(sparse, plain), ref)
        assert rel(logits(sparse, plain + 1000), ref) <= 1e-4
        got = logits(sparse, skipped)
        assert rel(got[:, :at], ref[:, :at]) <= 1e-5  # causal: the prefix never sees the skip
        assert rel(got[:, at:], ref[:, at:]) > 1e-3
        # row-major [B*S] layout: a batch of rows with different positions == each row alone
        mixed = torch.stack([plain[0], skipped[1]])
        both = logits(sparse, mixed)
        assert rel(both[0], ref[0]) <= 1e-5 and rel(both[1], got[1]) <= 1e-5


def test_pose_step_makes_no_host_sync() -> None:
    """The training loss and backward with PoSE positions stay free of host-syncing ops (the GPU step
    queues ahead of the device: docs/training.md, "Step speed")."""
    from bench.train_speed import _Count

    m = _model()
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),), pose_max=8192, pose_prob=1.0)
    batch = make_batch(data, 0)
    assert batch.positions is not None and (batch.positions[:, -1] > 511).all()
    cfg = TrainConfig(data=data, dense_warmup_steps=0, kl_rows=16, needle_weight=1.0)
    with _Count() as count:
        loss, _, _ = compute_loss(m, batch, cfg, 0, CPU)
        loss.backward()
    assert sum(count.syncs.values()) == 0, dict(count.syncs)


def test_pose_from_the_cli_is_recorded_and_resume_keeps_it(tmp_path: Path) -> None:
    """--pose-max trains on the CPU, the recipe and the log record it, a resume without the flags keeps
    the saved settings, and one that sets --pose-max 0 turns the skips off."""
    a = tmp_path / "a"
    args = [
        "--config", str(TINY), "--out", str(a), "--steps", "3", "--device", "cpu",
        "--tokens-per-step", "1024", "--curriculum", "0:512", "--dense-warmup-steps", "2",
        "--warmup-steps", "1", "--log-every", "1", "--kl-rows", "16", "--save-dtype", "float32",
        "--pose-max", "4096", "--pose-prob", "1.0", "--pose-chunks", "3",
    ]  # fmt: skip
    assert main(args) == 0
    st = read_training(a)
    pose = {k: st["recipe"]["data"][k] for k in ("pose_max", "pose_prob", "pose_chunks")}
    assert pose == {"pose_max": 4096, "pose_prob": 1.0, "pose_chunks": 3}
    assert all(r["pose_rows"] == 1.0 and 512 < r["pose_span"] <= 4096 for r in st["log"])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in st["log"])
    b = tmp_path / "b"
    assert main([*args[:3], str(b), "--steps", "5", *args[6:-6], "--resume", str(a)]) == 0
    st = read_training(b)
    assert st["step"] == 5 and {k: st["recipe"]["data"][k] for k in pose} == pose
    assert [r["pose_rows"] for r in st["log"]] == [1.0] * 5
    c = tmp_path / "c"
    assert main([*args[:3], str(c), "--steps", "4", *args[6:-6], "--resume", str(a), "--pose-max", "0"]) == 0
    st = read_training(c)
    assert st["recipe"]["data"]["pose_max"] == 0 and "pose_rows" not in st["log"][-1]


def test_chat_rows_are_the_prompts_the_server_and_ruler_chat_send() -> None:
    """--chat-fraction rows: the checkpoint's chat template around the RULER input, tokenised as the
    server's tokenizer does (special tokens as their ids), the answer and needle marked as in raw rows."""
    from longctx.checkpoint.tokenizer import NUM_BYTES, load_tokenizer
    from longctx.train.data import chat_prompt, encode_text, make_row
    from longctx.workloads.ruler_cli import _chat_renderer
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import ByteCounter

    wip = ROOT / "models-shipped" / "retrieval-wip"
    tok = load_tokenizer(wip)
    sample = RulerGenerator(ByteCounter(), seed=3, max_new_tokens_scale=0.5).sample("niah_single_2", 700, 0)
    text = chat_prompt(sample.input, sample.answer_prefix)
    assert text == _chat_renderer(str(wip))(sample.input, sample.answer_prefix)  # `longctx ruler --chat`
    assert encode_text(text) == tok.encode(text, add_special_tokens=False).ids
    special = {t: tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>")}
    cfg = DataConfig(curriculum=((0, 1024),), chat_fraction=1.0, copy_fraction=0.0, text_fraction=0.0)
    raw = dataclasses.replace(cfg, chat_fraction=0.0)
    for row in range(8):
        ids, kinds, task, needle = make_row(cfg, 0, row, 1024)
        assert ids[:3] == [special["[gMASK]"], special["<sop>"], special["<|user|>"]], task
        first = kinds.index(ANSWER)
        assert special["<|assistant|>"] in ids[:first]
        assert ids[first : first + 1] == [ord(" ")] and EOS_ID in ids[first:]
        assert needle and all(ids[p] < NUM_BYTES for p in needle)
        if task != "vt":  # the needle's bytes are the answer's first value
            assert bytes(ids[p] for p in needle).decode() in tok.decode(ids[first:], skip_special_tokens=True)
        r_ids, r_kinds, r_task, _ = make_row(raw, 0, row, 1024)
        assert r_task == task and max(i for i, k in zip(r_ids, r_kinds) if k != ANSWER) < NUM_BYTES
    with pytest.raises(DataError):
        DataConfig(chat_fraction=1.5)


def test_document_rows_are_the_prompts_the_documents_endpoint_sends() -> None:
    """--document-fraction rows: a niah sample as POST /v1/documents then /ask build it (the server's
    codec: head + document, then separator + question + tail, tokenised in those two pieces), without
    RULER's instruction line; vt rows stay raw; the needle and answer are marked as in raw rows."""
    from longctx.checkpoint.chat_template import DOCUMENT_QUESTION_SEPARATOR
    from longctx.checkpoint.tokenizer import NUM_BYTES
    from longctx.server.text import TextCodec
    from longctx.train.data import document_prompt, encode_text, make_row
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import ByteCounter

    wip = ROOT / "models-shipped" / "retrieval-wip"
    codec = TextCodec(str(wip))
    head, tail = codec.document_frame()
    gen = RulerGenerator(ByteCounter(), seed=5, max_new_tokens_scale=0.5)
    for task in ("niah_single_2", "niah_multikey_2", "niah_multiquery"):
        sample = gen.sample(task, 900, 0)
        text = document_prompt(task, sample.input, sample.answer_prefix)
        document = sample.input.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]
        question = "What " + sample.input.rsplit("\nWhat ", 1)[1]
        served = codec.encode(head + document) + codec.encode(DOCUMENT_QUESTION_SEPARATOR + question + tail)
        assert encode_text(text) == served + codec.encode(sample.answer_prefix.lstrip())
        assert "memorize" not in text and question.endswith("in the provided text?")
    with pytest.raises(DataError):
        document_prompt("vt", gen.sample("vt", 2048, 0).input, "")
    cfg = DataConfig(curriculum=((0, 1024),), document_fraction=1.0, copy_fraction=0.0, text_fraction=0.0)
    raw = dataclasses.replace(cfg, document_fraction=0.0)
    gmask = codec.encode("[gMASK]")
    seen = set()
    for row in range(12):
        ids, kinds, task, needle = make_row(cfg, 0, row, 1024)
        r_ids, _, r_task, _ = make_row(raw, 0, row, 1024)
        assert r_task == task and (ids[:1] == gmask) == (task != "vt"), task
        seen.add(ids[:1] == gmask)
        first = kinds.index(ANSWER)
        assert ids[first : first + 1] == [ord(" ")] and EOS_ID in ids[first:]
        assert needle and all(ids[p] < NUM_BYTES for p in needle)
    assert True in seen
    with pytest.raises(DataError):
        DataConfig(document_fraction=-0.1)


@pytest.mark.parametrize(("flag", "key", "value"), [("--sparse-attention", "sparse_attention", "gather"),
                                                    ("--select", "select", "fused")])  # fmt: skip
def test_sparse_stage_choices_from_the_cli(tmp_path: Path, flag: str, key: str, value: str) -> None:
    """--sparse-attention gather and --select fused (the engine's fused indexer + top-k; its reference
    on a CPU) train (sparse stage: 512-token rows over a top-16) and are recorded; a bogus value is an
    argparse error (exit code 2, one line)."""
    args = [
        "--config", str(TINY), "--out", str(tmp_path / "g"), "--steps", "2", "--device", "cpu",
        "--tokens-per-step", "1024", "--curriculum", "0:512", "--dense-warmup-steps", "0",
        "--warmup-steps", "1", "--log-every", "1", "--kl-rows", "16", "--save-dtype", "float32",
    ]  # fmt: skip
    assert main([*args, flag, value]) == 0
    st = read_training(tmp_path / "g")
    assert st["recipe"][key] == value and st["log"][-1]["stage"] == "sparse"
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in st["log"])
    with pytest.raises(SystemExit):
        main([*args, flag, "bogus"])


def test_row_fractions_from_the_cli_are_recorded_and_resume_keeps_them(tmp_path: Path) -> None:
    a = tmp_path / "a"
    args = [
        "--config", str(TINY), "--out", str(a), "--steps", "1", "--device", "cpu",
        "--tokens-per-step", "1024", "--curriculum", "0:512", "--dense-warmup-steps", "2",
        "--warmup-steps", "1", "--log-every", "1", "--kl-rows", "16", "--save-dtype", "float32",
    ]  # fmt: skip
    assert (
        main(
            [*args, "--chat-fraction", "0.25", "--document-fraction", "0.5", "--replay-fraction", "0.2",
             "--copy-hex-fraction", "0.5", "--copy-upper-fraction", "0.25", "--task-weights",
             "niah_multikey_1=3,vt=0", "--vt-hops", "1,2"]
        )
        == 0
    )  # fmt: skip
    data = read_training(a)["recipe"]["data"]
    assert (
        data["chat_fraction"] == 0.25 and data["document_fraction"] == 0.5 and data["replay_fraction"] == 0.2
    )
    assert data["copy_hex_fraction"] == 0.5 and list(data["vt_hops"]) == [1, 2]
    assert data["copy_upper_fraction"] == 0.25
    weights = {t: w for t, w in data["tasks"]}
    assert weights["niah_multikey_1"] == 3.0 and weights["vt"] == 0.0 and weights["niah_single_1"] == 1.0
    b = tmp_path / "b"
    assert main([*args[:3], str(b), "--steps", "2", *args[6:], "--resume", str(a)]) == 0
    data = read_training(b)["recipe"]["data"]
    assert (
        data["chat_fraction"] == 0.25 and data["document_fraction"] == 0.5 and data["replay_fraction"] == 0.2
    )
    assert data["copy_hex_fraction"] == 0.5 and list(data["vt_hops"]) == [1, 2]
    assert data["copy_upper_fraction"] == 0.25
    assert {t: w for t, w in data["tasks"]} == weights  # (the resumed run's mix goes on)


def test_sparse_attention_train_is_the_masked_attention(monkeypatch) -> None:
    """The gathered sparse attention (absorbed form, query chunks recomputed in the backward) equals
    softmax attention over every key with the selection as a mask: values and gradients, ragged
    selections (-1 pads) included, whether the chunks are one or many."""
    import longctx.train.model as model_mod

    B, S, H, L, R, K = 2, 70, 3, 16, 8, 12
    g = torch.Generator().manual_seed(4)
    q0, kv0 = torch.randn(B, S, H, L + R, generator=g), torch.randn(B, S, L + R, generator=g)
    # as the top-k gives them: distinct causal positions, -1 pads where a query has fewer than K
    sel = torch.full((B, S, K), -1, dtype=torch.long)
    for b in range(B):
        for t in range(S):
            c = torch.randperm(t + 1, generator=g)[:K]
            sel[b, t, torch.randperm(K, generator=g)[: c.numel()]] = c  # pads anywhere in the row
    dy = torch.randn(B, S, H, L, generator=g)
    q, kv = q0.clone().requires_grad_(), kv0.clone().requires_grad_()
    mask = selection_mask(sel, S)
    sc = torch.einsum("bshd,btd->bsht", q, kv) * 0.3
    p = torch.softmax(sc.masked_fill(~mask[:, :, None, :], float("-inf")), -1)
    want = torch.einsum("bsht,btl->bshl", p, kv[..., :L])
    (want * dy).sum().backward()
    want_grads = (q.grad, kv.grad)
    for elems in (1 << 26, B * K * (L + R) * 9):  # one chunk; chunks of 9 queries (checkpointed)
        monkeypatch.setattr(model_mod, "_GATHER_ELEMS", elems)
        q, kv = q0.clone().requires_grad_(), kv0.clone().requires_grad_()
        got = sparse_attention_train(q, kv, sel, 0.3, L)
        (got * dy).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q.grad, want_grads[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.grad, want_grads[1], rtol=1e-5, atol=1e-5)


def test_gathered_sparse_step_equals_the_masked_reference(monkeypatch) -> None:
    """The trainer's sparse stage through the gathered absorbed attention computes the same losses,
    hidden states and gradients (every parameter, the indexers' by their KL and needle loss
    included) as the masked expanded-form reference, in fp32 on a real batch."""
    import longctx.train.model as model_mod

    monkeypatch.setattr(model_mod, "_GATHER_ELEMS", 1 << 14)  # several checkpointed chunks per layer
    data = DataConfig(tokens_per_step=1024, curriculum=((0, 512),), text_fraction=0.0, copy_fraction=0.0)
    batch = make_batch(data, 3)
    rows = kl_rows(batch.kind, 48, torch.Generator().manual_seed(0))
    needle = Needle(batch.needle, torch.gather(batch.kind, 1, rows) == ANSWER)
    out = {}
    for impl in ("mask", "gather"):
        m = _model(seed=2)
        m.sparse_attention = impl
        h, aux = m.forward_train(batch.ids, sparse=True, kl_rows=rows, needle=needle)
        loss = h.square().mean() + sum(aux.indexer_kl) + sum(aux.indexer_needle)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        out[impl] = (h.detach(), torch.stack(aux.indexer_kl), torch.stack(aux.indexer_needle), grads)
    (h0, kl0, nl0, g0), (h1, kl1, nl1, g1) = out["mask"], out["gather"]
    assert m.cfg.index_topk < batch.ids.shape[1]  # the selection really drops keys
    torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kl1, kl0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(nl1, nl0, rtol=1e-4, atol=1e-6)
    assert g0.keys() == g1.keys() and any(".indexer." in n for n in g1)
    for n in g0:
        torch.testing.assert_close(
            g1[n], g0[n], rtol=1e-3, atol=1e-3 * float(g0[n].abs().max()) + 1e-9, msg=n
        )
    # the default picks by row length: the masked form up to _GATHER_FROM, the gathered one beyond
    auto = TrainCausalLM(m.cfg)
    assert auto.sparse_attention == "auto" and not auto._gathers(model_mod._GATHER_FROM)
    assert auto._gathers(model_mod._GATHER_FROM + 1)
    auto.sparse_attention = "bogus"
    with pytest.raises(ValueError):
        auto._gathers(512)


def test_shipped_wip_readme_names_the_weights_it_describes() -> None:
    """models-shipped/retrieval-wip/README.md quotes the sha256 of the model.safetensors beside it, so a
    re-shipped checkpoint cannot keep an older run's description."""
    import hashlib
    import re

    wip = ROOT / "models-shipped" / "retrieval-wip"
    quoted = re.findall(r"sha256 of model\.safetensors: ([0-9a-f]{64})", (wip / "README.md").read_text())
    assert quoted == [hashlib.sha256((wip / "model.safetensors").read_bytes()).hexdigest()]


def test_every_committed_checkpoint_has_its_weights() -> None:
    """Each checkpoint directory under models-shipped/ and models-candidates/ holds its model.safetensors
    (a fresh clone fails here if .gitignore keeps the weights out), and models-candidates/README.md
    quotes each candidate's sha256."""
    import hashlib
    import re

    dirs = [
        p.parent
        for top in ("models-shipped", "models-candidates")
        for p in (ROOT / top).glob("*/config.json")
    ]
    assert any(d.parent.name == "models-shipped" for d in dirs)
    for d in dirs:
        assert (d / "model.safetensors").is_file(), f"{d} has a config.json but no model.safetensors"
    readme = (ROOT / "models-candidates" / "README.md").read_text()
    for d in (x for x in dirs if x.parent.name == "models-candidates"):
        quoted = re.findall(rf"sha256 of {d.name}/model\.safetensors: ([0-9a-f]{{64}})", readme)
        assert quoted == [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()], d.name


def test_capitals_start_from_the_lowercase_letters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--capitals-from-lowercase: after --init-from, the embedding and lm_head rows of A-Z are those of a-z
    and every other row is the checkpoint's; without --init-from it is an error, not a silent no-op."""
    from longctx.train.loop import capitals_from_lowercase

    m = TrainCausalLM(ModelConfig.from_json(TINY))
    m.init_weights(0)
    emb, head = m.model.embed_tokens.weight.detach().clone(), m.lm_head.weight.detach().clone()
    capitals_from_lowercase(m)
    up, low = list(range(65, 91)), list(range(97, 123))
    for before, after in ((emb, m.model.embed_tokens.weight), (head, m.lm_head.weight)):
        assert torch.equal(after[up], before[low]) and not torch.equal(before[up], before[low])
        rest = [i for i in range(before.shape[0]) if i not in up]
        assert torch.equal(after[rest], before[rest])
    a = tmp_path / "a"
    args = ["--config", str(TINY), "--steps", "1", "--device", "cpu", "--tokens-per-step", "1024",
            "--curriculum", "0:512", "--dense-warmup-steps", "2", "--warmup-steps", "1", "--kl-rows", "16",
            "--save-dtype", "float32", "--eval-samples", "0"]  # fmt: skip
    assert main([*args, "--out", str(a)]) == 0
    b = tmp_path / "b"
    assert (
        main([*args, "--out", str(b), "--init-from", str(a), "--capitals-from-lowercase", "--lr", "1e-12"])
        == 0
    )
    from safetensors.torch import load_file

    w = load_file(str(b / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.allclose(w[up], w[low], atol=1e-6)  # (one step at lr 1e-12 moves nothing visible)
    assert main([*args, "--out", str(tmp_path / "c"), "--capitals-from-lowercase"]) != 0
    assert "--capitals-from-lowercase: needs --init-from" in capsys.readouterr().err
    # a resumed run keeps its own capitals: the flag is refused there, not silently ignored
    assert main([*args, "--out", str(tmp_path / "d"), "--resume", str(b), "--capitals-from-lowercase"]) != 0
    assert (
        "--capitals-from-lowercase: applies to --init-from only, not to a resumed run"
        in capsys.readouterr().err
    )
