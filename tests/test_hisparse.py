"""HiSparse through the real engine path on CPU: a small device cap gives the same logits and
greedy tokens as no cap, while tokens really are swapped in from the host pool."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from longctx import Engine

from .conftest import make_checkpoint, tiny_config

CAP = 24  # tiny.json: index_topk 16, so a decode query fits and prefill chunks overflow
KW = {"device": "cpu", "prefill_form": "absorbed", "chunk_size": 48, "kv_pages": 24}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hisparse"), tiny_config(), seed=3)


def _ids(n, seed):
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_stats(eng, cap=CAP):
    hs = eng.stats()["hisparse"]
    assert hs["misses"] > 0 and hs["swap_bytes"] > 0 and hs["hits"] > 0
    assert 0 < hs["device_tokens_max"] <= cap
    assert eng.stats()["host_pool_bytes"] > 0
    return hs


def _run(model_dir, prompts, score_ids, **kw):
    with Engine(model_dir, **KW, **kw) as eng:
        logits = eng.score(score_ids)
        outs = eng.generate(prompts, max_new_tokens=10, ignore_eos=True)
        stats = eng.stats()
    return logits, [o.token_ids for o in outs], stats


def test_capped_matches_uncapped_pp1(model_dir):
    prompts = [_ids(130, 1), _ids(70, 2), _ids(20, 3)]
    score_ids = _ids(150, 4)
    ref_logits, ref_tokens, _ = _run(model_dir, prompts, score_ids)
    with Engine(model_dir, **KW, hisparse_device_tokens=CAP) as eng:
        logits = eng.score(score_ids)
        assert _rel(logits, ref_logits) <= 1e-6
        outs = eng.generate(prompts, max_new_tokens=10, ignore_eos=True)
        assert [o.token_ids for o in outs] == ref_tokens
        _check_stats(eng)
        # finished requests handed their slots back
        assert eng.runner.worker.kv.stats()["hisparse"]["requests"] == 0
        # the prefix cache's pages are in the host pool already: a repeat reuses them exactly
        again = eng.generate([prompts[0]], max_new_tokens=10, ignore_eos=True)
        assert again[0].cached_tokens > 0 and again[0].token_ids == ref_tokens[0]


def test_default_prefill_form_agrees(model_dir):
    """Against the engine's default (expanded prefill where small) the absorbed HiSparse path agrees
    to rounding and gives the same greedy tokens."""
    ids = _ids(100, 5)
    with Engine(model_dir, device="cpu", kv_pages=24) as eng:
        ref = eng.score(ids)
        ref_tok = eng.generate([ids], max_new_tokens=8, ignore_eos=True)[0].token_ids
    with Engine(model_dir, device="cpu", kv_pages=24, hisparse_device_tokens=20) as eng:
        got = eng.score(ids)
        tok = eng.generate([ids], max_new_tokens=8, ignore_eos=True)[0].token_ids
        _check_stats(eng, 20)
    assert _rel(got, ref) <= 1e-4
    assert tok == ref_tok


def test_preemption_restarts_cleanly(model_dir):
    """Too few pages for both requests: one is preempted and recomputed; its stale residency
    must not leak into the recomputation."""
    prompts = [_ids(60, 6), _ids(60, 7)]
    kw = {**KW, "kv_pages": 3}
    with Engine(model_dir, **kw) as eng:
        ref = [o.token_ids for o in eng.generate(prompts, max_new_tokens=20, ignore_eos=True)]
    with Engine(model_dir, **kw, hisparse_device_tokens=CAP) as eng:
        got = [o.token_ids for o in eng.generate(prompts, max_new_tokens=20, ignore_eos=True)]
        assert eng.stats()["preempted"] > 0
        _check_stats(eng)
    assert got == ref


@pytest.mark.skipif(
    importlib.util.find_spec("longctx.stages.runtime") is None,
    reason="longctx/stages/runtime.py not written yet",
)
def test_capped_matches_uncapped_pp2(model_dir):
    prompts = [_ids(110, 8), _ids(40, 9)]
    score_ids = _ids(120, 10)
    ref_logits, ref_tokens, _ = _run(model_dir, prompts, score_ids, pp=2, max_context=200)
    logits, tokens, stats = _run(
        model_dir, prompts, score_ids, pp=2, hisparse_device_tokens=CAP, max_context=200
    )
    assert _rel(logits, ref_logits) <= 1e-6
    assert tokens == ref_tokens
    hs = stats["hisparse"]
    assert hs["misses"] > 0 and hs["swap_bytes"] > 0 and 0 < hs["device_tokens_max"] <= CAP
    # the stage processes size their per-request tables as the one-process engine does (up front, as
    # many requests as the pool holds at max_context: min(max_running 64, 24 pages x 64 // 200) = 7;
    # not the 2 that growing on demand would give)
    assert [st["hisparse"]["blocks"] for st in stats["stages"]] == [7, 7]


def test_preallocated_requests_never_exceed_what_the_pool_holds_at_max_context():
    from longctx.hisparse.cache import preallocated_requests

    # one 1M-token request capped at 10%: one block (ten would put the whole KV on the device again)
    assert preallocated_requests(64, (1 << 20) // 64 + 5, 64, 104_856, (1 << 20) + 32) == 1
    # a pool for many short requests: bounded by max_running, and by the pool at max_context
    assert preallocated_requests(8, 1000, 64, 300, 1000) == 8
    assert preallocated_requests(64, 1000, 64, 300, 1000) == 64
    assert preallocated_requests(64, 1000, 64, 300, 4000) == 16
    assert preallocated_requests(4, 10, 64, 300, 1 << 20) == 1
    assert preallocated_requests(64, 1000, 64, 300, None) == 1  # a request may take every page


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize(("kv_dtype", "skip"), [("fp8_e4m3", ()), ("bf16", ()), ("fp8_e4m3", (1, 4))])
def test_capped_matches_uncapped_in_the_cuda_kv_layouts(model_dir, kv_dtype, skip, pp):
    """The fp8 cache (CUDA's default: 656-byte-style rows, page-major fp8 index keys) and the bf16 one
    swap the same bytes in as they wrote out: capped logits and tokens equal uncapped ones in that dtype,
    in one process and over two pipeline stages; so does an fp8 cache that keeps layers 1 and 4 in the
    model dtype (host rows and slot buffers of two sizes in each stage)."""
    prompts = [_ids(110, 5), _ids(45, 6)]
    score_ids = _ids(140, 7)
    kw = {"kv_dtype": kv_dtype, "pp": pp, "max_context": 200, "kv_fp8_skip_layers": skip}
    ref_logits, ref_tokens, _ = _run(model_dir, prompts, score_ids, **kw)
    logits, tokens, stats = _run(model_dir, prompts, score_ids, hisparse_device_tokens=CAP, **kw)
    assert _rel(logits, ref_logits) <= 1e-6
    assert tokens == ref_tokens
    hs = stats["hisparse"]
    assert hs["misses"] > 0 and hs["swap_bytes"] > 0 and 0 < hs["device_tokens_max"] <= CAP
    assert stats["kv_kind"] == ("fp8" if kv_dtype == "fp8_e4m3" else "bf16")
    assert stats["kv_fp8_skip_layers"] == list(skip)


def test_capped_guided_decode_overlapped_with_launches_ahead(model_dir):
    """Guided rows under a device cap with overlapped decode and graphs: each step's forward is launched
    before the step before it is read (and the one after it right after its draw), while HiSparse binds and
    swaps their slots; the tokens equal the capped engine's one step at a time and the uncapped one's."""
    prompts = [_ids(130, 5), _ids(70, 6), _ids(40, 7)]
    kw = dict(max_new_tokens=12, temperature=0.8, seed=4, guided_regex="[a-z]{4,12}")
    want = None
    for cap, overlap in ((None, False), (CAP, False), (CAP, True)):
        extra = {"hisparse_device_tokens": cap} if cap else {}
        with Engine(model_dir, **KW, **extra, overlap=overlap, cuda_graphs=overlap) as eng:
            got = [o.token_ids for o in eng.generate(prompts, **kw)]
            if overlap:
                assert eng.stats()["launched_ahead"] > 0
                _check_stats(eng)
        want = got if want is None else want
        assert got == want, (cap, overlap)
    assert all(4 <= len(t) <= 12 for t in want)  # (whole matches of the guide)
