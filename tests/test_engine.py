"""Engine behaviour on the tiny model: paths that must agree with each other, sampling, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx import Engine
from longctx.engine.request import Request, SamplingParams
from longctx.errors import RequestError
from tests.conftest import hf_greedy, hf_model, make_checkpoint, rand_ids, rel, tiny_config


def test_prefill_then_decode_equals_score(eng):
    prompt = rand_ids(50, 0)
    out = eng.generate([prompt], max_new_tokens=12, ignore_eos=True)[0]
    full = prompt + out.token_ids
    logits = eng.score(full)
    # every generated token is the argmax of the full-sequence logits at its previous position
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out.token_ids


def test_chunked_prefill_equals_one_chunk(tiny_dir):
    ids = rand_ids(90, 1)
    with (
        Engine(tiny_dir, device="cpu", chunk_size=13) as a,
        Engine(tiny_dir, device="cpu", chunk_size=4096) as b,
    ):
        la, lb = a.score(ids), b.score(ids)
    assert rel(la, lb) <= 1e-5


def test_batch_equals_alone(eng):
    prompts = [rand_ids(n, 10 + n) for n in (5, 64, 37, 100)]
    batch = eng.generate(prompts, max_new_tokens=10, ignore_eos=True)
    alone = [eng.generate([p], max_new_tokens=10, ignore_eos=True)[0] for p in prompts]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]


def test_one_prompt_given_bare_is_a_batch_of_one(eng):
    """A string or a token-id list alone is one prompt (SGLang's / vLLM's calling form): a list of one
    Completion, the same as the prompt in a list."""
    p = rand_ids(int(torch.randint(5, 60, ())), 4)
    one = eng.generate(p, max_new_tokens=5, ignore_eos=True)
    assert len(one) == 1
    assert one[0].token_ids == eng.generate([p], max_new_tokens=5, ignore_eos=True)[0].token_ids
    assert eng.generate(tuple(p), max_new_tokens=5, ignore_eos=True)[0].token_ids == one[0].token_ids
    assert eng.tokenizer is not None  # (the tiny checkpoint's byte-level tokenizer)
    text = eng.generate("The needle is", max_new_tokens=4, ignore_eos=True)
    assert len(text) == 1
    assert (
        text[0].token_ids == eng.generate(["The needle is"], max_new_tokens=4, ignore_eos=True)[0].token_ids
    )


def test_prefix_cache_reuse_gives_same_tokens(eng):
    doc = rand_ids(200, 3)
    a = eng.generate([doc + [1, 2, 3]], max_new_tokens=6, ignore_eos=True)[0]
    b = eng.generate([doc + [1, 2, 3]], max_new_tokens=6, ignore_eos=True)[0]
    assert b.cached_tokens >= 192
    assert a.token_ids == b.token_ids


def test_reset_prefix_cache_makes_the_next_prefill_cold(eng):
    """`reset_prefix_cache` (vLLM's): a repeated prompt hits the cache; after the reset it is prefilled again,
    with the same tokens. A pinned document's pages stay cached; the freed ones count as reset, not evicted."""
    prompt = rand_ids(200, 41)  # 3 full pages
    cold = eng.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
    before = eng.stats()["prefix_cache"]
    warm = eng.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
    assert warm.cached_tokens == 192
    assert eng.stats()["prefix_cache"]["hit_tokens"] - before["hit_tokens"] == 192
    doc, _ = eng.pin_document(rand_ids(150, 42))
    done = eng.reset_prefix_cache()
    st = eng.stats()
    cache = st["prefix_cache"]
    assert done["freed_pages"] >= 3 and cache["reset_pages"] - before["reset_pages"] == done["freed_pages"]
    assert cache["evicted_pages"] == before["evicted_pages"]
    # nothing runs: what is left is the document's pages, pinned
    assert done["kept_pages"] == cache["cached_pages"] == cache["pinned_pages"] == st["pages_used"] >= 2
    again = eng.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
    assert again.cached_tokens == 0 and cold.token_ids == warm.token_ids == again.token_ids
    eng.unpin_document(doc)


def test_reset_prefix_cache_keeps_a_running_requests_pages(eng):
    """A reset between two steps frees nothing a running request holds: its prompt's cached pages stay (kept),
    and it goes on to the tokens it gives alone; once it is done, they are freed."""
    prompt = rand_ids(200, 43)
    want = eng.generate([prompt], max_new_tokens=8, ignore_eos=True)[0].token_ids
    eng.reset_prefix_cache()
    eng.add_request(Request("reset-run", list(prompt), SamplingParams(max_new_tokens=8, ignore_eos=True)))
    got: list[int] = []
    while not got:  # its prefill ends: its 3 full prompt pages are cached and still its own
        got += [t for o in eng.step() if o.rid == "reset-run" for t in o.new_token_ids]
    done = eng.reset_prefix_cache()
    assert done["freed_pages"] == 0 and done["kept_pages"] >= 3
    finished = False
    while not finished:
        for o in eng.step():
            if o.rid == "reset-run":
                got += list(o.new_token_ids)
                finished = o.finished
    assert got == want
    assert eng.reset_prefix_cache()["freed_pages"] >= 3


def test_seeded_sampling_is_reproducible_and_batch_independent(eng):
    p = rand_ids(30, 4)
    kw = dict(max_new_tokens=12, temperature=1.3, top_p=0.9, top_k=50, ignore_eos=True)
    a = eng.generate([p], seed=7, **kw)[0].token_ids
    b = eng.generate([p], seed=7, **kw)[0].token_ids
    c = eng.generate([rand_ids(40, 5), p], seed=6, **kw)[1].token_ids  # second prompt gets seed 6 + 1
    d = eng.generate([p], seed=8, **kw)[0].token_ids
    assert a == b == c
    assert a != d


def test_top_k_one_is_greedy(eng):
    p = rand_ids(30, 6)
    greedy = eng.generate([p], max_new_tokens=8, ignore_eos=True)[0].token_ids
    topk1 = eng.generate([p], max_new_tokens=8, temperature=5.0, top_k=1, seed=3, ignore_eos=True)[
        0
    ].token_ids
    assert greedy == topk1


def test_stop_tokens_and_strings(eng):
    p = rand_ids(30, 7)
    free = eng.generate([p], max_new_tokens=10, ignore_eos=True)[0].token_ids
    stop_tok = free[4]
    out = eng.generate([p], max_new_tokens=10, stop=[stop_tok], ignore_eos=True)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: free.index(stop_tok) + 1]
    text = eng.tokenizer.decode(free)
    if len(text) > 3:
        s = text[2:4]
        out = eng.generate([p], max_new_tokens=10, stop=[s], ignore_eos=True)[0]
        assert out.finish_reason == "stop" and s not in out.text
        kept = eng.generate(
            [p], max_new_tokens=10, stop=[s], ignore_eos=True, include_stop_str_in_output=True
        )[0]
        assert kept.token_ids == out.token_ids and kept.text == out.text + s


