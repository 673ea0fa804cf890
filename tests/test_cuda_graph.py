"""The captured-decode path's bookkeeping (static buffers, padding rows, buckets), run without
capture on CPU: it must give exactly the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from longctx import Engine
from longctx.engine.cuda_graph import DecodeGraphs

from .overlap_helpers import InlineSide


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
        # the replays' host time, in the engine's stats (bench.step_profile reads it per step)
        st = g.stats()["cuda_graphs"]
        assert st["replays"] == graphs.replays and st["prep_s"] > 0 and st["launch_s"] > 0
        assert g.stats()["token_wait_s"] == 0.0  # CPU: the tokens are read without an event wait
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


def test_page_table_rows_are_updated_incrementally_and_exactly():
    """The device page table of a bucket follows the plans: appended pages write only their entries,
    a new request (or a new pages_epoch after preemption) rewrites its row, rows that become padding
    go back to the dummy page. After every step it equals a table built from scratch."""
    from types import SimpleNamespace

    from longctx.engine.plan import BatchPlan, RowPlan

    graphs = DecodeGraphs(SimpleNamespace(page_size=64, device=torch.device("cpu")), 1 << 14, dummy_page=99,
                          capture=False)  # fmt: skip
    c = graphs._buffers(4, 4096)
    writes = []

    def row(rid, pages, epoch):
        return RowPlan(rid, (1,), len(pages) * 64 - 1, tuple(pages), "last", pages_epoch=epoch)

    steps = [
        [row("a", [1, 2], 1), row("b", [5], 2), row("c", [7, 8, 9], 3)],
        [row("a", [1, 2], 1), row("b", [5, 6], 2), row("c", [7, 8, 9], 3)],  # b grew by one page
        [row("a", [1, 2, 3], 1), row("d", [11], 4)],  # c gone (padding), d replaces b in row 1
        [row("a", [20, 21, 22], 5), row("d", [11], 4)],  # a preempted and re-admitted: new epoch
        [row("a", [20, 21, 22], 5), row("d", [11], 4)],  # nothing changed
    ]
    for rows in steps:
        plan = BatchPlan(1, tuple(rows))
        before = c.table.clone()
        graphs._update_table(c, plan)
        want = torch.full_like(c.table, 99)
        for i, r in enumerate(rows):
            want[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        assert torch.equal(c.table, want), (rows, c.table[:, :4])
        writes.append(int((c.table != before).sum()))
    assert writes[1] == 1 and writes[4] == 0  # one appended entry; an unchanged step writes nothing


def test_worker_page_rows_follow_the_plans():
    """StageWorker's cached page rows equal the plan's pages through growth, new epochs and epoch 0."""
    from longctx.engine.plan import RowPlan
    from longctx.engine.worker import PageRows

    rows = PageRows(limit=3)
    seq = [
        ("a", [1], 1), ("a", [1, 2], 1), ("a", [1, 2, 3, 4, 5], 1),  # grows (buffer regrows too)
        ("a", [9, 8], 2),  # preempted and re-admitted: new epoch, shorter list
        ("b", [4, 5], 0), ("b", [6, 7], 0),  # epoch 0: always rebuilt
        ("c", [1], 3), ("d", [2], 4), ("e", [3], 5),  # over the limit: the cache is cleared, still exact
        ("a", [9, 8, 7], 2),
    ]  # fmt: skip
    for rid, pages, epoch in seq:
        got = rows.get(RowPlan(rid, (1,), 0, tuple(pages), pages_epoch=epoch))
        assert got.tolist() == pages and got.dtype == torch.int32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_side_stream_path_matches_eager(tiny_dir, backend):
    """Decode steps through the graph path with the layers' side-stream forks (the MLA row's write and a
    full layer's indexer beside the query's path, the shared experts beside the routed ones) give the eager
    engine's tokens; each step forks once per layer's attention and once per MoE layer with shared experts,
    each fork joined. With the Triton kernels (the interpreter) too: the fused projections' slices, the
    experts kernels' join before their combine."""
    prompts = [ids_of(n, n + 1) for n in ((9, 66) if backend == "torch" else (9, 20))]
    kw = dict(max_new_tokens=8 if backend == "torch" else 3, ignore_eos=True)
    with Engine(tiny_dir, device="cpu", backend=backend) as eager:
        want = [c.token_ids for c in eager.generate(prompts, **kw)]
    with Engine(tiny_dir, device="cpu", backend=backend, cuda_graphs=True) as g:
        graphs = g.runner.graphs
        assert graphs.side is None  # no capture on CPU: no side stream
        graphs.side = side = InlineSide()
        got = [c.token_ids for c in g.generate(prompts, **kw)]
        model = g.runner.worker.model
        cfg = model.cfg
        # every layer's attention forks (its MLA row's write, and a full layer's indexer: a paged pool is
        # dense-readable), and each MoE layer with shared experts
        per_step = sum(1 + (cfg.is_moe(i) and cfg.n_shared_experts > 0) for i in model.layer_range)
        assert per_step >= 2 and graphs.replays > 0
        assert side.forks == side.joins == per_step * graphs.replays and not side.open
        assert g.stats()["cuda_graphs"]["side_forks"] == side.forks
    assert got == want


def test_side_stream_runs_the_indexer_before_the_row_write_at_high_priority(tiny_dir, monkeypatch):
    """On a full layer the side stream queues the indexer's chain (the layer's critical path) before the
    MLA row's write, which only the join needs; under LONGCTX_SIDE_PRIORITY=1 the stream is asked for the
    highest priority (a captured kernel keeps its stream's priority in the replay), else the default one."""
    from longctx.model import mla as mla_mod
    from longctx.model import overlap

    log: list[tuple[str, int]] = []
    real_write = mla_mod.MLAttention._write_kv

    def write(self, ckv, ctx):
        log.append(("write", self.layer))
        return real_write(self, ckv, ctx)

    monkeypatch.setattr(mla_mod.MLAttention, "_write_kv", write)
    with Engine(tiny_dir, device="cpu", cuda_graphs=True) as g:
        model = g.runner.worker.model
        full = model.full_layers
        assert full
        for i in full:
            ind = model.model.layers[str(i)].self_attn.indexer
            real = ind.forward

            def traced(*a, _real=real, _i=i, **k):
                log.append(("indexer", _i))
                return _real(*a, **k)

            monkeypatch.setattr(ind, "forward", traced)
        g.runner.graphs.side = InlineSide()
        g.generate([ids_of(12, 5)], max_new_tokens=3, ignore_eos=True)
        assert g.runner.graphs.replays > 0
    for i in full:
        calls = [what for what, layer in log if layer == i]
        # prefill (eager: write, then the indexer) and each graph step (indexer, then write)
        assert calls[-2:] == ["indexer", "write"]

    made: list[int] = []

    class FakeStream:
        def __init__(self, device, priority=0):
            made.append(priority)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(overlap, "HIGH_PRIORITY", True)
    overlap.SideStream(torch.device("cuda", 0))
    monkeypatch.setattr(overlap, "HIGH_PRIORITY", False)
    overlap.SideStream(torch.device("cuda", 0))
    assert made[0] < 0 and made[1] == 0
