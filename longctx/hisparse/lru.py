"""HiSparse bookkeeping without tensors: one LRU of device token slots per (request, layer).

This is the policy's specification. `longctx.hisparse.cache` runs the same policy with vectorised
device tensors (no host round trip per layer); the tests check both against the invariants below.

A `SlotLRU` owns `capacity` device slots (0 .. capacity-1) and maps logical token positions of one
request to them. Each step the caller says which positions it needs (`access`) and where the newest
tokens begin (`newest_from`); the LRU answers which were already resident (hits, never copied),
which must be copied in and into which slot (misses), and which residents were evicted for them.

Invariants (after every call):
- at most `capacity` positions are resident, each in its own slot;
- a position requested in the current step is never evicted in that step (`access` may be called
  several times per step: all positions requested since `begin_step` are protected);
- positions >= `newest_from` that are resident are never evicted (the newest tokens stay);
- after `access`, every requested position is resident, unless the step needs more distinct
  positions than there are evictable slots: the rest are returned as `overflow` (the caller then
  serves them from a per-step buffer; they do not become resident).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Access:
    """What one `access` decided. Positions are logical token positions of the request."""

    hits: tuple[int, ...]  # already resident: nothing to copy
    misses: tuple[tuple[int, int], ...]  # (position, slot): copy position's row into slot
    evicted: tuple[tuple[int, int], ...]  # (position, slot) dropped to make room
    overflow: tuple[int, ...] = ()  # requested but not placed (no evictable slot left)
    refreshed: tuple[tuple[int, int], ...] = field(default=())  # forced copies into resident slots


class SlotLRU:
    """LRU over `capacity` device slots for one (request, layer)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # position -> slot, LRU first
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self._protected: set[int] = set()
        self.newest_from = 0

    # ---- queries -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, pos: int) -> bool:
        return pos in self._slot_of

    def slot(self, pos: int) -> int | None:
        return self._slot_of.get(pos)

    def resident(self) -> dict[int, int]:
        """position -> slot of every resident position."""
        return dict(self._slot_of)

    def lru_order(self) -> list[int]:
        """Resident positions, least recently used first."""
        return list(self._slot_of)

    # ---- updates -------------------------------------------------------------------------------
    def begin_step(self, newest_from: int) -> None:
        """Start a step: positions >= newest_from are the newest tokens (never evicted)."""
        self._protected.clear()
        self.newest_from = newest_from

    def access(self, positions: Iterable[int], force: Iterable[int] = ()) -> Access:
        """Make `positions` resident (most recently used), evicting LRU victims for misses.

        `force`: positions whose row changed on the host (fresh writes): copied even if resident.
        Negative positions (top-k padding) are ignored; duplicates count once.
        """
        want = list(dict.fromkeys(p for p in positions if p >= 0))
        forced = {p for p in force if p >= 0}
        want += [p for p in forced if p not in set(want)]
        self._protected.update(want)
        hits: list[int] = []
        refreshed: list[tuple[int, int]] = []
        need: list[int] = []
        for p in want:
            s = self._slot_of.get(p)
            if s is None:
                need.append(p)
                continue
            self._slot_of.move_to_end(p)
            if p in forced:
                refreshed.append((p, s))
            else:
                hits.append(p)
        misses: list[tuple[int, int]] = []
        evicted: list[tuple[int, int]] = []
        overflow: list[int] = []
        victims = (v for v in list(self._slot_of) if v not in self._protected and v < self.newest_from)
        for p in need:
            if self._free:
                s = self._free.pop()
            else:
                v = next(victims, None)
                if v is None:
                    overflow.append(p)
                    continue
                s = self._slot_of.pop(v)
                evicted.append((v, s))
            self._slot_of[p] = s
            misses.append((p, s))
        return Access(tuple(hits), tuple(misses), tuple(evicted), tuple(overflow), tuple(refreshed))

    def clear(self) -> list[int]:
        """Drop every resident position (request finished or restarted); returns the freed slots."""
        freed = sorted(self._slot_of.values())
        self._slot_of.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._protected.clear()
        return freed
