"""The HiSparse-capped decode step through `DecodeGraphs` (static buffers, padding rows, block ids
bound before each replay), run without capture on CPU: it must give the eager capped path's tokens
and logits while requests join and finish (blocks reused, buffers grown), and the region a CUDA
graph would capture must make no host sync and no host-made tensor."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from longctx import Engine
from longctx.engine.cuda_graph import DecodeGraphs
from longctx.engine.request import Request, SamplingParams

from .conftest import make_checkpoint, tiny_config
from .overlap_helpers import InlineSide

CAP = 24  # tiny.json: index_topk 16, so a decode query fits and prefill chunks overflow
KW = {"device": "cpu", "prefill_form": "absorbed", "chunk_size": 48, "kv_pages": 24}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hisparse-graphs"), tiny_config(), seed=3)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# (step at which it is added, prompt length, new tokens): requests join while others decode, finish
# at different steps, and later ones take the blocks earlier ones gave back
_SCHEDULE = [(0, 130, 20), (0, 20, 16), (6, 70, 14), (10, 40, 18), (20, 90, 12), (26, 25, 14), (34, 60, 10)]


def _drive(eng: Engine, max_running: int) -> tuple[dict[str, list[int]], dict[tuple[str, int], torch.Tensor]]:
    """Run the schedule through the step API; returns tokens per request and the logits each
    sampling row was given, by (request, position)."""
    eng.scheduler.max_running = max_running
    worker = eng.runner.worker
    logits: dict[tuple[str, int], torch.Tensor] = {}
    finish = worker.finish_async

    def spy(plan, h, last_logits=None, sample=True):  # type: ignore[no-untyped-def]
        p = finish(plan, h, last_logits, sample=sample)
        for j, i in enumerate(p.last):
            r = plan.rows[i]
            logits[(r.rid, r.end)] = p.last_logits[j].clone()
        return p

    worker.finish_async = spy
    tokens: dict[str, list[int]] = {}
    step = 0
    todo = list(enumerate(_SCHEDULE))
    while todo or eng.has_work():
        while todo and todo[0][1][0] <= step:
            i, (_, n, new) = todo.pop(0)
            rid = f"r{i}"
            eng.add_request(Request(rid, _ids(n, i), SamplingParams(max_new_tokens=new, ignore_eos=True)))
        for out in eng.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        step += 1
    return tokens, logits


@pytest.mark.parametrize("kinds", [{}, {"kv_dtype": "fp8_e4m3", "kv_fp8_skip_layers": (1, 4)}])
def test_capped_graph_path_matches_eager(model_dir, kinds):
    """(also with an fp8 cache that keeps layers 1 and 4 in the model dtype: slot buffers of two sizes; the
    static path's fp32 differs from eager's in the last bits, ~1e-6 of the logits, and where that moves a
    value across an e4m3 rounding step the fp8 rows written differ: up to ~4e-5 measured, the same tokens)"""
    tol = 2e-4 if kinds else 1e-5
    with Engine(model_dir, **KW, **kinds, hisparse_device_tokens=CAP) as eng:
        assert eng.runner.graphs is None
        want, want_logits = _drive(eng, 3)
    with Engine(model_dir, **KW, **kinds) as eng:
        uncapped, _ = _drive(eng, 3)
    assert want == uncapped
    # one block allocated at start: the second concurrent request grows the buffers mid-run, which
    # must drop the decode graphs made over the old ones
    with Engine(model_dir, **KW, **kinds, hisparse_device_tokens=CAP, cuda_graphs=True, max_running=1) as eng:
        graphs = eng.runner.graphs
        assert isinstance(graphs, DecodeGraphs) and not graphs.capture
        kv = eng.runner.worker.kv
        assert kv.stats()["hisparse"]["blocks"] == 1
        got, got_logits = _drive(eng, 3)
        hs = kv.stats()["hisparse"]
        assert graphs.replays >= 30
        assert {b for b, _ in graphs._graphs} >= {2, 4}  # 3 rows -> bucket 4 with a padding row
        assert hs["blocks"] < len(_SCHEDULE) and hs["requests"] == 0  # blocks were reused
        assert graphs.recaptures >= 1
        assert hs["misses"] > 0 and 0 < hs["device_tokens_max"] <= CAP
    assert got == want
    assert got_logits.keys() == want_logits.keys()
    for k, v in want_logits.items():
        assert torch.allclose(got_logits[k], v, rtol=tol, atol=tol), k
    # with the layers' side-stream forks (run in place): under HiSparse the MLA row write stays on the main
    # stream, so a step forks once per full indexer layer and once per MoE layer with shared experts
    with Engine(model_dir, **KW, **kinds, hisparse_device_tokens=CAP, cuda_graphs=True, max_running=1) as eng:
        graphs = eng.runner.graphs
        graphs.side = side = InlineSide()
        forked, _ = _drive(eng, 3)
        cfg = eng.runner.worker.model.cfg
        per_step = sum(
            cfg.is_full_indexer(i) + (cfg.is_moe(i) and cfg.n_shared_experts > 0) for i in range(6)
        )
        assert cfg.num_hidden_layers == 6 and per_step >= 2
        assert side.forks == side.joins == per_step * graphs.replays > 0 and not side.open
    assert forked == want


def test_capped_decode_step_is_graph_safe(model_dir):
    """The whole capped decode step that DecodeGraphs captures (every layer, HiSparse placement and
    swap-in, the lm_head), on the Triton path (interpreted), passes the graph-safety audit of
    tests/test_kernels_graph_safe.py: no host read, no host-made tensor, no data-dependent shape."""
    from longctx.kernels.common import HAS_TRITON, triton_interpret

    from .test_kernels_graph_safe import _audit

    if not (HAS_TRITON and triton_interpret()):
        pytest.skip("needs TRITON_INTERPRET=1")
    with Engine(model_dir, **KW, backend="triton", hisparse_device_tokens=CAP, cuda_graphs=True) as eng:
        graphs = eng.runner.graphs
        forward = graphs._forward
        bad: Counter[str] = Counter()
        audited = 0

        def spy(c):  # type: ignore[no-untyped-def]
            nonlocal audited
            out = []
            bad.update(_audit(lambda: out.append(forward(c))))
            audited += 1
            return out[0]

        graphs._forward = spy
        # batch 3: bucket 4, one padding row; contexts past CAP, so decode steps evict and swap in
        prompts = [_ids(40, 1), _ids(30, 2), _ids(35, 3)]
        outs = eng.generate(prompts, max_new_tokens=3, ignore_eos=True)
        assert audited >= 2 and all(len(o.token_ids) == 3 for o in outs)
        assert eng.stats()["hisparse"]["misses"] > 0
    assert not bad, dict(bad)


class _FakeStream:
    """Stands for a CUDA stream on the CPU: records waits into the shared log. `reads` holds weak
    references to the memory the side stream's kernels were given; when the main stream joins the
    side one, each must still be alive: memory freed earlier goes back to the main stream's cache while
    the side stream may still read it, and inside a CUDA graph the main stream's next allocation can
    overwrite it (nothing orders the two streams before the join)."""

    def __init__(self, name: str, log: list[tuple[str, ...]], reads: list | None = None) -> None:
        self.name, self.log, self.reads = name, log, reads

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))
        if other.reads is not None and self.name == "main":
            freed = [what for what, ref in other.reads if ref.expired()]
            self.log.append(("freed before the join", *freed) if freed else ("alive at the join",))
            other.reads.clear()


def test_captured_step_forks_candidates_and_joins_before_the_first_placement(model_dir, monkeypatch):
    """LONGCTX_HISPARSE_FORK: inside a (here pretended) decode graph capture, `_begin` runs the victim
    candidates and the newest-token placement on the side stream (forked from the capturing stream),
    nothing of the first layer's top-k placement starts before the main stream joins it, every fork is
    joined before the step's forward returns, and the greedy tokens are the unforked run's and the
    uncapped run's."""
    import contextlib

    from longctx.kernels.common import HAS_TRITON, triton_interpret

    import longctx.hisparse.cache as cache_mod

    if not (HAS_TRITON and triton_interpret()):
        pytest.skip("needs TRITON_INTERPRET=1")
    prompts = [_ids(40, 1), _ids(30, 2)]

    def run(fork: bool) -> tuple[list[list[int]], list[tuple[str, ...]]]:
        log: list[tuple[str, ...]] = []
        main, side = _FakeStream("main", log), _FakeStream("side", log, reads=[])
        on = [main]

        def read(name, f):  # type: ignore[no-untyped-def]
            def call(*a, **k):  # type: ignore[no-untyped-def]
                log.append((name, on[-1].name))
                if on[-1] is side:  # the memory behind every tensor given
                    for i, t in enumerate([*a, *k.values()]):
                        if isinstance(t, torch.Tensor):
                            side.reads.append((f"{name} arg {i}", StorageWeakRef(t.untyped_storage())))
                return f(*a, **k)

            return call

        @contextlib.contextmanager
        def stream(s):  # type: ignore[no-untyped-def]
            on.append(s)
            log.append(("enter", s.name))
            yield
            on.pop()
            log.append(("exit", s.name))

        cand, place = cache_mod.lru_candidates, cache_mod.lru_place
        with Engine(model_dir, **KW, backend="triton", hisparse_device_tokens=CAP, cuda_graphs=True) as eng:
            kv = eng.runner.worker.kv
            kv._fork = fork
            graphs = eng.runner.graphs
            forward = graphs._forward

            def captured(c):  # type: ignore[no-untyped-def]
                with monkeypatch.context() as m:
                    m.setattr(kv, "_side", side)  # (outside the pretended capture: none, as on a CPU)
                    m.setattr(cache_mod.HiSparseKVCache, "_capturing", lambda self: True)
                    m.setattr(torch.cuda, "current_stream", lambda device=None: on[-1])
                    m.setattr(torch.cuda, "stream", stream)
                    m.setattr(cache_mod, "lru_candidates", read("cand", cand))
                    m.setattr(cache_mod, "lru_place", read("place", place))
                    log.append(("step",))
                    out = forward(c)
                    assert not kv._forked  # joined before the captured region ends
                    log.append(("end",))
                    return out

            graphs._forward = captured
            outs = eng.generate(prompts, max_new_tokens=3, ignore_eos=True)
            assert eng.stats()["hisparse"]["misses"] > 0
        return [o.token_ids for o in outs], log

    plain, log0 = run(False)
    forked, log1 = run(True)
    assert forked == plain
    # and both are the uncapped tokens (the fused decode step's placements: the newest tokens', then
    # each full layer's with its shared layers'), taken from the torch path (tests/test_engine_triton.py
    # checks the Triton path's fp32 tokens against it; interpreted, this run was a third of the test's time)
    with Engine(model_dir, **KW, backend="torch") as eng:
        assert [o.token_ids for o in eng.generate(prompts, max_new_tokens=3, ignore_eos=True)] == plain
    assert not any(e[0] == "wait" for e in log0) and ("cand", "main") in log0
    steps = [i for i, e in enumerate(log1) if e == ("step",)]
    assert len(steps) >= 2
    for a in steps:
        b = log1.index(("end",), a)
        step = log1[a:b]
        fork_at = step.index(("wait", "side", "main"))
        join_at = step.index(("wait", "main", "side"))
        # the candidates and the newest placement on the side stream, between the fork and the join
        assert step[fork_at + 1 : fork_at + 4] == [("enter", "side"), ("cand", "side"), ("place", "side")]
        assert step.index(("exit", "side")) < join_at
        # the first top-k placement (on the main stream) comes after the join, and only one fork a step
        first_main = step.index(("place", "main"))
        assert join_at < first_main and step.count(("wait", "side", "main")) == 1
        # what the side stream read was kept until the join (the twenty-third session's H200 run of the
        # fork diverged from the uncapped tokens: the newest positions went back to the cache at once)
        assert step[join_at + 1] == ("alive at the join",), step[join_at + 1]