def test_bad_words_are_never_generated(eng):
    """vLLM's bad_words: a word the free greedy output holds is not generated; the output is the free one
    up to the token that would complete the word (byte-level: one token per ASCII character), then differs
    there; a one-token word is never drawn at all. (The output is kept to five letters, so it is ASCII.)"""
    p = rand_ids(30, 11)
    kw = dict(max_new_tokens=12, ignore_eos=True, allowed_token_ids=[97, 98, 99, 100, 101])
    free = eng.generate([p], **kw)[0]
    text = free.text
    assert len(text) == len(free.token_ids) == 12, text  # (text positions are tokens)
    word = text[2:5]
    i = text.index(word)  # (its first place: the output differs from the free one there)
    got = eng.generate([p], **kw, bad_words=[word])[0]
    assert word not in got.text
    assert got.token_ids[: i + 2] == free.token_ids[: i + 2] and got.token_ids[i + 2] != free.token_ids[i + 2]
    one = eng.generate([p], **kw, bad_words=[text[0]])[0]
    assert text[0] not in one.text


def test_string_prompts_round_trip(eng):
    out = eng.generate(["hello wörld"], max_new_tokens=4, ignore_eos=True)[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)


@pytest.mark.parametrize("pp", [1, 2])
def test_index_topk_override_is_a_checkpoint_with_that_topk(tmp_path, pp):
    """Engine(index_topk=K) scores exactly as the same weights saved with index_topk K, in one process
    and across pipeline stages (the override reaches every stage), and differs from the checkpoint's own
    top-k once the prompt is longer than K; a bad K is refused."""
    from longctx.errors import ConfigError

    own = tiny_config()
    a = make_checkpoint(tmp_path / "a", own, seed=3)
    b = make_checkpoint(tmp_path / "b", dataclasses.replace(own, index_topk=8), seed=3)
    ids = rand_ids(70, 4)
    with Engine(a, device="cpu", index_topk=8, pp=pp) as e:
        assert e.config.index_topk == 8
        got = e.score(ids)
    with Engine(b, device="cpu") as e:
        want = e.score(ids)
    with Engine(a, device="cpu") as e:
        plain = e.score(ids)
    assert own.index_topk > 8 and rel(got, want) <= 1e-6 and rel(plain, want) > 1e-3
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ConfigError, match="index_topk"):
            Engine(a, device="cpu", index_topk=bad)


