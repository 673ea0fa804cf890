"""Page allocator: which physical KV pages are free, and how many owners each used page has.

Pure bookkeeping, no tensors (modelled on nano-vllm's `block_manager.py`): the device pool
(`pool.py`) indexes its tensors with the page ids handed out here, and a page's token rows are
`page * page_size + offset`. A page starts with one reference when allocated; the prefix cache
(`prefix_cache.py`) and every request that reuses a cached page each hold one more. The page
returns to the free list when its last reference is dropped.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from longctx.errors import LongctxError, RequestError


class OutOfPages(RequestError):
    """Not enough free KV pages for an allocation; nothing was allocated."""


class PageError(LongctxError, ValueError):
    """A page id that is out of range, free when it should be owned (double free), or the like."""


class PageAllocator:
    """Free list + refcounts over `num_pages` pages of `page_size` token slots each.

    Invariants: `num_free + num_used == num_pages`; a page is on the free list iff its refcount
    is 0; no page is handed out twice while it is in use. Every mutating method either applies
    completely or raises before changing anything.
    """

    def __init__(self, num_pages: int, page_size: int = 64) -> None:
        if num_pages < 0:
            raise PageError(f"num_pages must be >= 0, got {num_pages}")
        if page_size <= 0:
            raise PageError(f"page_size must be > 0, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # FIFO reuse, as nano-vllm: recently freed pages go to the back, which spreads writes.
        self._free: deque[int] = deque(range(num_pages))
        self._ref: list[int] = [0] * num_pages

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    def pages_for(self, n_tokens: int) -> int:
        """Pages needed to hold `n_tokens` token slots."""
        return -(-n_tokens // self.page_size)

    # ---- mutation ------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Take `n` free pages, each with refcount 1. Raises `OutOfPages` (allocating nothing)."""
        if n < 0:
            raise PageError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPages(f"out of KV pages: need {n}, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page (a page may appear k times: k references dropped).

        Pages whose refcount reaches 0 go back to the free list. Raises `PageError` without
        changing anything if any page is free already (double free) or out of range.
        """
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_id(p)
            if self._ref[p] < c:
                raise PageError(f"freeing page {p} {c} time(s) but it has {self._ref[p]} reference(s)")
        for p, c in counts.items():
            self._ref[p] -= c
            if self._ref[p] == 0:
                self._free.append(p)

    def incref(self, page: int) -> int:
        """Add a reference to a page in use (a shared prefix page); returns the new count."""
        self._check_owned(page)
        self._ref[page] += 1
        return self._ref[page]

    def decref(self, page: int) -> int:
        """Drop one reference; the page is freed at 0. Returns the new count."""
        self._check_owned(page)
        self._ref[page] -= 1
        if self._ref[page] == 0:
            self._free.append(page)
        return self._ref[page]

    # ---- checks --------------------------------------------------------------------------
    def _check_id(self, page: int) -> None:
        if not (0 <= page < self.num_pages):
            raise PageError(f"page id {page} out of range [0, {self.num_pages})")

    def _check_owned(self, page: int) -> None:
        self._check_id(page)
        if self._ref[page] == 0:
            raise PageError(f"page {page} is free (not owned by anyone)")

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"used={self.num_used}, free={self.num_free})"
        )
