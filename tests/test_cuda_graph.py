"""The captured-decode path's bookkeeping (static buffers, padding rows, buckets), run without
capture on CPU: it must give exactly the eager engine's tokens."""

from __future__ import annotations

import torch

from longctx import Engine
from longctx.engine.cuda_graph import DecodeGraphs


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_static_decode_path_matches_eager(tiny_dir):
    prompts = [ids_of(n, n) for n in (7, 70, 130)]
    kw = dict(max_new_tokens=12, ignore_eos=True)
    with Engine(tiny_dir, device="cpu") as eager:
        want = [c.token_ids for c in eager.generate(prompts, **kw)]
        want_sampled = eager.generate(prompts[:1], temperature=1.0, seed=3, **kw)[0].token_ids
    with Engine(tiny_dir, device="cpu", cuda_graphs=True) as g:
        graphs = g.runner.graphs
        assert isinstance(graphs, DecodeGraphs) and not graphs.capture
        got = [c.token_ids for c in g.generate(prompts, **kw)]  # batch 3 -> bucket 4 with one padding row
        got_sampled = g.generate(prompts[:1], temperature=1.0, seed=3, **kw)[0].token_ids
        assert graphs.replays >= 2 * 11
        assert {b for b, _ in graphs._graphs} == {1, 4}
    assert got == want
    assert got_sampled == want_sampled


def test_buckets_and_eligibility(tiny_dir):
    with Engine(tiny_dir, device="cpu", cuda_graphs=True, max_context=100_000) as g:
        graphs = g.runner.graphs
        assert graphs.ctx_buckets == [4096, 16384, 65536, 262144]
        from longctx.engine.plan import BatchPlan, RowPlan

        dec = RowPlan("a", (5,), 10, (0,), "last")
        pre = RowPlan("b", (5, 6), 10, (1,), "last")
        assert graphs.bucket(BatchPlan(1, (dec,) * 3)) == (4, 4096)
        assert graphs.bucket(BatchPlan(1, (dec, pre))) is None  # a prefill row: eager
        assert graphs.bucket(BatchPlan(1, (dec,) * 65)) is None  # beyond the largest bucket
    with Engine(tiny_dir, device="cpu", cuda_graphs=False) as e:
        assert e.runner.graphs is None