def test_bad_requests_are_rejected_cleanly(eng):
    with pytest.raises(RequestError):
        eng.generate([[]], max_new_tokens=2)
    with pytest.raises(RequestError):
        eng.generate([[1, 2, 10**6]], max_new_tokens=2)
    with pytest.raises(RequestError):
        eng.generate([[1, 2]], max_new_tokens=-1)
    with pytest.raises(RequestError):
        eng.generate([[1, 2]], temperature=-1.0)
    with pytest.raises(RequestError):
        eng.add_request(Request("x", [1] * 10, SamplingParams(top_p=0.0)))
    # the engine still works afterwards and holds no leaked pages
    assert len(eng.generate([[5, 6, 7]], max_new_tokens=3)[0].token_ids) <= 3
    assert eng.stats()["running"] == 0


def test_a_failed_blocking_call_leaves_nothing_behind(eng, monkeypatch):
    """generate() that raises (its second prompt rejected; a step failing mid-prefill) aborts its own
    requests: none stays queued, running or holding pages, and the next call answers as before."""
    a, b = rand_ids(45, 40), rand_ids(33, 41)
    want = eng.generate([a, b], max_new_tokens=6, ignore_eos=True)
    used = eng.stats()["pages_used"]
    with pytest.raises(RequestError, match="vocab"):
        eng.generate([a, [1, 2, 10**6]], max_new_tokens=6)
    assert eng.num_waiting() == eng.num_running() == 0

    real, calls = eng._step, []

    def failing_second_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("step failed")
        return real()

    monkeypatch.setattr(eng, "_step", failing_second_step)
    with pytest.raises(RuntimeError, match="step failed"):
        eng.generate([a, b], max_new_tokens=6, ignore_eos=True)
    monkeypatch.undo()
    assert len(calls) == 2 and eng.num_waiting() == eng.num_running() == 0
    assert eng.stats()["pages_used"] <= used and not eng._held
    got = eng.generate([a, b], max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_a_request_failing_after_its_step_fails_alone(eng, monkeypatch):
    """A request whose post-step work raises (its stop-string check) finishes with an error; the other
    requests of the same step go on to their normal end, and its pages and state are released."""
    a, b = rand_ids(30, 50), rand_ids(25, 51)
    want = eng.generate([a], max_new_tokens=8, ignore_eos=True)[0].token_ids
    used = eng.stats()["pages_used"]
    real = eng._apply_stop_strings

    def check(out):
        if out.rid == "bad" and out.new_token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(out)

    monkeypatch.setattr(eng, "_apply_stop_strings", check)
    eng.add_request(Request("good", list(a), SamplingParams(max_new_tokens=8, ignore_eos=True)))
    eng.add_request(Request("bad", list(b), SamplingParams(max_new_tokens=8, ignore_eos=True)))
    toks: dict[str, list[int]] = {"good": [], "bad": []}
    ends = {}
    while eng.has_work():
        for o in eng.step():
            toks[o.rid].extend(o.new_token_ids)
            if o.finished:
                ends[o.rid] = (o.finish_reason, o.error)
    assert ends["bad"][0] == "error" and "UnicodeDecodeError" in ends["bad"][1]
    assert ends["good"] == ("length", None) and toks["good"] == want
    assert eng.num_waiting() == eng.num_running() == 0 and not eng._requests
    assert eng.stats()["pages_used"] == used  # (the prompts' full pages stay in the prefix cache)


def test_fail_step_aborts_the_running_requests_and_keeps_the_waiting_ones(tiny_dir):
    """A step that raises: `fail_step` aborts what it held (the running requests) and returns their
    ids; a request that was waiting then runs to the same tokens as alone, and no page is leaked."""
    a, b = rand_ids(30, 60), rand_ids(40, 61)
    with Engine(tiny_dir, device="cpu", max_running=1) as e:
        want = e.generate([b], max_new_tokens=6, ignore_eos=True)[0].token_ids
        used = e.stats()["pages_used"]
        e.add_request(Request("running", list(a), SamplingParams(max_new_tokens=20, ignore_eos=True)))
        e.step()
        e.add_request(Request("waiting", list(b), SamplingParams(max_new_tokens=6, ignore_eos=True)))
        e.step()
        assert e.num_running() == 1 and e.num_waiting() == 1
        real = e.runner.run if not e.overlap else e.runner.launch
        name = "launch" if e.overlap else "run"
        setattr(e.runner, name, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken batch")))
        with pytest.raises(RuntimeError, match="broken batch"):
            e.step()
        setattr(e.runner, name, real)
        assert e.fail_step() == ["running"]
        assert e.num_running() == 0 and e.num_waiting() == 1
        got: list[int] = []
        while e.has_work():
            for o in e.step():
                assert o.rid == "waiting"
                got.extend(o.new_token_ids)
        assert got == want
        assert e.stats()["pages_used"] == used


def test_a_long_prefill_leaves_room_for_a_new_request(tiny_dir):
    """A request arriving during a long prefill is admitted beside it (the prefill takes half the
    step's budget until it is the only one): its first token comes long before the long prompt is
    done, and both give the tokens they give alone."""
    long_p, short_p = rand_ids(600, 70), rand_ids(20, 71)
    with Engine(tiny_dir, device="cpu", chunk_size=64) as e:
        want = {
            "long": e.generate([long_p], max_new_tokens=3, ignore_eos=True)[0].token_ids,
            "short": e.generate([short_p], max_new_tokens=3, ignore_eos=True)[0].token_ids,
        }
    with Engine(tiny_dir, device="cpu", chunk_size=64) as e:  # (nothing cached)
        e.add_request(Request("long", list(long_p), SamplingParams(max_new_tokens=3, ignore_eos=True)))
        assert e.step() and e.num_running() == 1
        e.add_request(Request("short", list(short_p), SamplingParams(max_new_tokens=3, ignore_eos=True)))
        got: dict[str, list[int]] = {"long": [], "short": []}
        first: dict[str, int] = {}
        steps = 0
        while e.has_work():
            steps += 1
            for o in e.step():
                got[o.rid].extend(o.new_token_ids)
                if o.new_token_ids and o.rid not in first:
                    first[o.rid] = steps
        assert got == want
        assert first["short"] <= 2 < first["long"], first


def test_prompt_longer_than_max_context(tiny_dir):
    with Engine(tiny_dir, device="cpu", max_context=64) as e:
        with pytest.raises(RequestError, match="maximum context"):
            e.generate([list(range(65))], max_new_tokens=1)
        out = e.generate([rand_ids(60, 8)], max_new_tokens=10, ignore_eos=True)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_preemption_under_page_pressure_keeps_results(tiny_dir):
    prompts = [rand_ids(120, 20 + i) for i in range(4)]
    with Engine(tiny_dir, device="cpu", kv_pages=1024) as big:
        want = [c.token_ids for c in big.generate(prompts, max_new_tokens=70, ignore_eos=True)]
    with Engine(tiny_dir, device="cpu", kv_pages=10) as small:  # 640 tokens for 4 x 190
        got = [c.token_ids for c in small.generate(prompts, max_new_tokens=70, ignore_eos=True)]
        assert small.scheduler.num_preempted > 0
        assert small.stats()["pages_used"] == small.prefix_cache.num_cached_pages
    assert got == want


def test_quantised_kv_within_tolerance(tmp_path):
    """fp8 / bf16 KV against the exact KV on the same prompts.

    Measured on a smooth model (dense MLPs, index_topk >= the prompt, so no discrete choice can
    flip): with MoE routing and a real top-k, a perturbation of any size can flip an expert or a
    selected token and move a logit arbitrarily, which says nothing about the KV format.
    e4m3 keeps 3 mantissa bits (<= 2^-4 relative per element); here that moves the logits by
    ~5-7% of their range (measured), bf16 by ~0.5%.
    """
    cfg = tiny_config(index_topk=128, mlp_layer_types=("dense",) * 6)
    d = make_checkpoint(tmp_path / "smooth", cfg, seed=2)
    with (
        Engine(d, device="cpu") as exact,
        Engine(d, device="cpu", kv_dtype="fp8_e4m3") as fp8,
        Engine(d, device="cpu", kv_dtype="bf16") as bf16,
    ):
        for seed in (0, 1):
            ids = rand_ids(120, seed)
            a, b, c = exact.score(ids), fp8.score(ids), bf16.score(ids)
            assert rel(b, a) <= 0.12
            assert float((a - b).abs().mean() / a.abs().mean()) <= 0.08
            assert rel(c, a) <= 0.015
            assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85
        assert fp8.stats()["kv_kind"] == "fp8"


def test_deepseek_v32_matches_reference(tmp_path):
    cfg = dataclasses.replace(
        tiny_config(num_hidden_layers=3),
        model_type="deepseek_v32",
        indexer_types=("full",) * 3,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    d = make_checkpoint(tmp_path / "ds", cfg, seed=5)
    ref = hf_model(d)
    assert type(ref).__name__ == "DeepseekV32ForCausalLM"
    ids = rand_ids(80, 10)
    with Engine(d, device="cpu", chunk_size=33) as e:
        got = e.score(ids)
        out = e.generate([ids[:30]], max_new_tokens=10, ignore_eos=True)[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert rel(got, want) <= 1e-3
    assert out.token_ids == hf_greedy(ref, ids[:30], 10)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_prefill_forms_match_reference(tiny_dir, form):
    ids = rand_ids(70, 11)
    ref = hf_model(tiny_dir)
    with Engine(tiny_dir, device="cpu", prefill_form=form, chunk_size=31) as e:
        got = e.score(ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert rel(got, want) <= 1e-3


def test_blocking_calls_keep_step_api_outputs(eng):
    """generate() / pin_document() step the engine; a step-API request in flight loses nothing."""
    prompt = rand_ids(40, 30)
    want = eng.generate([prompt], max_new_tokens=8, ignore_eos=True)[0].token_ids
    eng.add_request(Request("served", list(prompt), SamplingParams(max_new_tokens=8, ignore_eos=True)))
    eng.step()  # the served request starts
    eng.generate([rand_ids(20, 31)], max_new_tokens=5, ignore_eos=True)
    doc, n = eng.pin_document(rand_ids(150, 32))
    got: list[int] = []
    finished = False
    for _ in range(50):
        for o in eng.step():
            if o.rid == "served":
                got += list(o.new_token_ids)
                finished = finished or o.finished
        if finished:
            break
    assert finished and got == want
    assert n == 150 and eng.stats()["prefix_cache"]["pinned_pages"] >= 2
    eng.unpin_document(doc)


@pytest.mark.parametrize("hisparse", [None, 64])
def test_a_prompt_is_shared_as_soon_as_it_is_prefilled(tiny_dir, hisparse):
    """A prompt's full pages enter the prefix cache when its prefill ends, not when the request does:
    the same prompt arriving while the first request still decodes reuses them (a request's n
    choices, a second question on an unpinned document), with the same tokens; an abort after the
    prefill leaves them cached and evictable, nothing held."""
    prompt = rand_ids(200, 40)
    with Engine(tiny_dir, device="cpu", chunk_size=64, hisparse_device_tokens=hisparse) as e:
        want = e.generate([prompt], max_new_tokens=5, ignore_eos=True)[0].token_ids
        e.prefix_cache.evict(10**6)
        assert e.stats()["pages_used"] == 0
        e.add_request(Request("a", list(prompt), SamplingParams(max_new_tokens=40, ignore_eos=True)))
        while not any(o.rid == "a" and o.new_token_ids for o in e.step()):
            pass
        e.add_request(Request("b", list(prompt), SamplingParams(max_new_tokens=5, ignore_eos=True)))
        got: list[int] = []
        cached = 0
        while len(got) < 5:
            for o in e.step():
                if o.rid == "b":
                    got += list(o.new_token_ids)
                    cached = max(cached, o.cached_tokens)
        assert cached == 192 and got == want
        e.abort("a")
        assert e.stats()["pages_used"] == e.prefix_cache.num_cached_pages == 3
