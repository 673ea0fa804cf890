from __future__ import annotations

import pytest

from longctx.kvstore.allocator import PageAllocator
from longctx.kvstore.page_table import RequestPages
from longctx.kvstore.prefix_cache import PrefixCache, PrefixCacheError, ResetResult

PS = 4


def _prefill(cache: PrefixCache, a: PageAllocator, tokens: list[int]) -> RequestPages:
    """What the scheduler does: reuse cached pages, allocate the rest, register after prefill."""
    pages, n_cached = cache.match(tokens)
    r = RequestPages(PS, pages, n_cached)
    r.append(len(tokens) - n_cached, a)
    cache.insert(tokens, r.pages)
    return r


def test_shared_prefix_shares_pages_and_refcounts():
    a = PageAllocator(32, PS)
    c = PrefixCache(a)
    doc = list(range(100, 112))  # 3 full pages
    r1 = _prefill(c, a, doc + [1, 2, 3])
    assert c.num_cached_pages == 3 and all(a.refcount(p) == 2 for p in r1.pages[:3])
    assert a.refcount(r1.pages[3]) == 1  # partial page never cached
    r2 = _prefill(c, a, doc + [7, 8])
    assert r2.pages[:3] == r1.pages[:3] and r2.pages[3] != r1.pages[3]
    assert all(a.refcount(p) == 3 for p in r1.pages[:3])
    assert c.stats()["hit_tokens"] == 12
    r1.release(a)
    r2.release(a)
    assert all(a.refcount(p) == 1 for p in r1.pages[:3])  # only the cache's reference left
    assert a.num_used == 3 and c.num_cached_pages == 3
    # a diverging middle page stops the chain
    pages, n = c.match(doc[:4] + [0, 0, 0, 0] + doc[8:] + [5])
    assert n == 4 and len(pages) == 1
    a.free(pages)


def test_last_token_rule():
    a = PageAllocator(16, PS)
    c = PrefixCache(a)
    toks = list(range(8))  # exactly 2 full pages
    r = _prefill(c, a, toks)
    assert c.num_cached_pages == 2
    pages, n = c.match(toks)
    assert n == 4 and n < len(toks) and pages == r.pages[:1]
    a.free(pages)
    pages, n = c.match(toks + [9])
    assert n == 8 and pages == r.pages
    a.free(pages)
    assert c.match([]) == ([], 0) and c.match(toks[:1]) == ([], 0)


def test_lru_eviction_order_and_leaves_first():
    a = PageAllocator(16, PS)
    c = PrefixCache(a)
    old = [1] * 8  # 2 pages, chain A
    new = [2] * 8  # 2 pages, chain B
    ra = _prefill(c, a, old + [0])
    rb = _prefill(c, a, new + [0])
    ra.release(a)
    rb.release(a)
    assert a.num_used == 4 and c.num_evictable() == 4
    pa, _ = c.match(old + [0])  # touch A: B is now least recently used
    a.free(pa)
    assert c.evict(1) == 1
    # B's leaf went first; its root survives and still matches; A is untouched
    pb, n = c.match(new + [0])
    assert n == 4 and all(k in c._nodes for k in c.page_keys(old))
    # B's root is referenced by that match: only A's two pages go, leaf before root
    assert c.evict(100) == 2
    assert c.num_cached_pages == 1 and a.num_used == 1
    a.free(pb)
    assert c.evict(100) == 1 and a.num_used == 0


def test_referenced_pages_not_evicted_and_ensure_free():
    a = PageAllocator(6, PS)
    c = PrefixCache(a)
    r = _prefill(c, a, list(range(9)))  # 2 cached pages + 1 partial, all held by r
    assert c.evict(10) == 0 and c.num_evictable() == 0
    r.release(a)
    assert a.num_free == 4 and c.num_evictable() == 2
    assert c.ensure_free(5) and a.num_free == 5 and c.num_cached_pages == 1
    assert not c.ensure_free(7)
    assert c.stats()["evicted_pages"] == 2


def test_pinned_never_evicted():
    a = PageAllocator(16, PS)
    c = PrefixCache(a)
    doc = list(range(50, 62))
    _prefill(c, a, doc + [0]).release(a)
    _prefill(c, a, [9] * 8 + [0]).release(a)
    keys = c.pin_prefix(doc)
    assert len(keys) == 3 and c.stats()["pinned_pages"] == 3
    assert c.evict(100) == 2
    pages, n = c.match(doc + [1])
    assert n == 12
    a.free(pages)
    c.unpin_keys(keys)
    with pytest.raises(PrefixCacheError):
        c.unpin(keys[0])
    # pinning only the last key protects the whole chain (ancestors have a child)
    c.pin(keys[-1])
    assert c.evict(100) == 0
    c.unpin(keys[-1])
    assert c.evict(100) == 3 and a.num_used == 0
    with pytest.raises(PrefixCacheError):
        c.pin(keys[0])


def test_duplicate_insert_and_collision_check():
    a = PageAllocator(16, PS)
    c = PrefixCache(a)
    toks = list(range(8))
    r1 = RequestPages(PS)
    r1.append(8, a)
    r2 = RequestPages(PS)
    r2.append(8, a)
    assert c.insert(toks, r1.pages) == 2
    assert c.insert(toks, r2.pages) == 0  # already cached under r1's pages
    assert all(a.refcount(p) == 1 for p in r2.pages)
    # forge a collision: same key, different stored tokens -> no match
    key0 = c.page_keys(toks)[0]
    c._nodes[key0].tokens = b"\x00" * (8 * PS)
    assert c.match(toks + [1]) == ([], 0)
    with pytest.raises(PrefixCacheError):
        c.insert(toks, r1.pages[:1])


