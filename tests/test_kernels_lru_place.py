"""The HiSparse placement kernel (kernels/lru_place.py, interpreted) against its torch reference: the
same tables (sinks aside), outputs and counters, bit for bit, over sequences of placements on fresh
random tables: duplicates, -1 padding (at either end or anywhere), unsorted rows, full buffers,
overflow, protected newest positions, forced copies, a padding row and several layers at once."""

from __future__ import annotations

import pytest
import torch
from longctx.kernels.common import HAS_TRITON, triton_interpret
from longctx.kernels.lru_place import (
    CandKeep,
    cand_keep_buffers,
    lru_candidates,
    lru_candidates_ref,
    lru_place,
    lru_place_ref,
)

from . import conftest_kernels  # noqa: F401  (TRITON_INTERPRET=1 before triton is imported)

pytestmark = pytest.mark.skipif(not (HAS_TRITON and triton_interpret()), reason="needs TRITON_INTERPRET=1")

PS = 4  # page size


class _Tables:
    """[1 + blocks, layers, row] tables as the cache holds them (block 0 = the padding block)."""

    def __init__(self, blocks: int, layers: int, n: int, p: int) -> None:
        self.p2s = torch.full((1 + blocks, layers, p), -1, dtype=torch.int32)
        self.s2p = torch.full((1 + blocks, layers, n + 1), -1, dtype=torch.int64)
        self.stamp = torch.full((1 + blocks, layers, n + 1), -1, dtype=torch.int64)

    def clone(self) -> _Tables:
        t = _Tables.__new__(_Tables)
        t.p2s, t.s2p, t.stamp = self.p2s.clone(), self.s2p.clone(), self.stamp.clone()
        return t

    def same(self, o: _Tables) -> bool:  # the sink columns aside
        return (
            torch.equal(self.p2s[..., :-1], o.p2s[..., :-1])
            and torch.equal(self.s2p[..., :-1], o.s2p[..., :-1])
            and torch.equal(self.stamp[..., :-1], o.stamp[..., :-1])
        )


def _request(g: torch.Generator, B: int, M: int, hi: int, style: str) -> torch.Tensor:
    pos = torch.full((B, M), -1, dtype=torch.int64)
    for b in range(B):
        k = int(torch.randint(0, M + 1, (1,), generator=g))
        if style == "dups":  # unsorted, repeats, -1 anywhere
            v = torch.randint(-1, hi, (M,), generator=g)
            pos[b] = v
            continue
        v = torch.randperm(hi, generator=g)[: min(k, hi)].sort().values
        if style == "topk":  # ascending, then -1 padding
            pos[b, : v.numel()] = v
        elif style == "newest":  # -1 padding, then ascending
            pos[b, M - v.numel() :] = v
        else:  # shuffled
            pos[b, : v.numel()] = v[torch.randperm(v.numel(), generator=g)]
    return pos


@pytest.mark.parametrize(
    "B,L,N,M,steps,seed,chunk",
    [
        (1, 1, 40, 16, 12, 0, None),
        (3, 2, 24, 32, 10, 1, None),
        (2, 3, 300, 64, 8, 2, None),
        (4, 1, 2100, 40, 6, 3, None),
        (2, 2, 300, 40, 12, 4, 8),  # the all-hit pass (5 chunks, the last one partial)
        (3, 1, 90, 16, 10, 5, 4),
    ],
)
def test_place_matches_reference(B, L, N, M, steps, seed, chunk):
    _check_sequence(B, L, N, M, steps, seed, chunk, {})


