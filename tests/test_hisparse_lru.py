"""HiSparse LRU bookkeeping: the pure-Python policy (`SlotLRU`) and the device-tensor version in
`HiSparseKVCache`, both checked against the same invariants on random step sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.hisparse.lru import SlotLRU
from longctx.model.context import ForwardContext

from .conftest import tiny_config

# a step: (new tokens this step, requested positions as fractions of the KV length)
_steps = st.lists(
    st.tuples(st.integers(1, 6), st.lists(st.floats(0, 1, exclude_max=True), max_size=12)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 10), recent=st.integers(0, 4), steps=_steps)
def test_slot_lru_invariants(cap, recent, steps):
    lru = SlotLRU(cap)
    end = 0
    for n_new, fracs in steps:
        end += n_new
        newest_from = max(0, end - recent)
        lru.begin_step(newest_from)
        before = lru.resident()
        want = [int(f * end) for f in fracs]
        acc = lru.access(want)
        after = lru.resident()
        # at most cap resident, one slot each, all slots in range
        assert len(after) <= cap
        assert len(set(after.values())) == len(after)
        assert all(0 <= s < cap for s in after.values())
        # a hit was resident before and is never copied
        assert set(acc.hits) <= set(before)
        assert not set(acc.hits) & {p for p, _ in acc.misses}
        for p in acc.hits:
            assert after[p] == before[p]
        # requested ones are resident unless they overflowed; overflow only when nothing was evictable
        for p in want:
            assert p in after or p in acc.overflow
        if acc.overflow:
            evictable = [v for v in after if v not in set(want) and v < newest_from]
            assert not evictable
        # never evict a position requested this step or one of the newest
        for p, _ in acc.evicted:
            assert p not in set(want) and p < newest_from
        # freed slots are reused: a miss takes a free slot before evicting
        assert len(acc.evicted) <= max(0, len(before) + len(acc.misses) - cap)


def test_slot_lru_order_and_newest():
    lru = SlotLRU(3)
    lru.begin_step(newest_from=10)
    assert [s for _, s in lru.access([0, 1, 2]).misses] == [0, 1, 2]
    lru.begin_step(newest_from=10)
    assert lru.access([0]).hits == (0,)  # 0 becomes most recent: 1 is now the LRU victim
    lru.begin_step(newest_from=10)
    acc = lru.access([5])
    assert acc.evicted == ((1, 1),) and acc.misses == ((5, 1),)
    lru.begin_step(newest_from=0)  # everything resident is "newest": nothing may go
    acc = lru.access([7])
    assert acc.overflow == (7,) and 7 not in lru
    assert lru.access([2], force=[2]).refreshed == ((2, 2),)
    assert lru.clear() == [0, 1, 2] and len(lru) == 0


# ---- the device-tensor implementation ---------------------------------------------------------


def _cache(n_tokens: int, num_pages: int = 4, **kw):
    from longctx.hisparse.cache import HiSparseKVCache

    cfg = tiny_config(num_hidden_layers=3, index_topk=4)  # full, shared, full
    return HiSparseKVCache(
        cfg, range(3), num_pages, "auto", torch.float32, torch.device("cpu"), device_tokens=n_tokens, recent=2,
        **kw,
    )  # fmt: skip


def _ctx(kv, pages, start, n_q):
    end = start + n_q
    ps = 64
    pos = torch.arange(start, end)
    table = torch.tensor([pages], dtype=torch.int32)
    return ForwardContext(
        positions=pos,
        q_seq=torch.zeros(n_q, dtype=torch.int32),
        q_start=[0, n_q],
        seq_lens=torch.tensor([end], dtype=torch.int32),
        seq_lens_cpu=[end],
        page_table=table,
        slot_mapping=table.long()[0, pos // ps] * ps + pos % ps,
        kv=kv,
        extras={"rids": ("r0",)},
    )


@settings(max_examples=25, deadline=None)
@given(
    n_tokens=st.integers(5, 12),
    steps=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 2**31 - 1)), min_size=1, max_size=12),
)
def test_device_lru_rows_are_exact_and_capped(n_tokens, steps):
    """Every resolved row holds exactly the host row of its position; at most N resident; the
    newest tokens and every requested one resident after a decode step, the selections of a prefill
    chunk's last `tail_queries` queries after a prefill step."""
    kv = _cache(n_tokens)
    pages = [2, 0, 3]
    start = 0
    for n_q, seed in steps:
        if start + n_q > 64 * len(pages):
            break
        ctx = _ctx(kv, pages, start, n_q)
        g = torch.Generator().manual_seed(seed)
        for layer in range(3):
            host = kv.mla_pool(layer)
            # the layer "writes" its new rows: a value that identifies (layer, slot)
            host[ctx.slot_mapping] = (layer * 1000 + ctx.slot_mapping.float())[:, None].expand(
                -1, host.shape[1]
            )
            kv.after_write(layer, ctx)
            end = start + n_q
            topk = torch.full((n_q, 4), -1, dtype=torch.int64)
            for t in range(n_q):
                k = min(4, start + t + 1)
                topk[t, :k] = torch.randperm(start + t + 1, generator=g)[:k]
            if layer != 1:  # layer 1 shares layer 0's top-k (prefetched for decode steps)
                prev = topk
            rows = kv.resolve(layer, prev, ctx)
            pool = kv.attend_pool(layer)
            valid = prev >= 0
            assert torch.all((rows >= 0) == valid)
            want = layer * 1000 + ctx.logical_to_rows(prev).float()
            assert torch.equal(pool[rows[valid]][:, 0], want[valid])
            blk = kv._states["r0"].block
            s2p = kv._s2p[blk, layer, :n_tokens]
            resident = set(s2p[s2p >= 0].tolist())
            assert len(resident) <= n_tokens
            assert set(range(max(0, end - kv.recent), end)) <= resident
            if n_q == 1:
                assert set(prev[valid].tolist()) <= resident
            else:  # a prefill chunk leaves what its last queries selected resident (the latest first)
                tail = prev[-kv.tail_queries :]
                union = set(tail[tail >= 0].tolist())
                latest = set(prev[-1][prev[-1] >= 0].tolist())
                room = n_tokens - kv.recent
                if len(union) <= room:
                    assert union <= resident
                else:
                    assert len(latest & resident) >= min(len(latest), room)
            # pos2slot and slot2pos agree
            p2s = kv._p2s[blk, layer, :end]
            for p in resident:
                assert s2p[p2s[p]].item() == p
            assert int((p2s >= 0).sum()) == len(resident)
        start += n_q
    hs = kv.stats()["hisparse"]
    assert hs["device_tokens_max"] <= n_tokens
    kv.release(["r0"])
    assert kv.stats()["hisparse"]["requests"] == 0
    kv.close()


def test_prefill_placements_compile_nothing(monkeypatch):
    """A prefill placement's width comes from the data (a chunk's queries x top-k, the tail's distinct
    selections): it takes the torch placement even on the Triton path, since every new width would
    compile a kernel variant (10-45 s each for sm_90; the H200's 128K capped prefill took 244 s). The
    newest tokens (at most `recent` wide) and decode steps (top-k wide) keep the kernel."""
    from longctx.hisparse import cache as cache_mod

    calls: list[tuple[int, str, bool]] = []
    real = cache_mod.lru_place

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append((args[4].shape[1], kw["backend"], kw["force"]))
        return real(*args, **{**kw, "backend": "torch"})  # (the kernels are tested on their own)

    monkeypatch.setattr(cache_mod, "lru_place", spy)
    kv = _cache(6, use_triton=True)
    g = torch.Generator().manual_seed(1)
    for start, n_q in ((0, 20), (20, 1)):
        ctx = _ctx(kv, [2, 0, 3], start, n_q)
        topk = torch.full((n_q, 4), -1, dtype=torch.int64)
        for t in range(n_q):
            sel = torch.randperm(start + t + 1, generator=g)[:4]
            topk[t, : len(sel)] = sel
        for layer in range(3):  # (layer 1 shares layer 0's top-k)
            kv.after_write(layer, ctx)
            kv.resolve(layer, topk, ctx)
        widths = {b for m, b, force in calls if not force and m > 4}
        forced = {b for m, b, force in calls if force}
        if n_q > 1:  # the chunk (20 x 4, sorted) and its tail's distinct selections
            assert widths == {"torch"} and forced == {"triton"}
        else:
            assert {b for m, b, force in calls} == {"triton"}
        calls.clear()
    kv.close()


def test_cap_must_exceed_topk():
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError):
        _cache(4)


@pytest.mark.parametrize("dtype,width", [(torch.uint8, 656), (torch.float32, 40), (torch.bfloat16, 18)])
def test_counted_swap_kernel_interpreted(dtype, width):
    """The device-count swap kernel (run by the Triton interpreter) copies exactly `count` items."""
    from longctx.kernels.common import HAS_TRITON, triton_interpret
    from longctx.kernels.swap import copy_geometry

    from longctx.hisparse.gather import _copy_rows_counted_kernel

    if not (HAS_TRITON and triton_interpret()):
        pytest.skip("needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(width)
    host = torch.randint(0, 100, (50, width), generator=g).to(dtype)
    dst = torch.zeros(30, width, dtype=dtype)
    src_rows = torch.randperm(50, generator=g)[:20]
    dst_rows = torch.randperm(30, generator=g)[:20]
    count = torch.tensor(13)
    geo = copy_geometry(host, dst)
    _copy_rows_counted_kernel[(geo.grid(20, dst.device),)](
        host.view(torch.uint8).view(geo.word), src_rows, dst.view(torch.uint8).view(geo.word), dst_rows, count,
        ROW_W=geo.row_w, ITEM_W=geo.item_w, PIECES=geo.pieces, SPAN_W=geo.span_w, ITEMS=geo.items,
        BLOCK_W=geo.block_w,
    )  # fmt: skip
    want = torch.zeros_like(dst)
    want[dst_rows[:13]] = host[src_rows[:13]]
    assert torch.equal(dst, want)


def test_decode_bookkeeping_makes_no_host_sync():
    """A decode step's bookkeeping as a captured graph runs it: the rows are bound on the host first
    (`bind_rows`), the step reads their block ids and a padding row's mask from device buffers.
    Its placements (newest tokens, a full layer's misses with its shared layer's in one launch) and the
    device-counted swap-in copies (the Triton kernel, interpreted) read nothing back and make no
    host tensor: on CUDA each of those would stall the step or break the capture. The step is still
    exact, and the padding row places nothing."""
    from longctx.kernels.common import HAS_TRITON, triton_interpret

    from .test_kernels_graph_safe import _audit

    if not (HAS_TRITON and triton_interpret()):
        pytest.skip("needs TRITON_INTERPRET=1")
    kv = _cache(12, use_triton=True, max_requests=2)
    pages, dummy = [2, 0, 3], 1
    g = torch.Generator().manual_seed(0)

    def topk_for(start: int, n_q: int) -> torch.Tensor:
        topk = torch.full((n_q, 4), -1, dtype=torch.int64)
        for t in range(n_q):
            k = min(4, start + t + 1)
            topk[t, :k] = torch.randperm(start + t + 1, generator=g)[:k]
        return topk

    def step(ctx, topk) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        rows = []
        for layer in range(3):  # layer 1 shares layer 0's top-k (prefetched: decode rows)
            host = kv.mla_pool(layer)
            val = layer * 1000 + ctx.slot_mapping.float()
            host[ctx.slot_mapping] = val[:, None].expand(-1, host.shape[1])
            kv.after_write(layer, ctx)
            rows.append(kv.resolve(layer, topk, ctx))
        return rows

    step(_ctx(kv, pages, 0, 20), topk_for(0, 20))  # an eager prefill and decode step
    step(_ctx(kv, pages, 20, 1), topk_for(20, 1))
    for pos in (21, 22, 23):
        # a captured batch of 2: row 0 is r0, row 1 padding (block 0, the dummy page, one key)
        blk = kv.bind_rows(["r0"], [pos], [pos + 1])
        table = torch.tensor([pages, [dummy] * 3], dtype=torch.int32)
        slots = torch.tensor([pages[pos // 64] * 64 + pos % 64, dummy * 64])
        ctx = ForwardContext(
            positions=torch.tensor([pos, 0]), q_seq=torch.tensor([0, 1], dtype=torch.int32), q_start=[0, 1, 2],
            seq_lens=torch.tensor([pos + 1, 1], dtype=torch.int32), seq_lens_cpu=[4096, 4096],
            page_table=table, slot_mapping=slots, kv=kv,
            extras={"rids": (), "kv_blocks": torch.tensor(blk + [0]), "valid": torch.tensor([True, False])},
        )  # fmt: skip
        topk = torch.cat([topk_for(pos, 1), torch.tensor([[0, -1, -1, -1]])])
        out: list[list[torch.Tensor]] = []
        bad = _audit(lambda: out.append(step(ctx, topk)))  # noqa: B023
        assert not bad, bad
        for layer, rows in enumerate(out[0]):
            assert torch.all(rows[1] == -1)  # the padding row attends to nothing
            pool = kv.attend_pool(layer)
            want = layer * 1000 + ctx.logical_to_rows(topk[:1]).float()
            assert torch.equal(pool[rows[0][topk[0] >= 0]][:, 0], want[0][topk[0] >= 0])
    assert torch.all(kv._p2s[0, :, :-1] == -1) and torch.all(kv._s2p[0, :, :-1] == -1)


def test_swap_bytes_count_each_layers_rows_at_its_own_size():
    """A cache whose layers hold their KV in different kinds (layer 1 in the model dtype, the others
    fp8, as `kv_fp8_skip_layers` makes them): `swap_bytes` is every layer's misses times that layer's
    row bytes, not the misses times an average row. Nothing is evicted here (the buffer holds every
    token), so a layer's misses are the positions it is asked for the first time."""
    from longctx.hisparse.cache import HiSparseKVCache
    from longctx.kv_kinds import KVKinds
    from longctx.kvstore.pool import host_kv_spec

    cfg = tiny_config(num_hidden_layers=3, index_topk=4)  # full, shared, full
    kinds = KVKinds("fp8", frozenset({1}))
    kv = HiSparseKVCache(
        cfg, range(3), 4, kinds, torch.float32, torch.device("cpu"), device_tokens=64, recent=2
    )
    spec = host_kv_spec(cfg, range(3), kv.num_slots, kinds, torch.float32)
    rows = [spec.rows_of(layer) for layer in range(3)]
    assert rows[1] != rows[0] == rows[2]
    pages = [2, 0, 3]
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))

    def step(start: int, n_q: int, picks: dict[int, torch.Tensor]) -> None:
        ctx = _ctx(kv, pages, start, n_q)
        for layer in range(3):
            kv.mla_pool(layer)[ctx.slot_mapping] = 1.0
            kv.after_write(layer, ctx)
            kv.resolve(layer, picks[0 if layer == 1 else layer], ctx)  # layer 1 shares layer 0's

    start = 20
    step(0, start, {0: torch.full((start, 4), -1), 2: torch.full((start, 4), -1)})
    before = kv.stats()["hisparse"]
    blk = kv._states["r0"].block
    seen = [set(kv._p2s[blk, layer, :start].ge(0).nonzero().flatten().tolist()) for layer in range(3)]
    want_misses = want_bytes = 0
    for _ in range(20):
        end = start + 1
        picks = {0: torch.randperm(end, generator=g)[:4].sort().values[None]}
        picks[2] = torch.cat([torch.randperm(end, generator=g)[:1], torch.full((3,), -1)])[None]  # asks less
        for layer in range(3):
            seen[layer] |= set(range(end - kv.recent, end))  # the newest rows: forced copies, not misses
            asked = set(picks[0 if layer == 1 else layer].flatten().tolist()) - {-1}
            new = asked - seen[layer]
            want_misses += len(new)
            want_bytes += len(new) * rows[layer]
            seen[layer] |= asked
        step(start, 1, picks)
        start = end
    after = kv.stats()["hisparse"]
    misses = after["misses"] - before["misses"]
    swapped = after["swap_bytes"] - before["swap_bytes"]
    assert misses == want_misses > 0
    assert swapped == want_bytes != round(misses * sum(rows) / 3)  # (what an average row would say)
    kv.close()
