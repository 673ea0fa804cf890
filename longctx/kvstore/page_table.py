"""Per-request page lists and the per-batch index arrays the attention kernels read.

A request's token `t` lives in physical token row `pages[t // page_size] * page_size + t % page_size`
of every layer's pool tensor. `RequestPages` is bookkeeping only; `PageTableBatch` packs a batch
into numpy arrays (the caller moves them to torch / the device).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longctx.kvstore.allocator import PageAllocator, PageError


class RequestPages:
    """The pages one request owns (one reference each) and how many tokens they hold.

    `num_tokens` counts tokens whose KV slot is assigned (written or being written this step).
    Pages that came from the prefix cache are full and shared, so new tokens never land in
    them: a cached prefix always ends on a page boundary.

    Within one `epoch` (a number unique to this object) the page list only grows at its end, so a
    consumer that has seen the first n pages of (epoch) needs only the new ones (`DecodeGraphs`
    keeps its device page tables that way). `as_tuple()` is cached until the list changes.
    """

    _epochs = itertools.count(1)

    def __init__(self, page_size: int, pages: Sequence[int] = (), num_tokens: int = 0) -> None:
        if num_tokens > len(pages) * page_size or num_tokens < 0:
            raise PageError(f"{num_tokens} tokens do not fit in {len(pages)} pages of {page_size}")
        self.page_size = page_size
        self.pages: list[int] = list(pages)
        self.num_tokens = num_tokens
        self.epoch = next(self._epochs)
        self._tuple: tuple[int, ...] | None = None

    def as_tuple(self) -> tuple[int, ...]:
        """The pages as a tuple, rebuilt only after they changed (O(1) on most decode steps)."""
        if self._tuple is None or len(self._tuple) != len(self.pages):
            self._tuple = tuple(self.pages)
        return self._tuple

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def ensure_capacity(self, n_tokens: int, allocator: PageAllocator) -> list[int]:
        """Allocate whole pages until `n_tokens` slots fit; returns the new pages.

        Raises `OutOfPages` (allocating nothing) when the allocator is short.
        """
        if allocator.page_size != self.page_size:
            raise PageError(f"allocator page size {allocator.page_size} != request's {self.page_size}")
        need = self._missing(n_tokens)
        if need <= 0:
            return []
        new = allocator.alloc(need)
        self.pages.extend(new)
        self._tuple = None
        return new

    def pages_missing(self, n_new: int) -> int:
        """Pages to allocate before `n_new` more tokens fit (<= 0: they already do)."""
        return self._missing(self.num_tokens + n_new)

    def _missing(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size) - len(self.pages)

    def append(self, n_new: int, allocator: PageAllocator) -> np.ndarray:
        """Assign slots to `n_new` more tokens (allocating pages); returns their rows (int64)."""
        start = self.num_tokens
        self.grow(n_new, allocator)
        return self.slots(start, start + n_new)

    def grow(self, n_new: int, allocator: PageAllocator) -> None:
        """`append` without computing the rows (the scheduler's per-step call)."""
        if n_new < 0:
            raise PageError(f"cannot append {n_new} tokens")
        start = self.num_tokens
        if start % self.page_size and allocator.refcount(self.pages[start // self.page_size]) != 1:
            # Writing into a page someone else also reads would corrupt their prefix.
            raise PageError(f"page {self.pages[start // self.page_size]} is shared; cannot append into it")
        self.ensure_capacity(start + n_new, allocator)
        self.num_tokens = start + n_new

    def slots(self, start: int, end: int) -> np.ndarray:
        """Physical token rows of tokens [start, end) as int64."""
        if not (0 <= start <= end <= self.capacity):
            raise PageError(f"token range [{start}, {end}) outside capacity {self.capacity}")
        t = np.arange(start, end, dtype=np.int64)
        first = start // self.page_size  # only the pages the range touches: O(range), not O(context)
        pages = np.asarray(self.pages[first : -(-end // self.page_size)], dtype=np.int64)
        return pages[t // self.page_size - first] * self.page_size + t % self.page_size

    def release(self, allocator: PageAllocator) -> None:
        """Drop this request's reference to every page (idempotent)."""
        allocator.free(self.pages)
        self.pages, self.num_tokens = [], 0
        self.epoch, self._tuple = next(self._epochs), None  # a new list from here on

    def __repr__(self) -> str:
        return f"RequestPages(num_tokens={self.num_tokens}, pages={len(self.pages)})"


@dataclass(frozen=True)
class PageTableBatch:
    """Index arrays for one forward over a batch of B requests (numpy; caller converts).

    page_table   int32 [B, max_pages]  page ids, padded with -1
    seq_lens     int32 [B]             tokens in the cache after this step (incl. new ones)
    cu_seqlens_q int32 [B+1]           prefix sums of the new-token counts
    positions    int64 [T]             absolute position of each new token (T = total new)
    slot_mapping int64 [T]             physical row each new token's KV is written to
    """

    page_table: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray

    @classmethod
    def build(
        cls, requests: Sequence[RequestPages], num_new: Sequence[int], max_pages: int | None = None
    ) -> PageTableBatch:
        """Pack `requests` whose last `num_new[i]` tokens are this step's new tokens.

        Call after `RequestPages.append` so `num_tokens` already counts the new tokens.
        `max_pages` pads the table to a fixed width (e.g. for CUDA graphs).
        """
        if len(requests) != len(num_new):
            raise PageError(f"{len(requests)} requests but {len(num_new)} new-token counts")
        width = max((len(r.pages) for r in requests), default=0)
        if max_pages is not None:
            if max_pages < width:
                raise PageError(f"max_pages {max_pages} < {width} pages in the batch")
            width = max_pages
        table = np.full((len(requests), width), -1, dtype=np.int32)
        seq_lens = np.empty(len(requests), dtype=np.int32)
        cu = np.zeros(len(requests) + 1, dtype=np.int32)
        positions, slots = [], []
        for i, (r, n) in enumerate(zip(requests, num_new)):
            if not (0 <= n <= r.num_tokens):
                raise PageError(f"request {i}: {n} new tokens but it holds {r.num_tokens}")
            table[i, : len(r.pages)] = r.pages
            seq_lens[i] = r.num_tokens
            cu[i + 1] = cu[i] + n
            positions.append(np.arange(r.num_tokens - n, r.num_tokens, dtype=np.int64))
            slots.append(r.slots(r.num_tokens - n, r.num_tokens))
        empty = np.empty(0, dtype=np.int64)
        return cls(
            page_table=table,
            seq_lens=seq_lens,
            cu_seqlens_q=cu,
            positions=np.concatenate(positions) if positions else empty,
            slot_mapping=np.concatenate(slots) if slots else empty,
        )