@pytest.mark.parametrize(
    "B,L,N,M,steps,seed,chunk,block_n,digit_bits",
    [
        (1, 1, 300, 32, 12, 10, None, 32, 11),  # 10 blocks, the last one partial
        (1, 1, 100, 32, 16, 15, None, 16, 11),  # a full buffer most steps: ties across blocks
        (2, 2, 160, 48, 14, 16, None, 32, 11),
        (3, 2, 200, 40, 12, 11, None, 16, 4),  # 4-bit digits: the clock's big jumps go serial
        (2, 1, 130, 16, 12, 12, None, 64, 2),  # 2-bit digits: most selects go serial
        (2, 2, 300, 40, 12, 13, 8, 64, 11),  # with the all-hit pass in front
        (2, 2, 300, 40, 12, 17, 0, 32, 11),  # repeated requests without it: phase 0 finds no miss
        (1, 1, 48, 64, 8, 14, None, 16, 11),  # M > N: overflow, every slot a victim
    ],
)
def test_parallel_place_matches_reference(B, L, N, M, steps, seed, chunk, block_n, digit_bits):
    """The victim selection's passes over the slots split over one program per slot block (three
    launches before the full kernel), bit for bit the reference; too-old keys take the full kernel's
    own select for that (row, layer)."""
    _check_sequence(
        B, L, N, M, steps, seed, chunk, {"parallel": True, "block_n": block_n, "digit_bits": digit_bits}
    )


@pytest.mark.parametrize(
    "B,L,N,M,steps,seed,chunk,extra",
    [
        (1, 1, 40, 16, 14, 20, None, 0),
        (3, 2, 24, 32, 10, 21, None, 0),  # M > N: overflow, every evictable slot a candidate
        (2, 3, 300, 64, 10, 22, None, 5),  # more candidates than positions
        (2, 2, 300, 40, 12, 23, 8, 0),  # behind the all-hit pass
        (2, 2, 120, 40, 12, 24, 0, 0),  # repeated requests: every candidate may be a hit
        (1, 2, 60, 16, 14, 25, None, -3),  # a forced newest-tokens placement first, from the same ones
        (3, 1, 200, 32, 12, 26, 0, -2),
    ],
)
def test_place_from_candidates_matches_reference(B, L, N, M, steps, seed, chunk, extra):
    """Victims taken from `lru_candidates` made at each step's start (C = M + extra candidates per
    (row, layer)): the same tables, outputs and counters as the reference's select. extra < 0: each
    step first places its -extra newest positions (forced, as a decode step does) from the same
    candidates, which then number M - extra (the distinct positions of both placements)."""
    newest = max(0, -extra)
    _check_sequence(B, L, N, M, steps, seed, chunk, {"cand_count": M + abs(extra), "newest": newest})


@pytest.mark.parametrize(
    "B,L,N,M,steps,seed,extra",
    [
        (2, 2, 700, 16, 16, 30, 4),  # full kept lists (KC 128 < N): reused while >= C stay untouched
        (1, 2, 500, 24, 16, 31, -3),  # with the newest positions placed first from the same candidates
        (3, 1, 60, 16, 12, 32, 0),  # KC > N: the lists hold every evictable slot (no bound)
        (2, 3, 300, 8, 20, 33, -2),
    ],
)
def test_kept_candidates_match_reference(B, L, N, M, steps, seed, extra):
    """`lru_candidates(..., keep=...)` over a sequence of steps (clock jumps, newest_from moving both
    ways, overflow): every step's candidates equal the reference's select on the tables as they are,
    the placements from them the reference's, and the kept lists were both reused and made again."""
    _check_sequence(
        B, L, N, M, steps, seed, None, {"cand_count": M + abs(extra), "newest": max(0, -extra), "keep": True}
    )


@pytest.mark.parametrize(
    "B,L,N,count,seed,par",
    [
        (1, 1, 50, 16, 0, None),
        (3, 2, 300, 64, 1, None),
        (2, 3, 20, 32, 2, None),
        (2, 2, 300, 64, 3, (32, 11)),  # the parallel passes: 10 blocks, the last one partial
        (1, 2, 100, 40, 4, (16, 2)),  # 2-bit digits: stamps too old for them take the serial select
        (2, 1, 20, 32, 5, (8, 11)),  # count > N, in parallel
    ],
)
def test_candidates_match_reference(B, L, N, count, seed, par):
    """The candidates kernel against its reference on random tables: free slots, stamps of many
    steps with ties, protected newest positions and slots touched at `now`; count > N pads with -1.
    par (block_n, digit_bits): the select's passes over the slots as the parallel passes."""
    g = torch.Generator().manual_seed(seed)
    n_l = L + 1
    s2p = torch.randint(-1, 4 * N, ((B + 1) * n_l * (N + 1),), generator=g)
    stamp = torch.randint(-1, 41, s2p.shape, generator=g)  # (2-bit digits span 16 steps: too old)
    stamp[s2p < 0] = -1
    now = torch.tensor(40, dtype=torch.int64)
    trow = torch.arange(1, B + 1)[:, None] * n_l + torch.arange(1, 1 + L)
    nf = torch.randint(N, 4 * N, (B,), generator=g)
    want = lru_candidates_ref(s2p, stamp, now, trow * (N + 1), nf, n_slots=N, count=count)
    kw = {} if par is None else {"parallel": True, "block_n": par[0], "digit_bits": par[1]}
    got = lru_candidates(s2p, stamp, now, trow * (N + 1), nf, n_slots=N, count=count, backend="triton", **kw)
    assert torch.equal(got, want)
    assert (want >= 0).any() and ((want < 0).any() or count <= N)