def test_salt_separates_caches():
    a = PageAllocator(16, PS)
    assert PrefixCache(a, b"fp8").page_keys([1] * 4) != PrefixCache(a, b"bf16").page_keys([1] * 4)


def test_extend_registers_a_prefill_chunk_by_chunk_like_insert():
    """`extend` from the last chunk's state gives the cache `insert` of the whole prompt gives (keys, pages,
    references, children), hashing each page once; a state whose last page was evicted starts over."""
    import random

    rng = random.Random(5)
    tokens = [rng.randrange(1000) for _ in range(PS * 9 + 2)]
    a1, a2 = PageAllocator(32, PS), PageAllocator(32, PS)
    whole, chunked = PrefixCache(a1), PrefixCache(a2)
    r1, r2 = RequestPages(PS, [], 0), RequestPages(PS, [], 0)
    r1.append(len(tokens), a1)
    r2.append(len(tokens), a2)
    whole.insert(tokens, r1.pages)
    state: tuple[int, bytes | None] = (0, None)
    for end in (3, 9, 17, 20, 30, len(tokens)):  # chunk ends, in tokens
        n = end // PS
        state = chunked.extend(tokens, r2.pages, *state, n_pages=n)  # (as the scheduler calls it)
        assert state[0] == n
    assert whole.page_keys(tokens) == chunked.page_keys(tokens) and state[1] == chunked.page_keys(tokens)[-1]
    for c, a, r in ((whole, a1, r1), (chunked, a2, r2)):
        assert c.num_cached_pages == 9 and all(a.refcount(p) == 2 for p in r.pages[:9])
    assert sorted(n.children for n in whole._nodes.values()) == sorted(
        n.children for n in chunked._nodes.values()
    )
    pages, hit = chunked.match(tokens)
    assert hit == 9 * PS and pages == r2.pages[:9]
    a2.free(pages)
    # the request goes (its pages stay cached), everything is evicted, and a stale state starts over
    r2.release(a2)
    assert chunked.evict(9) == 9 and chunked.num_cached_pages == 0
    r3 = RequestPages(PS, [], 0)
    r3.append(len(tokens), a2)
    assert chunked.extend(tokens[: 9 * PS], r3.pages[:9], *state) == state  # (the same keys again)
    assert chunked.num_cached_pages == 9


def test_reset_frees_every_unheld_chain_from_its_leaves_up():
    """`reset` drops every page nobody holds, parents once their children are gone (one chain registered chunk
    by chunk has its leaves newer than its root: a second pass frees the root's half), back to the allocator;
    it counts them as reset, not evicted, and leaves the hit counters alone."""
    a = PageAllocator(32, PS)
    c = PrefixCache(a)
    root = [7] * 8  # 2 pages, shared by two branches
    _prefill(c, a, root + [1] * 8 + [0]).release(a)  # 4 pages
    _prefill(c, a, root + [2] * 4 + [0]).release(a)  # the root's 2 pages reused, 1 more
    chunked = [3] * 16
    r = RequestPages(PS)
    r.append(len(chunked), a)
    state = c.extend(chunked, r.pages, 0, None, n_pages=2)
    c.extend(chunked, r.pages, *state, n_pages=4)  # (pages 2-3 now newer than 0-1)
    r.release(a)
    assert c.num_cached_pages == 9 and a.num_free == 32 - 9
    hits = c.stats()["hit_tokens"]
    assert hits == 8 and c.reset() == ResetResult(freed_pages=9, kept_pages=0)
    assert a.num_free == 32 and c.num_cached_pages == 0
    st = c.stats()
    assert (st["reset_pages"], st["evicted_pages"], st["hit_tokens"]) == (9, 0, hits)
    assert c.match(root + [1] * 8 + [0]) == ([], 0)
    assert c.reset() == ResetResult(0, 0)


def test_reset_keeps_pinned_chains_and_pages_a_request_holds():
    """A pinned document's chain and the pages a running request took from the cache stay (their KV still
    valid); a branch beyond the request's pages and a chain nobody holds go. Once released, they go too."""
    a = PageAllocator(32, PS)
    c = PrefixCache(a)
    doc = [5] * 12  # 3 pages, pinned
    _prefill(c, a, doc + [0]).release(a)
    keys = c.pin_prefix(doc)
    shared = [6] * 8  # 2 pages a running request holds, and a third page past them nobody does
    _prefill(c, a, shared + [1] * 4 + [0]).release(a)
    held, n = c.match(shared + [0])
    assert n == 8
    _prefill(c, a, [4] * 8 + [0]).release(a)  # 2 pages nobody holds
    free = a.num_free
    assert c.reset() == ResetResult(freed_pages=3, kept_pages=5)
    assert a.num_free == free + 3 and all(a.refcount(p) == 2 for p in held)
    pages, n = c.match(doc + [0])
    assert n == 12  # the document still hits
    a.free(pages)
    a.free(held)  # the request ends, the document is unpinned: nothing holds the rest
    c.unpin_keys(keys)
    assert c.reset() == ResetResult(freed_pages=5, kept_pages=0) and a.num_free == 32
