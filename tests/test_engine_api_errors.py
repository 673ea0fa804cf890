"""The Python API's bad input: a one-line RequestError / ConfigError naming the argument, raised before any
work, and nothing already in the engine disturbed (a bad request added while others run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longctx import Engine
from longctx.engine.request import Request, SamplingParams
from longctx.engine.sizing import resolve_device
from longctx.errors import ConfigError, RequestError
from tests.conftest import rand_ids


@pytest.mark.parametrize(
    "kw",
    [
        {"max_running": 0},  # (generate waited forever)
        {"max_running": -1},
        {"max_queue": 0},  # (every request was refused as a full queue)
        {"kv_pages": 0},  # (read as the default)
        {"kv_pages": 2.5},  # (failed in the pool's allocation)
        {"chunk_size": "8"},
        {"max_context": 1.5},
        {"max_context": None},
        {"pp": "1"},
        {"tp": 1.0},
        {"hisparse_device_tokens": "64"},
        {"prefill_form": "bogus"},  # (ran as "absorbed")
    ],
)
def test_bad_engine_arguments_are_refused_before_the_model_is_read(kw):
    name = next(iter(kw))
    with pytest.raises(ConfigError, match=name):  # (the model dir does not exist: nothing was read)
        Engine("/nonexistent/model", device="cpu", **kw)


def test_a_device_that_is_not_cpu_or_an_existing_gpu_is_refused(monkeypatch):
    for bad in ("meta", "mps"):  # (meta failed as a checkpoint missing every tensor; mps in the model build)
        with pytest.raises(ConfigError, match=f"device '{bad}': must be"):
            resolve_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="'cuda:3': there are 1 CUDA devices"):
        resolve_device("cuda:3")
    with pytest.raises(ConfigError, match="model_dir must be a path"):
        Engine(None, device="cpu")


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"top_k": True}, "top_k"),  # (these four failed inside the step)
        ({"logprobs": True}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "3"}, "seed"),
        ({"seed": -1}, "seed"),  # (drew what seed 2**63 - 1 does)
        ({"temperature": None}, "temperature"),  # (TypeErrors)
        ({"top_p": "0.9"}, "top_p"),
        ({"logit_bias": {5: 1.0, "6": 1.0}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"stop": 1.5}, "stop"),
        ({"stop": [None]}, "stop"),  # (dropped)
        ({"stop": [True]}, "stop"),  # (token 1)
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"allowed_token_ids": {5}}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": [5]}, "bad_words"),
    ],
)
def test_bad_sampling_arguments_are_request_errors(eng, kw, says):
    with pytest.raises(RequestError, match=says) as e:
        eng.generate([[1, 2, 3], [4, 5]], **{"max_new_tokens": 2, "temperature": 1.0, **kw})
    assert len(str(e.value).splitlines()) == 1
    assert eng.num_waiting() == eng.num_running() == 0


def test_sampling_params_are_checked_once_on_each_public_path(eng, monkeypatch):
    """generate and add_request refuse the same bad params with the same message, and each checks a
    request's params once (generate once for all its prompts): not again in add_request or the scheduler."""
    bad = SamplingParams(max_new_tokens=2, top_p=0.0)
    says = r"^top_p 0.0: must be in \(0, 1\]$"
    with pytest.raises(RequestError, match=says):
        eng.generate([[1, 2, 3]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(RequestError, match=says):
        eng.add_request(Request("bad", [1, 2, 3], bad))
    assert eng.num_waiting() == eng.num_running() == 0
    calls = []
    real = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: (calls.append(self), real(self))[1])
    eng.generate([[1, 2, 3], [4, 5], [6]], max_new_tokens=2, seed=1)
    assert len(calls) == 1
    eng.add_request(Request("one", [1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert len(calls) == 2
    while eng.has_work():
        eng.step()


def test_a_seed_past_the_http_servers_limit_is_taken(eng):
    """The server's seed + choice index (n > 1) may pass its own limit of 2**63 - 1: generators take a
    seed modulo 2**63, so the seed past it draws what seed 0 does."""
    kw = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    p = rand_ids(10, 64)
    got = eng.generate([p, p], seed=2**63 - 1, **kw)[1].token_ids
    assert got == eng.generate([p], seed=0, **kw)[0].token_ids


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda e: e.generate(None), "prompts must be a list"),
        (lambda e: e.generate([[1, 2], 3]), r"prompts\[1\] must be a list of token ids, got int"),
        (lambda e: e.generate([[1, 2.0]]), r"prompts\[0\]: token id 2.0 is not an integer"),
        (lambda e: e.generate([b"hi"]), r"prompts\[0\] must be a list of token ids, got bytes"),
        (lambda e: e.score(None), "token_ids must be a list of token ids"),
        (lambda e: e.score("hello"), "token_ids must be a list of token ids, got str"),
        (lambda e: e.score([[1, 2]]), r"token_ids: token id \[1, 2\] is not an integer"),
        (lambda e: e.generate([np.array(5)]), r"prompts\[0\] must be a list of token ids, got the single"),
    ],
)
def test_bad_prompts_are_request_errors(eng, call, says):
    with pytest.raises(RequestError, match=says):
        call(eng)
    assert eng.num_waiting() == eng.num_running() == 0


@pytest.mark.parametrize(
    "ids",
    [
        [True, 5],
        [5, False],
        np.array([True, False]),
        torch.tensor([5, 1]).bool(),
        [np.True_],
        [torch.tensor(True)],
    ],
)
def test_bool_token_ids_are_refused(eng, ids):
    """A bool is no token id, though Python's, numpy's and torch's all index as 0 / 1 (`[True, 5]` was
    read as the prompt [1, 5]); refused in prompts, score's ids, documents and add_request's prompt_ids."""
    for call, name in (
        (lambda: eng.generate([ids], max_new_tokens=1), r"prompts\[0\]"),
        (lambda: eng.score(ids), "token_ids"),
        (lambda: eng.pin_document(ids), "token_ids"),
    ):
        with pytest.raises(RequestError, match=rf"^{name}: token id .+ is a bool, not an integer$") as e:
            call()
        assert e.value.param == "prompt"
    with pytest.raises(RequestError, match=r"^token id True is a bool, not an int$") as e:
        eng.add_request(Request("b", [5, True, 6], SamplingParams(max_new_tokens=1)))
    assert e.value.param == "prompt"
    assert eng.num_waiting() == eng.num_running() == 0 and not eng.has_work()


def test_numpy_and_torch_token_ids_are_token_ids(eng):
    """(They were refused as "token id np.int64(1) is outside the vocabulary".)"""
    p = rand_ids(20, 60)
    want = eng.generate([p], max_new_tokens=3, ignore_eos=True)[0].token_ids
    for q in (np.array(p), torch.tensor(p), tuple(p)):
        assert eng.generate([q], max_new_tokens=3, ignore_eos=True)[0].token_ids == want
    assert torch.equal(eng.score(np.array(p)), eng.score(p))
    doc, n = eng.pin_document(t for t in p * 4)  # (a generator was read twice)
    assert n == 80
    eng.unpin_document(doc)


def test_a_bare_stop_string_is_one_stop_string(eng, monkeypatch):
    """As in vLLM and OpenAI's API (it was split into one stop string per character); a bare token id is
    one stop token. SamplingParams itself refuses a bare string."""
    seen = []
    real = eng._add
    monkeypatch.setattr(eng, "_add", lambda r: (seen.append(r.params), real(r)))
    eng.generate([[1, 2, 3]], max_new_tokens=1, stop="ab")
    eng.generate([[1, 2, 3]], max_new_tokens=1, stop=7)
    assert (seen[0].stop, seen[0].stop_token_ids, seen[1].stop, seen[1].stop_token_ids) == (
        ("ab",),
        (),
        (),
        (7,),
    )
    with pytest.raises(RequestError, match="not one string"):
        SamplingParams(stop="ab").validate()


def test_a_bad_request_added_while_others_run_leaves_them_intact(eng):
    """Requests that passed add_request before and failed inside a step (taking the running requests
    with it, or, for a tuple prompt, every later step) are refused by add_request; the running
    requests' tokens are those of a run without them."""
    a, b = rand_ids(40, 61), rand_ids(33, 62)
    kw = {"max_new_tokens": 8, "ignore_eos": True}
    bad = [
        Request("x1", [1, 2, 3], SamplingParams(temperature=1.0, top_k=True, **kw)),
        Request("x2", [1, 2, 3], SamplingParams(logprobs=True, **kw)),
        Request("x3", [1, 2, 3], SamplingParams(temperature=1.0, seed=1.5, **kw)),
        Request("x4", tuple(rand_ids(70, 63)), SamplingParams(**kw)),
        Request("x5", [1, 2, 3], SamplingParams(stop="ab", **kw)),
        Request("x6", [1, 2, 3], SamplingParams(stop_token_ids=(True,), **kw)),
        Request("a", [1, 2, 3], SamplingParams(**kw)),  # a duplicate id
        Request("x7", [1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos="no")),  # (taken as True)
        # (a TypeError in add_request; the last one after the scheduler had queued it: every later step failed)
        Request("x8", [1, 2, 3], SamplingParams(stop_token_ids=None, **kw)),
        Request("x9", [1, 2, 3], None),
        Request(["x10"], [1, 2, 3], SamplingParams(**kw)),
    ]

    def run(with_bad: bool) -> dict[str, list[int]]:
        eng.add_request(Request("a", list(a), SamplingParams(**kw)))
        eng.add_request(Request("b", list(b), SamplingParams(temperature=1.0, seed=3, **kw)))
        toks: dict[str, list[int]] = {"a": [], "b": []}
        steps = 0
        while eng.has_work():
            steps += 1
            if steps == 2 and with_bad:
                for r in bad:
                    with pytest.raises(RequestError):
                        eng.add_request(r)
            for o in eng.step():
                toks[o.rid].extend(o.new_token_ids)
                assert o.error is None
        return toks

    want = run(False)
    assert run(True) == want and len(want["a"]) == len(want["b"]) == 8


def test_generate_does_not_collide_with_a_step_api_request_id(eng):
    """A step-API request named like generate's own ("gen-N") made generate() fail as a duplicate id."""
    rid = f"gen-{next(eng._ids) + 1}"  # the id generate would take next
    eng.add_request(Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True)))
    assert len(eng.generate([[4, 5, 6]], max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2
    outs = [o for o in eng.step() if o.rid == rid]
    while eng.has_work():
        outs += [o for o in eng.step() if o.rid == rid]
    assert sum(len(o.new_token_ids) for o in outs) == 2 and outs[-1].finished


def test_dtypes_are_taken_by_their_short_names(tiny_dir):
    """`bf16`, `half`, `float`... were refused where `bfloat16` / `float16` / `float32` were taken; one table
    (longctx.config.DTYPE_ALIASES) reads them for dtype and for kv_dtype's bf16. An unknown name lists them."""
    for name, want in (("bf16", torch.bfloat16), ("FP16", torch.float16), ("half", torch.float16),
                       ("fp32", torch.float32), ("float", torch.float32)):  # fmt: skip
        with Engine(tiny_dir, device="cpu", dtype=name, kv_dtype="bfloat16", kv_pages=16) as e:
            assert (e.dtype, e.kv_kind) == (want, "bf16")
    with pytest.raises(
        ConfigError, match=r"^dtype 'bf8': must be one of auto, bfloat16, float16, float32 \(or bf16, "
    ):
        Engine(tiny_dir, device="cpu", dtype="bf8")
    with pytest.raises(ConfigError, match="^kv_dtype 'float16': must be"):
        Engine(tiny_dir, device="cpu", kv_dtype="float16")


def refuse_building(monkeypatch, what: str) -> None:
    """Make building the model or the stage processes fail the test: `what` must be refused first."""
    import longctx.engine.runner
    import longctx.stages.runtime

    def built(*a, **k):
        raise AssertionError(f"built before {what} was checked")

    monkeypatch.setattr(longctx.engine.runner, "build_model", built)
    monkeypatch.setattr(longctx.stages.runtime, "StageRuntime", built)


@pytest.mark.parametrize(
    "kw",
    [
        {"kv_pages": 10**12},  # (died in the pool's allocation, after the model was loaded)
        {"kv_pages": 10**12, "pp": 2},  # (each stage process died in its own)
        {"kv_pages": 10**12, "hisparse_device_tokens": 64},  # (its host pool: /dev/shm refused it, late)
        {"kv_pages": 64, "hisparse_device_tokens": 10**12},  # (its slot buffers: a traceback)
    ],
)
def test_a_kv_cache_the_machine_cannot_hold_is_refused_before_anything_is_built(tiny_dir, kw, monkeypatch):
    """One line naming kv_pages, what the bytes needed are made of and those available, before the model
    or a stage process is built."""
    refuse_building(monkeypatch, "the KV cache")
    with pytest.raises(ConfigError) as e:
        Engine(tiny_dir, device="cpu", **kw)
    msg = str(e.value)
    assert msg.startswith(f"kv_pages={kw['kv_pages']}") and "\n" not in msg
    assert ": the weights (" in msg and " GB) and the KV cache (" in msg
    assert " GB) need at least " in msg and " GB of memory, " in msg and msg.endswith(" GB available")
    if "hisparse_device_tokens" in kw:
        assert f"hisparse_device_tokens={kw['hisparse_device_tokens']}" in msg


@pytest.mark.parametrize(
    "kw", [{"hisparse_device_tokens": 16}, {"hisparse_device_tokens": 8, "index_topk": 8}]
)
def test_a_hisparse_cap_within_the_top_k_is_refused_before_anything_is_built(tiny_dir, kw, monkeypatch):
    """A cap the model's selection (tiny.json: top 16) rules out is a bad argument like the others: one line
    about hisparse_device_tokens before the model is read (the cache refused it once the weights were in)."""
    refuse_building(monkeypatch, "hisparse_device_tokens")
    with pytest.raises(ConfigError) as e:
        Engine(tiny_dir, device="cpu", **kw)
    n = kw["hisparse_device_tokens"]
    assert (
        str(e.value)
        == f"hisparse_device_tokens {n}: must be more than index_topk ({n}), the tokens a full layer selects"
    )


def _weight_bytes(model_dir, layers=None, itemsize=4, tp=1):
    from longctx.config import ModelConfig
    from longctx.model.params import loaded_weight_bytes

    cfg = ModelConfig.from_json(model_dir)
    layers = range(cfg.num_hidden_layers) if layers is None else layers
    return loaded_weight_bytes(cfg, layers, itemsize, False, tp)


def test_the_room_check_counts_the_weights_and_the_pool_it_allocates(tiny_dir, monkeypatch):
    """The bytes checked are the loaded weights', the device pool's own and the sampler's penalties pools
    at their largest for max_running requests: with exactly that much memory available the engine starts,
    with a byte less it is refused; a stage runtime's ranks each hold their share of the weights, their
    stage's pool and its host pool; without kv_pages the line says the model does not fit."""
    import longctx.engine.sizing as sizing

    with Engine(tiny_dir, device="cpu", kv_pages=40) as e:
        kv = e.stats()["stages"][0]["kv_bytes_device"]
        penalties = 3 * 64 * e.cfg.vocab_size * 5  # (int32 counts + uint8 prompt set, max_running 64)
    need = _weight_bytes(tiny_dir) + kv + penalties
    monkeypatch.setattr(sizing, "available_memory", lambda device=None: need - 1)
    with pytest.raises(
        ConfigError,
        match=rf"^kv_pages=40: the weights \(.+\) and the KV cache \(.+\) and the penalties' state of 64 "
        rf"requests \(.+\) need at least {need / 1e9:.1f} GB",
    ):
        Engine(tiny_dir, device="cpu", kv_pages=40)
    with pytest.raises(
        ConfigError, match=r"^the model does not fit: the weights \(.+\) and the default KV cache \(.+\) need"
    ):
        Engine(tiny_dir, device="cpu")
    monkeypatch.setattr(sizing, "available_memory", lambda device=None: need)
    Engine(tiny_dir, device="cpu", kv_pages=40).close()
    with pytest.raises(ConfigError, match="kv_pages=40"):  # 2 TP ranks' pools and a host pool
        Engine(tiny_dir, device="cpu", kv_pages=40, tp=2)


def test_weights_the_machine_cannot_hold_are_refused_before_any_is_read(tiny_dir, monkeypatch):
    """Weights alone past the available memory: refused in one line before a tensor is read (they died
    mid-load on a GPU with an out-of-memory traceback)."""
    import longctx.engine.sizing as sizing
    import longctx.engine.worker

    def read(*a, **k):
        raise AssertionError("a weight was read before the room check")

    monkeypatch.setattr(longctx.engine.worker, "iter_weights", read)
    weights = _weight_bytes(tiny_dir)
    monkeypatch.setattr(sizing, "available_memory", lambda device=None: weights - 1)
    with pytest.raises(
        ConfigError, match=r"^kv_pages=1: the weights \(.+\) and the KV cache .+ GB available$"
    ):
        Engine(tiny_dir, device="cpu", kv_pages=1)


def _check_room(e, num_pages, default, pp, tp, max_running):
    """The room check of an engine's `__init__`, on `e`'s model, device, dtype and KV kinds."""
    from longctx.engine.sizing import check_engine_room

    engine = {"max_context": e.max_context, "hisparse_device_tokens": e.hisparse_device_tokens}
    asked = {"num_pages": num_pages, "default": default, "pp": pp, "tp": tp, "max_running": max_running}
    check_engine_room(e.cfg, e.device, e.dtype, e.kv_kinds, **engine, **asked)


def _default_pages(e, max_context, pp=1, tp=1):
    """The KV pages an engine on `e`'s model, device, dtype and KV kinds allocates without kv_pages."""
    from longctx.engine.sizing import default_pages

    return default_pages(e.cfg, e.device, e.dtype, e.kv_kinds, max_context, pp, tp)


def test_the_room_check_on_cuda_counts_gpu_and_host_apart(tiny_dir, monkeypatch):
    """On CUDA the most loaded rank's weights and device pool (max_running 0: no penalties pools) are checked against the GPU's free memory
    (per GPU under pp or tp > 1: each stage its own layers' weights and pool, each TP rank its shard of
    the weights and the stage's whole pool), the host pools against the host's RAM. (Run on a CPU engine
    with its device and memory figures patched: CI has no GPU.)"""
    import longctx.engine.sizing as sizing
    from longctx.kv_kinds import kv_bytes_per_token
    from longctx.stages.runtime import stage_layers

    with Engine(tiny_dir, device="cpu", kv_pages=40) as e:
        kv = e.stats()["stages"][0]["kv_bytes_device"]
        need = _weight_bytes(tiny_dir) + kv
        monkeypatch.setattr(e, "device", torch.device("cuda", 0))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        free = {"cuda": need, "cpu": 10 * need}
        monkeypatch.setattr(
            sizing, "available_memory", lambda device=None: free[getattr(device, "type", "cpu")]
        )
        _check_room(e, 40, False, 1, 1, 0)  # no host pool: all of it on the GPU
        # the last stage's GPU holds the sampler's penalties pools too (max_running requests' at their largest)
        with pytest.raises(ConfigError, match=r"and the penalties' state of 1 requests \(.+\) need at least"):
            _check_room(e, 40, False, 1, 1, 1)
        free["cuda"] = need - 1
        with pytest.raises(
            ConfigError, match=r"^kv_pages=40: the weights .+ need at least .+ of GPU memory, "
        ):
            _check_room(e, 40, False, 1, 1, 0)
        # two stages: each GPU its stage's layers; the more loaded one decides
        (a, b), (c, d) = stage_layers(e.cfg, 2, 1, 40, 64, None)

        def stage(lo, hi, tp=1):
            mla, index = kv_bytes_per_token(e.cfg, range(lo, hi), e.kv_kinds, e.dtype)
            return _weight_bytes(tiny_dir, range(lo, hi), tp=tp) + 41 * 64 * (mla + index)

        free["cuda"] = max(stage(a, b), stage(c, d))
        assert free["cuda"] < need
        _check_room(e, 40, False, 2, 1, 0)
        free["cuda"] -= 1
        with pytest.raises(ConfigError, match=r"GPU memory per GPU"):
            _check_room(e, 40, False, 2, 1, 0)
        free["cuda"] = stage(0, e.cfg.num_hidden_layers, tp=2)  # two TP ranks: a shard of the weights each
        assert free["cuda"] < need
        _check_room(e, 40, False, 1, 2, 0)
        free["cuda"] -= 1
        with pytest.raises(ConfigError, match=r"GPU memory per GPU"):  # (and the whole pool on each)
            _check_room(e, 40, False, 1, 2, 0)
        free.update(cuda=need, cpu=0)
        _check_room(e, 40, False, 1, 1, 0)  # (one stage has no host pool)
        with pytest.raises(ConfigError, match=r"of host memory, 0.0 GB available$"):  # the stages' host pools
            _check_room(e, 40, False, 2, 1, 0)


def test_the_default_pages_on_cuda_leave_the_weights_their_room(tiny_dir, monkeypatch):
    """On CUDA the default pool takes half the free memory, and no more than 80% of what the weights leave:
    weights past half the GPU would otherwise have the room check refuse the default pool. (A CPU engine
    with its device and memory figures patched: CI has no GPU.)"""
    import longctx.engine.sizing as sizing
    from longctx.kvstore.pool import PagedKVPool

    with Engine(tiny_dir, device="cpu", kv_pages=40) as e:
        monkeypatch.setattr(e, "device", torch.device("cuda", 0))
        page = PagedKVPool.bytes_per_token(e.cfg, range(e.cfg.num_hidden_layers), e.kv_kinds, e.dtype) * 64
        weights = _weight_bytes(tiny_dir)
        assert weights > 20 * page  # (so that below, half the free memory is more than the weights leave)
        free = {"cuda": 0}
        monkeypatch.setattr(sizing, "available_memory", lambda device=None: free["cuda"])
        huge = 1 << 40  # (a max_context that does not cap the pages)
        free["cuda"] = 10 * weights + 1000 * page  # small weights: half the free memory
        assert _default_pages(e, huge) == free["cuda"] // 2 // page
        free["cuda"] = weights + 30 * page  # weights past half: what they leave, 80% of it
        assert _default_pages(e, huge) == int(30 * page * 0.8) // page == 24
        assert _default_pages(e, huge, pp=2) == free["cuda"] // 2 // page  # (a stage's half of them: half)
        free["cuda"] = weights  # nothing left: the floor of 16 pages, for the room check to refuse
        assert _default_pages(e, huge) == 16


@pytest.mark.parametrize(
    "call, says",
    [
        # (the tokenizer's TypeError "TextInputSequence must be str"; a command line's byte 0xff reads as
        # U+DCFF: `longctx generate $'\xff'` was a traceback)
        (lambda e: e.generate(["ab\udcffc"]), r"^the prompt is not valid Unicode: an unpaired surrogate "
         r"U\+DCFF \(byte 0xFF, not UTF-8\) at character 2$"),
        (lambda e: e.generate(["\ud800"]), r"^the prompt is not valid Unicode: an unpaired surrogate U\+D800 at"),
        (lambda e: e.encode("x\udfff"), "unpaired surrogate U\\+DFFF at character 1"),
        (lambda e: e.encode(None), "^a text prompt must be a string, got NoneType$"),
        (lambda e: e.encode(5), "^a text prompt must be a string, got int$"),
    ],
)  # fmt: skip
def test_a_text_that_is_not_valid_unicode_is_a_request_error(eng, call, says):
    with pytest.raises(RequestError, match=says) as e:
        call(eng)
    assert e.value.param == "prompt"
    assert eng.num_waiting() == eng.num_running() == 0


@pytest.mark.parametrize(
    "ids",
    [{5, 6, 7}, frozenset({5, 6}), {5: 1, 6: 2}, {5: 1}.keys(), bytearray(b"ab"), memoryview(b"ab")],
    ids=["set", "frozenset", "dict", "keys", "bytearray", "memoryview"],
)
def test_token_ids_in_no_order_or_as_bytes_are_refused(eng, ids):
    """A set or a dict of token ids has no order a prompt has, and a bytearray is bytes (refused as such):
    each was taken as a prompt, a set's tokens in hash order."""
    name = type(ids).__name__
    for call, where in (
        (lambda: eng.generate([ids], max_new_tokens=1), r"prompts\[0\]"),
        (lambda: eng.score(ids), "token_ids"),
        (lambda: eng.pin_document(ids), "token_ids"),
    ):
        with pytest.raises(RequestError, match=rf"^{where} must be a list of token ids, got {name}$"):
            call()
    assert eng.num_waiting() == eng.num_running() == 0 and not eng.has_work()


@pytest.mark.parametrize("value", ["no", None, 1, np.True_])
def test_ignore_eos_must_be_a_bool(eng, value):
    """("no" was read as True, None as False.)"""
    with pytest.raises(RequestError, match=rf"^ignore_eos {value!r}: must be True or False$"):
        eng.generate([[1, 2, 3]], max_new_tokens=2, ignore_eos=value)
    assert eng.num_waiting() == eng.num_running() == 0


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: None, "^add_request takes a Request, got NoneType$"),
        (lambda: ("r", [1, 2]), "^add_request takes a Request, got tuple$"),
        (lambda: Request(["r"], [1, 2], SamplingParams(max_new_tokens=2)), "^a request id must be a string, got list$"),
        (lambda: Request(7, [1, 2], SamplingParams(max_new_tokens=2)), "^a request id must be a string, got int$"),
        (lambda: Request("r", [1, 2], None), "^a request's params must be SamplingParams, got NoneType$"),
        (lambda: Request("r", [1, 2], {"max_new_tokens": 2}), "^a request's params must be SamplingParams, got dict$"),
        (lambda: Request("r", [1], SamplingParams(stop=None)), "^stop: must be a list of strings, got NoneType$"),
        (lambda: Request("r", [1], SamplingParams(stop_token_ids=5)), "^stop_token_ids: must be a list of token ids, got int$"),
        (lambda: Request("r", [1], SamplingParams(stop_token_ids=None)), "^stop_token_ids: must be a list of token ids"),
        (lambda: Request("r", [1], SamplingParams(logit_bias={5: 1.0})), "^logit_bias: must be a list of pairs, got dict$"),
        (lambda: Request("r", [1], SamplingParams(logit_bias=None)), "^logit_bias: must be a list of pairs, got NoneType$"),
        (lambda: Request("r", [1], SamplingParams(logit_bias=((5,),))), r"^logit_bias: must be \(token id, bias\) pairs, got \(5,\)$"),
        (lambda: Request("r", [1], SamplingParams(logit_bias=(5,))), r"^logit_bias: must be \(token id, bias\) pairs, got 5$"),
    ],
)  # fmt: skip
def test_a_malformed_step_api_request_is_a_request_error(eng, make, says):
    """add_request checks the request itself before the scheduler takes it (these were AttributeErrors,
    TypeErrors and a ValueError)."""
    with pytest.raises(RequestError, match=says):
        eng.add_request(make())
    assert eng.num_waiting() == eng.num_running() == 0 and not eng.has_work()


def test_a_request_id_that_is_not_a_string_leaves_the_running_requests_intact(eng):
    """A list as a request id was queued before add_request failed on it (an unhashable key), and every
    later step then failed with a TypeError: the running request never finished."""
    kw = {"max_new_tokens": 6, "ignore_eos": True}
    p = rand_ids(12, 64)
    want = eng.generate([p], **kw)[0].token_ids
    eng.add_request(Request("running", list(p), SamplingParams(**kw)))
    outs = eng.step()
    with pytest.raises(RequestError, match="a request id must be a string"):
        eng.add_request(Request(["bad"], [1, 2], SamplingParams(max_new_tokens=2)))
    while eng.has_work():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == want and outs[-1].finished
