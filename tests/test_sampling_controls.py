"""logit_bias, min_tokens, min_p and stop_token_ids: the shaping against its reference, min_p's draws, the
scheduler's suppression rows, and the engine end to end (eager, overlapped with graphs, pp=2) and over HTTP."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from longctx import Engine
from longctx.engine.plan import RowPlan
from longctx.engine.request import MAX_LOGIT_BIAS, SamplingParams, find_stop
from longctx.engine.sampling import _MIX, _sample, _token_seed, sample_rows_device, shape_logits, shape_ref
from longctx.errors import RequestError
from tests.conftest import rand_ids, run_requests

VOCAB = 64


def _row(rid: str, **kw) -> RowPlan:
    return RowPlan(rid=rid, token_ids=(0,), start=0, pages=(), **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shaping_matches_the_reference(seed):
    """Rows with their own biases, suppressed tokens and allowed tokens (some rows none of them) equal
    `shape_ref` row by row; greedy and seeded draws pick only allowed tokens, never a suppressed one, and
    greedy picks the shaped argmax."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows = []
    for i in range(8):
        bias = tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), rng.randrange(0, 8)))
        sup = tuple(sorted(rng.sample(range(VOCAB), rng.randrange(0, 5))))
        allowed = tuple(rng.sample(range(VOCAB), rng.randrange(1, 12))) if i % 2 else ()
        rows.append(_row(f"r{i}", logit_bias=bias, suppress=sup, allowed=allowed))
    logits = torch.randn(len(rows), VOCAB, generator=g) * 4
    which = [i for i, r in enumerate(rows) if r.shaped]
    got = shape_logits(logits, rows, which)
    for i, r in enumerate(rows):
        want = shape_ref(logits[i], r.logit_bias, r.suppress, r.allowed) if r.shaped else logits[i]
        assert torch.equal(got[i], want.float()), i
    toks = sample_rows_device(logits, rows)
    for i, r in enumerate(rows):
        assert int(toks[i]) == int(got[i].argmax()) and int(toks[i]) not in r.suppress
        assert not r.allowed or int(toks[i]) in r.allowed
    hot = [dataclasses.replace(r, temperature=2.0, seed=k, step=k) for k, r in enumerate(rows)]
    for _ in range(5):
        toks = sample_rows_device(logits, hot).tolist()
        assert all(not r.allowed or t in r.allowed for r, t in zip(rows, toks))
        assert all(t not in r.suppress for r, t in zip(rows, toks))
        hot = [dataclasses.replace(r, step=r.step + 1) for r in hot]


def test_min_p_keeps_only_tokens_near_the_likeliest():
    """Seeded draws with min_p never pick a token under min_p x the top probability (after temperature);
    min_p 1 is greedy; min_p 0 draws what the sampler drew before it existed."""
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        logits = torch.randn(VOCAB, generator=g) * 2
        probs = torch.softmax(logits / 0.8, dim=-1)
        for step in range(30):
            t = int(_sample(logits, 0.8, 1.0, 0, trial, step, 0.3))
            assert probs[t] >= 0.3 * probs.max()
        assert int(_sample(logits, 0.8, 1.0, 0, trial, 0, 1.0)) == int(logits.argmax())
    x = torch.randn(VOCAB, generator=g)
    assert [int(_sample(x, 1.3, 0.9, 10, 3, s)) for s in range(20)] == [
        int(_sample(x, 1.3, 0.9, 10, 3, s, 0.0)) for s in range(20)
    ]


def test_extreme_controls_draw_a_token_instead_of_nan():
    """Values the API accepts but fp32 cannot hold: a temperature that overflows the scaled logits (greedy, as
    vLLM), a top_p that is 0 in fp32 (the likeliest token), and +inf logits from a tiny repetition penalty
    (one of those tokens). Each once raised in torch.multinomial, failing every request of the step."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(VOCAB, generator=g) * 3
    for t in (1e-45, 1e-300, 5e-6):
        assert int(_sample(logits, t, 1.0, 0, 1, 0)) == int(logits.argmax())
    assert int(_sample(logits, 1.0, 1e-320, 0, 1, 0)) == int(logits.argmax())
    inf = logits.clone()
    inf[[4, 9]] = float("inf")
    inf[7] = float("-inf")
    assert {int(_sample(inf, 1.0, 1.0, 0, 1, s)) for s in range(20)} <= {4, 9}
    assert int(_sample(inf, 0.7, 0.5, 3, 1, 0, 0.2)) in (4, 9)
    # every token suppressed (min_tokens with the whole vocabulary in stop_token_ids): some token
    assert 0 <= int(_sample(torch.full((VOCAB,), float("-inf")), 1.0, 0.9, 5, 1, 0, 0.1)) < VOCAB


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(min_tokens=17), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(logit_bias=((3, 101.0),)), r"bias must be in \[-100, 100\]"),
        (dict(logit_bias=((3, float("nan")),)), "bias must be"),
        (dict(logit_bias=((-2, 1.0),)), "non-negative"),
        (dict(logit_bias=((3, 1.0), (3, 2.0))), "twice"),
        (dict(logit_bias=tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))), "at most"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output 'yes': must be True or False"),
        (dict(allowed_token_ids=5), "allowed_token_ids: must be a list of token ids"),
        (dict(allowed_token_ids=tuple(range(MAX_LOGIT_BIAS + 1))), "at most"),
    ],
)
def test_bad_controls_are_rejected(kw, msg):
    with pytest.raises(RequestError, match=msg):
        dataclasses.replace(SamplingParams(max_new_tokens=16), **kw).validate()


def test_find_stop_ignores_matches_ending_within_the_floor():
    assert find_stop("ab.cd.ef", [".", "cd"]) == 2
    assert find_stop("ab.cd.ef", [".", "cd"], floor=3) == 3  # "." at 2 ends at 3: inside; "cd" ends after
    assert find_stop("ab.cd.ef", ["."], floor=3) == 5
    assert find_stop("ab.cd.ef", ["b.c"], floor=3) == 1  # begins inside, ends after: a match
    assert find_stop("ab.cd.ef", ["."], start=6) is None
    # include_stop_str_in_output: after the first stop string to complete
    assert find_stop("ab.cd.ef", [".", "cd"], include=True) == 3
    assert find_stop("ab.cd.ef", ["b.cd", "cd"], include=True) == 5  # two end together
    assert find_stop("xabcd", ["abcd", "bc"], include=True) == 4  # "bc" completes first
    assert find_stop("ab.cd.ef", ["."], floor=3, include=True) == 6
    assert find_stop("ab.cd.ef", ["zz"], include=True) is None


def test_logit_bias_steers_greedy_and_sampled_tokens(eng):
    p = rand_ids(30, 1)
    greedy = eng.generate([p], max_new_tokens=6, ignore_eos=True)[0].token_ids
    forced = eng.generate([p], max_new_tokens=6, ignore_eos=True, logit_bias={77: 100.0})[0].token_ids
    assert forced == [77] * 6
    banned = {t: -100.0 for t in set(greedy)}
    other = eng.generate([p], max_new_tokens=6, ignore_eos=True, logit_bias=banned)[0].token_ids
    assert not set(other) & set(greedy)
    sampled = eng.generate([p], max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True, logit_bias=banned)
    assert not set(sampled[0].token_ids) & set(greedy)
    # a biased request beside an unbiased one leaves the other's tokens alone
    both = eng.generate([p, p], max_new_tokens=6, ignore_eos=True, logit_bias={77: 100.0})
    assert [c.token_ids for c in both] == [forced, forced]


def test_per_request_bias_is_batch_independent(eng):
    p, q = rand_ids(25, 2), rand_ids(41, 3)
    alone = run_requests(eng, [q], [SamplingParams(max_new_tokens=8, ignore_eos=True)])
    got = run_requests(
        eng,
        [p, q],
        [
            SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias=((5, 100.0),)),
            SamplingParams(max_new_tokens=8, ignore_eos=True),
        ],
    )
    assert got[0][0] == [5] * 8 and got[1] == alone[0]


def test_extreme_sampling_values_do_not_fail_the_batch(eng):
    """A request with a temperature, top_p or repetition penalty at the edge of what validates, batched with
    an ordinary one: both finish with their tokens (a NaN draw used to fail the whole step)."""
    p, q = rand_ids(25, 5), rand_ids(41, 6)
    alone = run_requests(eng, [q], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
    for kw in (
        dict(temperature=1e-45),
        dict(temperature=1.0, top_p=1e-320),
        dict(temperature=1.0, repetition_penalty=1e-40),
    ):
        got = run_requests(
            eng,
            [p, q],
            [
                SamplingParams(max_new_tokens=6, ignore_eos=True, seed=0, **kw),  # type: ignore[arg-type]
                SamplingParams(max_new_tokens=6, ignore_eos=True),
            ],
        )
        assert got[1] == alone[0], kw
        assert len(got[0][0]) == 6 and got[0][1] == "length", kw
    everything = tuple(range(eng.cfg.vocab_size))  # (held back for 3 tokens, then the 4th stops it)
    got = run_requests(
        eng,
        [p, q],
        [
            SamplingParams(max_new_tokens=6, temperature=1.0, min_tokens=3, stop_token_ids=everything),
            SamplingParams(max_new_tokens=6, ignore_eos=True),
        ],
    )
    assert got[1] == alone[0] and len(got[0][0]) == 4 and got[0][1] == "stop", got


def _eos_first(eos: int, **kw) -> dict:
    """EOS pushed to the top of every step: without min_tokens the request stops at once."""
    return dict(max_new_tokens=10, logit_bias={eos: 100.0}, **kw)


def test_min_tokens_holds_back_eos_and_stop_tokens(eng):
    eos = eng.cfg.eos_ids()[0]
    p = rand_ids(20, 4)
    (c,) = eng.generate([p], **_eos_first(eos))
    assert c.token_ids == [eos] and c.finish_reason == "stop"
    (c,) = eng.generate([p], **_eos_first(eos, min_tokens=4))
    assert len(c.token_ids) == 5 and eos not in c.token_ids[:4] and c.token_ids[4] == eos
    assert c.finish_reason == "stop"
    (c,) = eng.generate([p], **_eos_first(eos, min_tokens=10))  # min_tokens == max_new_tokens
    assert len(c.token_ids) == 10 and eos not in c.token_ids and c.finish_reason == "length"
    # a stop token id likewise (EOS ignored)
    (c,) = eng.generate(
        [p], max_new_tokens=10, ignore_eos=True, stop=[99], logit_bias={99: 100.0}, min_tokens=3
    )
    assert c.token_ids[:3] != [99] * 3 and 99 not in c.token_ids[:3] and c.token_ids[3:] == [99]
    # ignore_eos: EOS is not held back (it ends nothing), only the stop tokens are
    (c,) = eng.generate([p], **_eos_first(eos, min_tokens=3, ignore_eos=True))
    assert c.token_ids == [eos] * 10


def test_min_tokens_holds_back_stop_strings(eng):
    """A stop string may not end within the first min_tokens tokens' text; the completion is cut at the
    first one that ends after it."""
    p = rand_ids(20, 5)
    a = ord("a")
    kw = dict(max_new_tokens=8, ignore_eos=True, logit_bias={a: 100.0})
    (c,) = eng.generate([p], stop=["a"], **kw)
    assert c.token_ids == [a] and c.text == "" and c.finish_reason == "stop"
    (c,) = eng.generate([p], stop=["a"], min_tokens=3, **kw)
    assert c.token_ids == [a] * 4 and c.text == "aaa" and c.finish_reason == "stop"
    (c,) = eng.generate([p], stop=["aa"], min_tokens=3, **kw)  # "aa" may begin inside and end after
    assert c.token_ids == [a] * 4 and c.text == "aa" and c.finish_reason == "stop"


def test_engine_rejects_out_of_vocabulary_controls(eng):
    with pytest.raises(RequestError, match="logit_bias: token id 5000 is outside"):
        eng.generate([rand_ids(10, 6)], max_new_tokens=2, logit_bias={5000: 1.0})
    with pytest.raises(RequestError, match="stop_token_ids: token id 999 is outside"):
        eng.generate([rand_ids(10, 6)], max_new_tokens=2, stop=[999])
    with pytest.raises(RequestError, match="allowed_token_ids: token id 320 is outside"):
        eng.generate([rand_ids(10, 6)], max_new_tokens=2, allowed_token_ids=[5, 320])
    eos = eng.cfg.eos_ids()[0]
    with pytest.raises(RequestError, match="allowed_token_ids: every allowed token ends the generation"):
        eng.generate([rand_ids(10, 6)], max_new_tokens=4, allowed_token_ids=[eos, 7], stop=[7], min_tokens=2)
    assert eng.generate([rand_ids(10, 6)], max_new_tokens=2)[0].token_ids  # (the engine goes on)


def test_min_p_one_is_greedy_through_the_engine(eng):
    p = rand_ids(33, 7)
    greedy = eng.generate([p], max_new_tokens=8, ignore_eos=True)[0].token_ids
    got = eng.generate([p], max_new_tokens=8, ignore_eos=True, temperature=1.5, seed=1, min_p=1.0)[
        0
    ].token_ids
    assert got == greedy


@pytest.mark.parametrize("graphs", [False, True])
def test_controls_with_overlapped_decode_graphs_and_stages(tiny_dir, eng, graphs):
    """Continuation rows (planned before step n's token is known) carry step n+1's suppression; the
    same tokens come out eager, overlapped with and without decode graphs, and over two stages."""
    eos = eng.cfg.eos_ids()[0]
    prompts = [rand_ids(n, 10 + n) for n in (7, 70, 5)]
    kw = _eos_first(eos, min_tokens=5, temperature=0.9, seed=4, min_p=0.05)
    want = [(c.token_ids, c.finish_reason) for c in eng.generate(prompts, **kw)]
    assert all(len(t) == 6 and t[-1] == eos for t, _ in want)
    with Engine(tiny_dir, device="cpu", overlap=True, cuda_graphs=graphs) as ov:
        got = [(c.token_ids, c.finish_reason) for c in ov.generate(prompts, **kw)]
        assert ov.stats()["overlapped_steps"] > 0
    assert got == want
    if graphs:
        with Engine(tiny_dir, device="cpu", kv_pages=16, chunk_size=29, pp=2) as e:
            assert [(c.token_ids, c.finish_reason) for c in e.generate(prompts, **kw)] == want


# ---- prompt logprobs (completions' echo) ----------------------------------------------------------


def _prompt_lps(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list]:
    """Every request's prompt logprobs as the step outputs report them, in order."""
    from longctx.engine.request import Request

    reqs = [Request(f"plp-{i}-{random.random()}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    got: dict[str, list] = {r.rid: [] for r in reqs}
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        for o in eng.step():
            if o.rid in got:
                got[o.rid].extend(o.prompt_logprobs)
    return [got[r.rid] for r in reqs]


def _check_against_score(eng: Engine, prompt: list[int], lps: list, n: int) -> None:
    ref = torch.log_softmax(eng.score(prompt), dim=-1)
    assert [x.token_id for x in lps] == prompt[1:]
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor([x.logprob for x in lps]), want, atol=1e-4)
    for i, x in enumerate(lps):
        assert len(x.top) == n
        # its rank: 1 + the tokens likelier than it (within score's 1e-4 of the engine's logprob)
        assert 1 + int((ref[i] > want[i] + 1e-4).sum()) <= x.rank <= 1 + int((ref[i] > want[i] - 1e-4).sum())
        v, ids = torch.topk(ref[i], n)
        assert [t for t, _ in x.top] == ids.tolist() and torch.allclose(
            torch.tensor([p for _, p in x.top]), v, atol=1e-4
        )


def test_prompt_logprobs_match_score_across_chunks_and_the_prefix_cache(eng):
    """Prompt logprobs (longer than a prefill chunk) equal `Engine.score`'s, with the top-n; a prompt whose
    pages are in the prefix cache is computed again (a cached position has no logits); max_new_tokens 0."""
    p = rand_ids(150, 20)  # (chunks of 29; 2 full pages cached by the first request)
    run_requests(eng, [p], [SamplingParams(max_new_tokens=2)])
    before = eng.stats()["prefix_cache"]["hit_tokens"]
    (lps,) = _prompt_lps(eng, [p], [SamplingParams(max_new_tokens=3, prompt_logprobs=2)])
    assert eng.stats()["prefix_cache"]["hit_tokens"] == before  # (computed again, not matched)
    _check_against_score(eng, p, lps, 2)
    assert any(x.rank > 1 for x in lps) and all(x.rank >= 1 for x in lps)
    run_requests(eng, [p], [SamplingParams(max_new_tokens=2)])
    assert eng.stats()["prefix_cache"]["hit_tokens"] > before  # (the pages were cached: a plain request hits)
    (lps0,) = _prompt_lps(eng, [p[:40]], [SamplingParams(max_new_tokens=0, prompt_logprobs=0)])
    _check_against_score(eng, p[:40], lps0, 0)
    (one,) = _prompt_lps(eng, [p[:1]], [SamplingParams(max_new_tokens=1, prompt_logprobs=1)])
    assert one == []


def test_prompt_logprobs_once_each_under_preemption_and_across_stages(tiny_dir, eng):
    prompts = [rand_ids(120, 30 + i) for i in range(4)]
    params = [
        SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=1 if i % 2 == 0 else None)
        for i in range(4)
    ]
    want = _prompt_lps(eng, prompts, params)
    with Engine(tiny_dir, device="cpu", kv_pages=10) as small:
        got = _prompt_lps(small, prompts, params)
        assert small.scheduler.num_preempted > 0
    with Engine(tiny_dir, device="cpu", kv_pages=16, chunk_size=29, pp=2) as e:
        staged = _prompt_lps(e, prompts, params)
    for w, g, s in zip(want, got, staged):
        assert [x.token_id for x in g] == [x.token_id for x in w] == [x.token_id for x in s]
        for a, b in ((g, w), (s, w)):
            assert torch.allclose(
                torch.tensor([x.logprob for x in a]), torch.tensor([x.logprob for x in b]), atol=1e-4
            )
    assert [len(w) for w in want] == [119, 0, 119, 0]


def test_bad_prompt_logprobs_are_rejected():
    with pytest.raises(RequestError, match="prompt_logprobs 21: must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21).validate()


def test_generate_returns_logprobs_and_prompt_logprobs(eng):
    """Engine.generate(logprobs=N, prompt_logprobs=N): one entry per generated token (the model's own
    distribution at that step, Engine.score's) and per prompt token after the first."""
    p = rand_ids(45, 40)
    (c,) = eng.generate([p], max_new_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    assert [x.token_id for x in c.logprobs] == c.token_ids and all(len(x.top) == 2 for x in c.logprobs)
    ref = torch.log_softmax(eng.score(p + c.token_ids), dim=-1)
    want = ref[torch.arange(len(p) - 1, len(p) + 4), torch.tensor(c.token_ids)]
    assert torch.allclose(torch.tensor([x.logprob for x in c.logprobs]), want, atol=1e-4)
    _check_against_score(eng, p, c.prompt_logprobs, 1)
    (plain,) = eng.generate([p], max_new_tokens=5, ignore_eos=True)
    assert plain.token_ids == c.token_ids and plain.logprobs == plain.prompt_logprobs == []


def test_prompt_logprobs_in_slices_of_positions(eng, monkeypatch):
    """A chunk's positions are scored a few at a time (PROMPT_LP_ROWS bounds the full-vocabulary logits
    held at once); the result is the same."""
    import longctx.engine.sampling as sampling

    monkeypatch.setattr(sampling, "PROMPT_LP_ROWS", 7)
    p = rand_ids(64, 50)
    for n in (0, 3):
        (lps,) = _prompt_lps(eng, [p], [SamplingParams(max_new_tokens=1, prompt_logprobs=n)])
        _check_against_score(eng, p, lps, n)


def test_every_bit_of_a_seed_counts_on_the_cpu() -> None:
    """torch's CPU generator keeps the low 32 bits of its seed: requests whose seeds were 2**32 apart drew
    the same tokens. Now they draw apart (a seed is taken modulo 2**63), and a seed below 2**32 draws what
    it drew before."""
    logits = torch.zeros(1000)

    def draws(seed: int) -> list[int]:
        return [int(_sample(logits, 1.0, 1.0, 0, seed, n)) for n in range(8)]

    for seed in (5, 2**40 + 5, 2**62):
        assert draws(seed) != draws(seed + 2**32)
    assert draws(2**63 + 5) == draws(5)
    for seed in (0, 5, 2**32 - 1):
        assert _token_seed(seed, 3) == (seed * 1_000_003 + 3 * _MIX) & (2**63 - 1)


def test_top_k_keeps_exactly_k_tokens_lower_ids_first_among_equals():
    """top_k 3 over equal logits draws only tokens 0-2 (the k likeliest, of equal logits the lower ids);
    over distinct logits only the three largest."""
    flat = torch.zeros(VOCAB)
    assert {int(_sample(flat, 1.0, 1.0, 3, 11, s)) for s in range(200)} == {0, 1, 2}
    x = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    top3 = set(torch.topk(x, 3).indices.tolist())
    assert {int(_sample(x, 5.0, 1.0, 3, 11, s)) for s in range(200)} == top3


def test_sampled_and_greedy_rows_of_one_batch():
    """Greedy rows keep their argmax, sampled rows draw what `draw_rows` draws for them alone, and
    different steps of one seed draw different tokens over a flat row."""
    from longctx.engine.sampling import draw_rows

    g = torch.Generator().manual_seed(9)
    rows = [
        _row("a"),
        _row("b", temperature=1.0, seed=5, step=0),
        _row("c", temperature=0.5, top_k=4, seed=6, step=2),
        _row("d", temperature=1e-6),
    ]
    logits = torch.randn(4, VOCAB, generator=g) * 3
    toks = sample_rows_device(logits, rows)
    assert int(toks[0]) == int(logits[0].argmax()) and int(toks[3]) == int(logits[3].argmax())
    for i in (1, 2):
        assert int(toks[i]) == int(draw_rows(logits[i : i + 1], [rows[i]])[0])
    flat = torch.zeros(1, VOCAB)
    drawn = {int(draw_rows(flat, [_row("e", temperature=1.0, seed=1, step=s)])[0]) for s in range(40)}
    assert len(drawn) > 20


def test_logprobs_of_several_rows_at_once_are_each_rows():
    """`logprobs_rows` (the step's logprob rows, one log-softmax and two reads) equals `logprobs_row` row by
    row, each row with its own top-n (0 included) and any subset of rows."""
    from longctx.engine.sampling import logprobs_row, logprobs_rows

    g = torch.Generator().manual_seed(12)
    logits = torch.randn(6, VOCAB, generator=g) * 3
    rows, ns = [0, 2, 3, 5], [0, 5, 1, 20]
    toks = [int(torch.randint(0, VOCAB, (1,), generator=g)) for _ in rows]
    got = logprobs_rows(logits, rows, toks, ns)
    for (lp, top), r, t, n in zip(got, rows, toks, ns):
        want_lp, want_top = logprobs_row(logits[r], t, n)
        assert abs(lp - want_lp) <= 1e-5 and [a for a, _ in top] == [a for a, _ in want_top]
        assert all(abs(b - c) <= 1e-5 for (_, b), (_, c) in zip(top, want_top)) and len(top) == n
    assert [top for _, top in logprobs_rows(logits, [1], [3], [0])] == [()]
