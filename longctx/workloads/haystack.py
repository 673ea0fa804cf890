"""Haystacks as endless streams of pieces, with running token counts.

A haystack is cut from a stream of *records* (sentences, noise lines, distractor needles,
documents). Each record is split into *pieces* (a word with its leading separator) so a haystack
can be cut at word granularity, which is what lets a prompt land within 2% of its target length
even at 4K tokens with byte-level tokens. Token counts are kept per piece (memoised by text) and
summed, so the length of a million-token haystack of n pieces is known without tokenizing it:
`estimate(n)` is a prefix sum. Needles and documents are inserted only at record boundaries.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from itertools import accumulate

from longctx.workloads.tokens import PieceCache

_PIECE = re.compile(r"\s*\S+")


def split_pieces(text: str) -> list[str]:
    """'a b\\nc' -> ['a', ' b', '\\nc']: each word keeps the whitespace before it."""
    pieces = _PIECE.findall(text)
    tail = text[sum(map(len, pieces)) :]
    if tail:
        if pieces:
            pieces[-1] += tail
        else:
            pieces.append(tail)
    return pieces


class PieceStream:
    """An endless text made of records, each given as its text (with its leading separator)."""

    def __init__(self, records: Iterator[str], cache: PieceCache) -> None:
        self._records = records
        self._cache = cache
        self.pieces: list[str] = []
        self.prefix: list[int] = [0]  # prefix[n] = tokens of pieces[:n]
        self.record_ends: list[int] = []  # piece index just past each record

    def _grow(self, records: int) -> None:
        new: list[str] = []
        for _ in range(records):
            rec = split_pieces(next(self._records))
            new.extend(rec)
            self.record_ends.append(len(self.pieces) + len(new))
        self.pieces.extend(new)
        counts = self._cache.counts(new)
        self.prefix.extend(accumulate(counts, initial=self.prefix[-1]))
        del self.prefix[-len(counts) - 1]  # accumulate repeats the initial value

    def ensure(self, n: int) -> None:
        """Make at least `n` pieces available."""
        while len(self.pieces) < n:
            self._grow(max(16, len(self.record_ends) // 2))

    def estimate(self, n: int) -> int:
        """Tokens of the first `n` pieces (sum of per-piece counts)."""
        self.ensure(n)
        return self.prefix[n]

    def pieces_for(self, tokens: int) -> int:
        """The smallest n with estimate(n) >= tokens."""
        while self.prefix[-1] < tokens:
            self.ensure(len(self.pieces) + 1)
        return bisect.bisect_left(self.prefix, tokens)

    def text(self, start: int, stop: int) -> str:
        self.ensure(stop)
        return "".join(self.pieces[start:stop])

    def boundaries(self, n: int) -> list[int]:
        """Record boundaries within the first n pieces (0 and n included)."""
        self.ensure(n)
        ends = self.record_ends[: bisect.bisect_right(self.record_ends, n)]
        out = [0] + [e for e in ends if 0 < e < n] + [n]
        return out


def insert_at_boundaries(
    stream: PieceStream, n: int, inserts: list[str], positions: list[int], sep: str = " "
) -> str:
    """The first n pieces with `inserts[i]` placed before piece `positions[i]` (record boundaries).

    Each insert is written as `sep + insert` and the following haystack text keeps its own
    leading separator, so an insert at position 0 starts the text.
    """
    order = sorted(range(len(inserts)), key=lambda i: positions[i])
    out: list[str] = []
    last = 0
    for i in order:
        p = positions[i]
        out.append(stream.text(last, p))
        out.append((sep if out and out[-1] or p > 0 else "") + inserts[i])
        last = p
    rest = stream.text(last, n)
    if rest and not rest[0].isspace() and out:
        rest = sep + rest
    out.append(rest)
    return "".join(out)