def _check_sequence(B, L, N, M, steps, seed, chunk, kw):
    kw = dict(kw)
    cand_count = kw.pop("cand_count", None)
    newest = kw.pop("newest", 0)
    keep = kw.pop("keep", False)
    g = torch.Generator().manual_seed(seed)
    n_l, P = L + 1, 4 * N + 1  # layers of the tables (the placement covers [1, 1 + L)), row length
    ref = _Tables(B + 1, n_l, N, P)
    tri = ref.clone()
    ovf = hits = 0
    prev = None
    # acc[5] / acc[6]: the misses' / forced copies' bytes, each layer's rows at its own size
    acc_r, acc_t = torch.zeros(7, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)
    rb = torch.randint(100, 1000, (L,), generator=g)
    now = torch.zeros((), dtype=torch.int64)
    minus1 = torch.full((), -1, dtype=torch.int32)
    pages = torch.stack([torch.randperm(P // PS + 1, generator=g) for _ in range(B)]).to(torch.int32)
    styles = ["topk", "newest", "dups", "shuffled"]
    # row B - 1 is a padding row (block 0, nothing requested) when B > 1
    blk = torch.tensor([b + 1 for b in range(B - 1)] + [0 if B > 1 else 1])
    kept = cand_keep_buffers((B + 2) * n_l, cand_count, "cpu") if keep else None
    reused = made = 0
    for step in range(steps):
        # clocks skip (other stages' steps); big jumps make the radix select take several digits
        now += (1, 2, 300, 1, 70_000, 1)[step % 6]
        hi = min(P - 1, 2 * N + 4 * step * M // 3)
        pos = _request(g, B, M, hi, styles[step % 4])
        if chunk is not None and step % 2 == 1:  # the last request again: hits only (M < N)
            pos = prev
        prev = pos
        if B > 1:
            pos[-1] = -1
        trow = blk[:, None] * n_l + torch.arange(1, 1 + L)
        newest_from = torch.randint(0, hi + 2, (B,), generator=g) if step % 3 == 1 else torch.full((B,), hi)
        force = step % 5 == 4
        base = 1 + (blk - 1) * N
        # the kernel masks on the fly what the reference gets masked (int32 positions)
        valid = below = None
        pos_t = pos
        if chunk is not None and step % 3 == 2:
            valid = torch.rand(B, generator=g) < 0.7
            below = torch.randint(0, hi + 2, (B,), generator=g)
            pos = torch.where(valid[:, None] & (pos < below[:, None]), pos, -1)
            pos_t = pos_t.to(torch.int32)
        extra = {}
        if cand_count is not None:  # the candidates of the tables as they are now
            k_arg = None
            if kept is not None:
                before = [t.clone() for t in kept]
                k_arg = CandKeep(*kept, tri.p2s.view(-1), trow * P)
            extra["cand"] = lru_candidates(
                tri.s2p.view(-1), tri.stamp.view(-1), now, trow * (N + 1), newest_from, n_slots=N,
                count=cand_count, backend="triton", keep=k_arg,
            )  # fmt: skip
            if kept is not None:
                want = lru_candidates_ref(
                    tri.s2p.view(-1), tri.stamp.view(-1), now, trow * (N + 1), newest_from, n_slots=N,
                    count=cand_count,
                )  # fmt: skip
                assert torch.equal(extra["cand"], want), step
                planes = (trow.flatten()).tolist()  # (the padding row's block-0 planes aside)
                for pl in planes[: (B - 1) * L] if B > 1 else planes:
                    same = all(torch.equal(a[pl], b[pl]) for a, b in zip(before, kept))
                    reused += same and int(before[2][pl, 0]) >= 0
                    made += not same
        if newest:  # the step's newest positions first (forced), from the same candidates
            npos = torch.arange(hi - newest, hi)[None].expand(B, newest).contiguous()
            for t, acc in ((ref, acc_r), (tri, acc_t)):
                (lru_place_ref if t is ref else lru_place)(
                    t.p2s.view(-1), t.s2p.view(-1), t.stamp.view(-1), now,
                    npos, trow * P, trow * (N + 1), base, newest_from, pages, acc, n_slots=N, pos_len=P,
                    page_size=PS, force=True, minus1=minus1, row_bytes=rb,
                    **({} if t is ref else {"backend": "triton", **extra}),
                )  # fmt: skip
            assert ref.same(tri), step
        out = []
        for t, acc in ((ref, acc_r), (tri, acc_t)):
            out.append(
                (lru_place_ref if t is ref else lru_place)(
                    t.p2s.view(-1),
                    t.s2p.view(-1),
                    t.stamp.view(-1),
                    now,
                    pos if t is ref else pos_t,
                    trow * P,
                    trow * (N + 1),
                    base,
                    newest_from,
                    pages,
                    acc,
                    n_slots=N,
                    pos_len=P,
                    page_size=PS,
                    force=force,
                    minus1=minus1,
                    row_bytes=rb,
                    **(
                        {}
                        if t is ref
                        else {
                            "backend": "triton",
                            "hit_chunk": chunk,
                            "valid": valid,
                            "below": below,
                            **kw,
                            **extra,
                        }
                    ),
                )  # fmt: skip
            )
        a, k = out
        ovf += int(a.overflow.sum())
        hits += int(not a.copy.any() and not a.overflow.any() and bool((a.u >= 0).any()))
        assert ref.same(tri), step
        assert torch.equal(acc_r, acc_t), step
        for name in ("u", "src", "dst", "copy", "overflow"):
            assert torch.equal(getattr(a, name), getattr(k, name)), (step, name)
        assert k.cnt is not None and k.csrc is not None and k.cdst is not None
        for b in range(B):
            for i in range(L):
                n = int(k.cnt[b, i])
                c = a.copy[b, i]
                assert n == int(c.sum())
                assert torch.equal(k.csrc[b, i, :n], a.src[b][c]) and torch.equal(
                    k.cdst[b, i, :n], a.dst[b, i][c]
                )
    assert acc_r[1] > 0 and acc_r[0] > 0 and acc_r[2] > 0
    for n, nbytes in ((acc_r[1], acc_r[5]), (acc_r[2], acc_r[6])):
        assert n * rb.min() <= nbytes <= n * rb.max() and (L == 1 or nbytes != n * rb[0])
    assert hits > 0 or chunk is None
    assert not keep or (reused > 0 and made > 0), (reused, made)
    assert ovf > 0 or M < N  # a request wider than the buffer overflows


def _next_topk(caches, g, rid, start, n_q, old=False):  # type: ignore[no-untyped-def]
    """The top-4 selections of a step of request `rid` (r0 is released when r1 starts, so r1 reuses its
    block): random earlier positions, ascending; `old`: every third decode step only from the first
    quarter of the context (positions selected long ago again)."""
    if rid == "r1" and "r0" in caches[0]._states:
        for kv in caches:
            kv.release(["r0"])
    topk = torch.full((n_q, 4), -1, dtype=torch.int64)
    for t in range(n_q):
        k = min(4, start + t + 1)
        hi = start + t + 1
        if old and n_q == 1 and start % 3 == 0:
            hi = max(k, hi // 4)
        topk[t, :k] = torch.randperm(hi, generator=g)[:k].sort().values
    return topk


def _same_step(caches, pages, rid, start, n_q, topk) -> None:  # type: ignore[no-untyped-def]
    """One forward step of request `rid` (queries start..start + n_q, selections `topk`) through each
    cache of `caches` (three layers, every host row marked with its layer and slot): the same resolved
    rows and bytes, and the same tables (sinks aside)."""
    from .test_hisparse_lru import _ctx

    got = []
    for kv in caches:
        ctx = _ctx(kv, pages, start, n_q)
        ctx.extras["rids"] = (rid,)
        rows = []
        for layer in range(3):
            host = kv.mla_pool(layer)
            host[ctx.slot_mapping] = (layer * 1000 + ctx.slot_mapping.float())[:, None].expand(
                -1, host.shape[1]
            )
            kv.after_write(layer, ctx)
            r = kv.resolve(layer, topk, ctx)
            rows.append((r, kv.attend_pool(layer)[r.clamp(min=0)][:, :, 0]))
        got.append(rows)
    for (ra, pa), (rb, pb) in zip(*got):
        assert torch.equal(ra, rb) and torch.equal(pa, pb)
    a, b = caches
    for name in ("_p2s", "_s2p", "_stamp"):
        assert torch.equal(getattr(a, name)[..., :-1], getattr(b, name)[..., :-1]), name


@pytest.mark.parametrize(
    "hit_chunk,place_block,cand",
    [(None, None, True), (2, None, True), (None, None, False), (None, 2, False), (2, 2, True)],
)
def test_cache_triton_path_matches_torch_path(hit_chunk, place_block, cand, monkeypatch):
    """HiSparseKVCache with the placement kernel and the compacted swap-in (interpreted) against the
    torch path over prefill chunks (overflow), decode steps (prefetched shared layer) and a finished
    request whose block a new one reuses: same tables, same resolved rows and bytes, same stats.
    hit_chunk 2: the all-hit pass on every placement (top-k 4 here); place_block 2: slot blocks of 2
    (the candidates' select, or the parallel passes over 6 blocks of the 12 slots, PAR_MIN_BLOCKS
    lowered to 4); cand: decode placements take their victims from the step's candidates."""
    from longctx.kernels import lru_place as lru_place_mod

    from .test_hisparse_lru import _cache

    monkeypatch.setattr(lru_place_mod, "PAR_MIN_BLOCKS", 4)

    caches = [
        _cache(12, use_triton=False),
        _cache(12, use_triton=True, hit_chunk=hit_chunk, place_block=place_block, place_candidates=cand),
    ]
    pages = [2, 0, 3]
    g = torch.Generator().manual_seed(5)
    last = torch.empty(0, dtype=torch.int64)
    plan = [
        ("r0", 0, 20),
        ("r0", 20, 1),
        ("r0", 21, 1),
        ("r0", 22, 9),
        ("r0", 31, 1),
        ("r0", 32, 1),
        ("r1", 0, 7),
        ("r1", 7, 1),
    ]
    for rid, start, n_q in plan:
        topk = _next_topk(caches, g, rid, start, n_q)
        if start in (21, 32):  # the last decode step's selection again: all hits
            topk = last.clone()
        last = topk
        _same_step(caches, pages, rid, start, n_q, topk)
        a, b = caches
        assert (b._cand is not None) == (cand and n_q == 1)  # a decode step made its candidates
    sa, sb = (kv.stats()["hisparse"] for kv in caches)
    sa.pop("swap_seconds"), sb.pop("swap_seconds")
    assert sa == sb and sa["misses"] > 0 and sa["overflow_rows_max"] > 0
    for kv in caches:
        kv.close()


def test_rows_counted_swap_interpreted():
    """swap_in_rows_counted copies exactly counts[b] items of each row's list (interpreted kernel)."""
    from longctx.hisparse.gather import swap_in_rows_counted

    g = torch.Generator().manual_seed(1)
    host = torch.randint(0, 100, (80, 40), generator=g).float()
    src = torch.randint(0, 80, (3, 2, 20), generator=g)
    dst = torch.randperm(3 * 2 * 20, generator=g).view(3, 2, 20)
    counts = torch.tensor([[5, 0], [20, 3], [0, 17]])
    for k in range(2):
        a, b = torch.zeros(120, 40), torch.zeros(120, 40)
        swap_in_rows_counted(host, src[:, k], a, dst[:, k], counts[:, k], True)
        swap_in_rows_counted(host, src[:, k], b, dst[:, k], counts[:, k], False)
        want = torch.zeros(120, 40)
        for r in range(3):
            n = int(counts[r, k])
            want[dst[r, k, :n]] = host[src[r, k, :n]]
        assert torch.equal(a, want) and torch.equal(b, want)


@pytest.mark.parametrize("n_new", [1, 2])
def test_full_buffer_few_misses(n_new):
    """A full buffer whose stamps span several steps, then n_new misses (one: the oldest slot is taken
    without the histogram passes): kernel and reference agree."""
    N, P, L = 24, 200, 2
    ref = _Tables(1, L, N, P)
    tri = ref.clone()
    now = torch.zeros((), dtype=torch.int64)
    minus1 = torch.full((), -1, dtype=torch.int32)
    accs = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    trow = torch.tensor([[1 * L + i for i in range(L)]])
    pages = torch.arange(P // PS + 1, dtype=torch.int32)[None]
    kw = dict(n_slots=N, pos_len=P, page_size=PS, force=False, minus1=minus1)
    nf = torch.tensor([P])
    steps = [torch.arange(i * 6, i * 6 + 6)[None] for i in range(4)]  # 4 steps fill the 24 slots
    steps.append(torch.arange(100, 100 + n_new)[None])
    for pos in steps:
        now += 3
        a = lru_place_ref(ref.p2s.view(-1), ref.s2p.view(-1), ref.stamp.view(-1), now, pos, trow * P,
                          trow * (N + 1), torch.tensor([1]), nf, pages, accs[0], **kw)  # fmt: skip
        b = lru_place(tri.p2s.view(-1), tri.s2p.view(-1), tri.stamp.view(-1), now, pos, trow * P,
                      trow * (N + 1), torch.tensor([1]), nf, pages, accs[1], backend="triton", **kw)  # fmt: skip
        assert ref.same(tri) and torch.equal(*accs)
        assert torch.equal(a.dst, b.dst) and torch.equal(a.copy, b.copy)
    assert int(accs[0][1]) == L * (24 + n_new) and bool(a.copy.all())


def test_cache_kept_candidates_match_torch_path():
    """HiSparseKVCache with kept victim candidates (interpreted) against the torch path over a long
    decode (old positions selected again and again, so the kept lists are reused, run short and are
    made again) and a finished request whose block a new one reuses (its lists dropped): the same
    tables, resolved rows and stats."""
    from .test_hisparse_lru import _cache

    N = 64  # top-4 and recent 2 ask for 6 candidates a step: 32 kept, a bound below N
    caches = [_cache(N, use_triton=False), _cache(N, use_triton=True, place_candidates=True)]
    kv_t = caches[1]
    assert kv_t._keep_on and kv_t._keep[0].shape[1] == 32
    pages = [2, 0, 3]
    g = torch.Generator().manual_seed(9)
    plan = [("r0", 0, 100)] + [("r0", 100 + i, 1) for i in range(24)] + [("r1", 0, 90)]
    plan += [("r1", 90 + i, 1) for i in range(6)]
    reused = made = 0
    for rid, start, n_q in plan:
        topk = _next_topk(caches, g, rid, start, n_q, old=True)
        before = [t.clone() for t in kv_t._keep]
        _same_step(caches, pages, rid, start, n_q, topk)
        if n_q == 1:
            meta = before[2]
            for pl in range(meta.shape[0]):
                same = all(torch.equal(x[pl], y[pl]) for x, y in zip(before, kv_t._keep))
                reused += same and int(meta[pl, 0]) >= 0
                made += not same
    sa, sb = (kv.stats()["hisparse"] for kv in caches)
    sa.pop("swap_seconds"), sb.pop("swap_seconds")
    assert sa == sb and sa["misses"] > 0
    assert reused > 0 and made > 0, (reused, made)
    for kv in caches:
        kv.close()
