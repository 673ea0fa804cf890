"""Prefix cache over full KV pages: requests sharing a prompt prefix share its pages.

Each full page of a prompt has a chain key `key_i = blake2b(key_{i-1} || int64 bytes of page
i's tokens)`, so a key names the whole prefix up to and including that page (a radix tree
flattened into a dict). The cache holds one allocator reference per cached page; a request that
reuses a page holds another. Only pages nobody else references (refcount 1), that are not pinned
and that have no cached child page are evictable, least recently used first — evicting leaves
first keeps every cached chain reachable from its root; `reset` drops all of them at once (a cold
cache between benchmark runs). Pure bookkeeping: no tensors.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longctx.errors import LongctxError
from longctx.kvstore.allocator import PageAllocator


class PrefixCacheError(LongctxError, ValueError):
    """A pin/unpin of a key the cache does not hold, or inconsistent insert arguments."""


@dataclass
class _Node:
    key: bytes
    parent: bytes | None  # key of the previous page, None for a prompt's first page
    tokens: bytes  # int64 bytes of this page's tokens, compared on lookup to rule out collisions
    page: int
    children: int = 0
    pins: int = 0


@dataclass(frozen=True)
class ResetResult:
    """What `PrefixCache.reset` did: pages it dropped, and pages that stay cached (pinned, or held by a
    running request, or an ancestor of such a page)."""

    freed_pages: int
    kept_pages: int


class PrefixCache:
    """Maps chain keys of full pages to physical pages held in `allocator`.

    `salt` separates caches whose KV differ for the same tokens (model, kv dtype, LoRA, ...).
    """

    def __init__(self, allocator: PageAllocator, salt: bytes = b"") -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._salt = salt
        # LRU order, oldest first. A touch moves a whole chain, leaf first, so ancestors are
        # always more recent than their descendants and one pass evicts leaves before parents.
        self._nodes: OrderedDict[bytes, _Node] = OrderedDict()
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evicted_pages = 0
        self.reset_pages = 0

    # ---- keys ----------------------------------------------------------------------------
    def _chunks(self, tokens: Sequence[int] | np.ndarray, n_pages: int, start: int = 0) -> list[bytes]:
        """int64 bytes of full pages start..n_pages-1 of `tokens` (only those are converted)."""
        ps = self.page_size
        arr = np.asarray(tokens[start * ps : n_pages * ps], dtype=np.int64)
        return [arr[i * ps : (i + 1) * ps].tobytes() for i in range(n_pages - start)]

    def _key(self, prev: bytes, chunk: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(prev)
        h.update(chunk)
        return h.digest()

    def page_keys(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chain keys of every full page of `tokens`."""
        keys, prev = [], self._salt
        for chunk in self._chunks(tokens, len(tokens) // self.page_size):
            prev = self._key(prev, chunk)
            keys.append(prev)
        return keys

    def _walk(self, tokens: Sequence[int] | np.ndarray, n_pages: int) -> list[_Node]:
        """Cached nodes of the longest cached chain within the first `n_pages` pages."""
        nodes, prev = [], self._salt
        for chunk in self._chunks(tokens, n_pages):
            prev = self._key(prev, chunk)
            node = self._nodes.get(prev)
            if node is None or node.tokens != chunk:
                break
            nodes.append(node)
        return nodes

    def _touch(self, nodes: list[_Node]) -> None:
        for node in reversed(nodes):
            self._nodes.move_to_end(node.key)

    # ---- lookup / insert -----------------------------------------------------------------
    def match(self, tokens: Sequence[int] | np.ndarray) -> tuple[list[int], int]:
        """Longest cached run of full pages prefixing `tokens`: (pages, n_cached_tokens).

        The caller gets one reference to each returned page (drop it with `allocator.free`).
        At least one token is always left uncached (`n_cached_tokens < len(tokens)`) so the
        request still computes the logits of its last prompt token.
        """
        nodes = self._walk(tokens, max(len(tokens) - 1, 0) // self.page_size)
        for node in nodes:
            self.allocator.incref(node.page)
        self._touch(nodes)
        n_cached = len(nodes) * self.page_size
        self.query_tokens += len(tokens)
        self.hit_tokens += n_cached
        return [n.page for n in nodes], n_cached

    def cached_tokens(self, tokens: Sequence[int] | np.ndarray) -> int:
        """The tokens `match` would serve from the cache, without taking references, touching the pages
        or counting a query (the priority scheduler's estimate of a waiting request's pages)."""
        return len(self._walk(tokens, max(len(tokens) - 1, 0) // self.page_size)) * self.page_size

    def insert(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int]) -> int:
        """Register the full pages of a prefilled request; returns how many pages were new.

        `pages[i]` must hold the KV of tokens[i*page_size:(i+1)*page_size]. The cache takes one
        reference to each page it registers. A page whose prefix is already cached under
        another physical page is skipped (the request keeps its duplicate to itself).
        """
        return self._insert(tokens, pages, 0, None)[0]

    def extend(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[int],
        start: int,
        prev: bytes | None,
        n_pages: int | None = None,
    ) -> tuple[int, bytes | None]:
        """`insert` of a prefill in progress, from full page `start` on, whose page start - 1 was registered
        under chain key `prev` by the call before (start 0, prev None: the first call), so each page is
        hashed once however many chunks the prefill takes. Returns (pages registered in all, the last one's
        key) for the next call; (start, prev) again when a hash collision ended the chain. If `prev` is no
        longer cached, the whole prefix is registered again (the keys are the same). `n_pages`: only the
        first n_pages full pages of `tokens` (a 1M prompt is not sliced at every chunk)."""
        if start and (prev is None or prev not in self._nodes):
            start, prev = 0, None
        _, done, last = self._insert(tokens, pages, start, prev, n_pages)
        return done, last

    def _insert(
        self,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[int],
        start: int,
        prev_key: bytes | None,
        n_pages: int | None = None,
    ) -> tuple[int, int, bytes | None]:
        """(pages added, full pages registered from 0, the last registered key). Touches only the pages
        it walks: a resumed chain's older pages stay behind in LRU order (the request holds them;
        `evict` takes several passes when a descendant is older than its ancestor)."""
        full = len(tokens) // self.page_size
        n_pages = full if n_pages is None else min(n_pages, full)
        if len(pages) < n_pages:
            raise PrefixCacheError(f"{n_pages} full pages of tokens but only {len(pages)} pages given")
        parent = self._nodes[prev_key] if prev_key is not None else None
        chain: list[_Node] = []
        prev, added, done = prev_key or self._salt, 0, start
        for i, chunk in enumerate(self._chunks(tokens, n_pages, start), start):
            key = self._key(prev, chunk)
            node = self._nodes.get(key)
            up = chain[-1] if chain else parent
            if node is None:
                self.allocator.incref(pages[i])
                node = _Node(key=key, parent=up.key if up else None, tokens=chunk, page=pages[i])
                self._nodes[key] = node
                if up:
                    up.children += 1
                added += 1
            elif node.tokens != chunk:
                break  # hash collision: leave the rest of this prompt uncached
            chain.append(node)
            prev, done = key, i + 1
        self._touch(chain)
        return added, done, (chain[-1].key if chain else prev_key)

    # ---- pinning -------------------------------------------------------------------------
    def pin(self, key: bytes) -> None:
        """Keep the page under `key` (and, through it, its ancestors) from being evicted."""
        node = self._nodes.get(key)
        if node is None:
            raise PrefixCacheError(f"cannot pin key {key.hex()}: not cached")
        node.pins += 1

    def unpin(self, key: bytes) -> None:
        node = self._nodes.get(key)
        if node is None or node.pins == 0:
            raise PrefixCacheError(f"cannot unpin key {key.hex()}: not pinned")
        node.pins -= 1

    def pin_prefix(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Pin every cached full page prefixing `tokens` (a document); returns the pinned keys."""
        nodes = self._walk(tokens, len(tokens) // self.page_size)
        for node in nodes:
            node.pins += 1
        return [n.key for n in nodes]

    def unpin_keys(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.unpin(key)

    # ---- eviction ------------------------------------------------------------------------
    def _evictable(self, node: _Node) -> bool:
        return node.children == 0 and node.pins == 0 and self.allocator.refcount(node.page) == 1

    def evict(self, n_pages: int) -> int:
        """Free up to `n_pages` unreferenced, unpinned leaf pages, LRU first; returns the count."""
        freed = self._drop(n_pages)
        self.evicted_pages += freed
        return freed

    def reset(self) -> ResetResult:
        """Drop every page `evict` could reach, chains cascading from their leaves up (vLLM's
        `reset_prefix_cache`, SGLang's `/flush_cache`: the next prompt is prefilled cold). Pinned pages,
        pages a running request holds and their ancestors stay, still valid for that request or document.

        Counted in `reset_pages`, not `evicted_pages`: that one says how often the pool ran out of room,
        and a benchmark's deliberate flush would read as cache pressure there. `hit_tokens` and
        `query_tokens` stay cumulative."""
        freed = self._drop(len(self._nodes))
        self.reset_pages += freed
        return ResetResult(freed, len(self._nodes))

    def _drop(self, n_pages: int) -> int:
        """Free up to `n_pages` evictable pages, LRU first, passing again while a pass frees a page (its
        parent may have become a leaf); returns the count."""
        freed = 0
        progress = True
        while freed < n_pages and progress:
            progress = False
            for node in list(self._nodes.values()):
                if freed >= n_pages:
                    break
                if not self._evictable(node):
                    continue
                del self._nodes[node.key]
                if node.parent is not None:
                    self._nodes[node.parent].children -= 1
                self.allocator.decref(node.page)
                freed += 1
                progress = True
        return freed

    def num_evictable(self) -> int:
        """Pages `evict` could free right now (leaves, and parents that become leaves)."""
        children = {k: n.children for k, n in self._nodes.items()}
        count = 0
        # LRU order lists descendants before ancestors, so one pass sees every cascade.
        for node in self._nodes.values():
            if children[node.key] == 0 and node.pins == 0 and self.allocator.refcount(node.page) == 1:
                count += 1
                if node.parent is not None:
                    children[node.parent] -= 1
        return count

    def ensure_free(self, n_pages: int) -> bool:
        """Evict until the allocator has `n_pages` free pages; False if it cannot get there."""
        short = n_pages - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.num_free >= n_pages

    # ---- stats ---------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return len(self._nodes)

    def stats(self) -> dict[str, int]:
        return {
            "cached_pages": len(self._nodes),
            "pinned_pages": sum(1 for n in self._nodes.values() if n.pins),
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "evicted_pages": self.evicted_pages,
            "reset_pages": self.reset_pages,
        }
