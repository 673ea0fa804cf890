from __future__ import annotations

import numpy as np
import pytest

from longctx.kvstore.allocator import OutOfPages, PageAllocator, PageError
from longctx.kvstore.page_table import PageTableBatch, RequestPages


def _expected_rows(pages: list[int], start: int, end: int, ps: int) -> list[int]:
    return [pages[t // ps] * ps + t % ps for t in range(start, end)]


@pytest.mark.parametrize("n_tokens", [1, 63, 64, 65, 130, 200])
def test_slots_cross_page_boundaries(n_tokens: int):
    a = PageAllocator(10, page_size=64)
    a.alloc(1)  # make the request's pages non-contiguous from 0
    r = RequestPages(64)
    rows = r.append(n_tokens, a)
    assert len(r.pages) == -(-n_tokens // 64) and r.num_tokens == n_tokens
    assert rows.dtype == np.int64
    assert rows.tolist() == _expected_rows(r.pages, 0, n_tokens, 64)
    assert len(set(rows.tolist())) == n_tokens
    # a further append fills the partial page before taking a new one
    more = r.append(70, a)
    assert more.tolist() == _expected_rows(r.pages, n_tokens, n_tokens + 70, 64)
    assert len(r.pages) == -(-(n_tokens + 70) // 64)


def test_ensure_capacity_out_of_pages_allocates_nothing():
    a = PageAllocator(3, page_size=16)
    r = RequestPages(16)
    r.ensure_capacity(20, a)
    assert len(r.pages) == 2 and r.ensure_capacity(32, a) == []
    with pytest.raises(OutOfPages):
        r.append(100, a)
    assert len(r.pages) == 2 and r.num_tokens == 0 and a.num_free == 1
    r.release(a)
    assert a.num_free == 3 and r.pages == []
    r.release(a)  # idempotent
    with pytest.raises(PageError):
        r.slots(0, 1)


def test_append_into_shared_partial_page_refused():
    a = PageAllocator(4, page_size=8)
    r = RequestPages(8)
    r.append(5, a)
    a.incref(r.pages[0])
    with pytest.raises(PageError):
        r.append(1, a)


def test_page_table_batch():
    a = PageAllocator(32, page_size=8)
    r0, r1, r2 = RequestPages(8), RequestPages(8), RequestPages(8)
    r0.append(20, a)  # prefill chunk
    r1.append(9, a)
    r1.append(1, a)  # decode step
    r2.append(3, a)
    b = PageTableBatch.build([r0, r1, r2], [20, 1, 3])
    assert b.page_table.dtype == np.int32 and b.page_table.shape == (3, 3)
    assert b.page_table[0].tolist() == r0.pages
    assert b.page_table[1].tolist() == r1.pages + [-1]
    assert b.page_table[2].tolist() == r2.pages + [-1, -1]
    assert b.seq_lens.dtype == np.int32 and b.seq_lens.tolist() == [20, 10, 3]
    assert b.cu_seqlens_q.tolist() == [0, 20, 21, 24]
    assert b.slot_mapping.dtype == np.int64
    want = (
        _expected_rows(r0.pages, 0, 20, 8)
        + _expected_rows(r1.pages, 9, 10, 8)
        + _expected_rows(r2.pages, 0, 3, 8)
    )
    assert b.slot_mapping.tolist() == want
    assert b.positions.tolist() == list(range(20)) + [9] + [0, 1, 2]
    wide = PageTableBatch.build([r1], [1], max_pages=6)
    assert wide.page_table.shape == (1, 6) and wide.page_table[0, 2:].tolist() == [-1] * 4
    with pytest.raises(PageError):
        PageTableBatch.build([r0], [21])
    empty = PageTableBatch.build([], [])
    assert empty.slot_mapping.shape == (0,) and empty.page_table.shape == (0, 0)
