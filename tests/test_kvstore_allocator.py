from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from longctx.errors import RequestError
from longctx.kvstore.allocator import OutOfPages, PageAllocator, PageError


def test_alloc_free_roundtrip():
    a = PageAllocator(8, page_size=64)
    p = a.alloc(3)
    assert len(set(p)) == 3 and a.num_used == 3 and a.num_free == 5
    assert all(a.refcount(x) == 1 for x in p)
    a.free(p)
    assert a.num_free == 8 and a.num_used == 0
    assert a.alloc(0) == []


def test_out_of_pages_allocates_nothing():
    a = PageAllocator(4)
    a.alloc(3)
    assert not a.can_alloc(2) and a.can_alloc(1)
    with pytest.raises(OutOfPages) as e:
        a.alloc(2)
    assert isinstance(e.value, RequestError) and "\n" not in str(e.value)
    assert a.num_free == 1


def test_double_free_and_unowned_raise_atomically():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free([p[0]])
    with pytest.raises(PageError):
        a.free([p[0]])
    with pytest.raises(PageError):  # p[1] valid but p[0] free: nothing may change
        a.free([p[1], p[0]])
    assert a.refcount(p[1]) == 1
    with pytest.raises(PageError):
        a.free([99])
    with pytest.raises(PageError):
        a.incref(p[0])
    with pytest.raises(PageError):
        a.free([p[1], p[1]])  # one reference, freed twice in one call
    assert a.refcount(p[1]) == 1


def test_refcount_returns_page_at_zero():
    a = PageAllocator(2)
    (p,) = a.alloc(1)
    assert a.incref(p) == 2
    a.free([p])
    assert a.num_free == 1 and a.refcount(p) == 1
    assert a.decref(p) == 0
    assert a.num_free == 2


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/incref/decref against a model of who holds which reference."""

    def __init__(self) -> None:
        super().__init__()
        self.a = PageAllocator(16, page_size=4)
        self.held: list[int] = []  # one entry per reference handed out

    @rule(n=st.integers(0, 20))
    def alloc(self, n: int) -> None:
        if n <= self.a.num_free:
            pages = self.a.alloc(n)
            assert not set(pages) & set(self.held), "page handed out twice"
            assert len(set(pages)) == n
            self.held += pages
        else:
            before = self.a.num_free
            with pytest.raises(OutOfPages):
                self.a.alloc(n)
            assert self.a.num_free == before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        idx = data.draw(st.lists(st.integers(0, len(self.held) - 1), unique=True, max_size=5))
        pages = [self.held[i] for i in idx]
        self.a.free(pages)
        for i in sorted(idx, reverse=True):
            del self.held[i]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(self.held))
        self.a.incref(p)
        self.held.append(p)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.a.decref(self.held.pop(i))

    @rule(page=st.integers(0, 15))
    def free_unowned_raises(self, page: int) -> None:
        if page not in self.held:
            with pytest.raises(PageError):
                self.a.free([page])

    @invariant()
    def consistent(self) -> None:
        a = self.a
        assert a.num_free + a.num_used == a.num_pages
        assert a.num_used == len(set(self.held))
        for p in range(a.num_pages):
            assert a.refcount(p) == self.held.count(p)
        assert len(set(a._free)) == a.num_free
        assert not set(a._free) & set(self.held)


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase
