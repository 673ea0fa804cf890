"""Regular expressions over UTF-8 bytes compiled to a DFA, for guided decoding (`longctx.engine.guided`).

A pattern matches the whole output (as `re.fullmatch`), read as UTF-8 bytes: a character of the pattern is
its byte sequence, a class or `.` any one character's sequence, so a token that holds part of a character
walks the automaton like any other. The syntax is Python's `re` without what a finite automaton cannot
hold or what needs a text position rather than bytes:

  * literals, escapes of punctuation, `\\n \\t \\r \\f \\v \\a \\0`, `\\xhh`, `\\uhhhh`, `\\Uhhhhhhhh`;
  * `.` (any character but a newline), classes `[...]` / `[^...]` with ranges, `\\d \\w \\s` and their
    negations (ASCII meanings: `\\w` is `[A-Za-z0-9_]`; a negated class or escape matches every non-ASCII
    character), non-ASCII characters and ranges in a class that is not negated;
  * groups `(...)`, `(?:...)`, `(?P<name>...)`, `(?<name>...)`; alternation `|`; quantifiers `* + ?
    {n} {n,} {n,m} {,m}`, lazy ones (`*?` ...) as the greedy ones (the same language);
  * `^` at the start and `$` at the end (a match is always whole).

Refused with a `RegexError` saying what: backreferences, lookarounds, word boundaries, inline flags,
possessive quantifiers, a negated class naming non-ASCII characters, groups nested past MAX_GROUP_DEPTH, and
patterns whose automaton passes MAX_NFA_STATES / MAX_DFA_STATES.

`compile_regex(pattern)` gives a `DFA`: `trans` int32 [S, 256] (next state by byte, -1 where the output
could no longer match: states from which no match can be completed are pruned to -1 too), `accept` bool
[S] (the bytes so far are a match), start state 0. It is built by subset construction over byte classes
(the bytes no part of the pattern tells apart move together), then minimised (Moore's refinement, when it
settles within MINIMISE_ROUNDS rounds).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from longctx.errors import LongctxError

MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000
MAX_REPEAT = 10_000  # a counted repetition's bound
MINIMISE_ROUNDS = 64
MAX_GROUP_DEPTH = 100  # groups within groups (the parser and the automaton builder recurse through them)
ASCII = (1 << 128) - 1
NEWLINE = 1 << 10
MAX_CODEPOINT = 0x10FFFF


class RegexError(LongctxError, ValueError):
    """A pattern guided decoding cannot compile (one line: what, and where)."""


@dataclass(frozen=True)
class DFA:
    trans: np.ndarray  # int32 [S, 256], -1: no match possible
    accept: np.ndarray  # bool [S]

    @property
    def num_states(self) -> int:
        return int(self.trans.shape[0])

    def walk(self, state: int, data: bytes) -> int:
        """The state after `data` from `state` (-1 once no match is possible)."""
        for b in data:
            if state < 0:
                break
            state = int(self.trans[state, b])
        return state


# ---- syntax tree: ("set", byte mask) | ("seq", [nodes]) | ("alt", [nodes]) | ("rep", node, lo, hi) -------
Node = tuple


def _byte_set(lo: int, hi: int) -> int:
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


def _utf8_ranges(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Byte-range sequences matching exactly the UTF-8 encodings of code points lo..hi (surrogates
    excluded): each sequence a list of (first byte, last byte) per position."""
    out: list[list[tuple[int, int]]] = []
    todo = []
    if lo < 0xD800:
        todo.append((lo, min(hi, 0xD7FF)))
    if hi > 0xDFFF:
        todo.append((max(lo, 0xE000), hi))
    while todo:
        a, b = todo.pop()
        if a > b:
            continue
        split = next((x for x in (0x7F, 0x7FF, 0xFFFF) if a <= x < b), None)
        if split is not None:  # one encoded length at a time
            todo += [(a, split), (split + 1, b)]
            continue
        for i in (1, 2, 3):  # until every position but the first is a whole or an aligned continuation range
            m = (1 << (6 * i)) - 1
            if a & ~m != b & ~m:
                if a & m:
                    todo += [(a, a | m), ((a | m) + 1, b)]
                    break
                if b & m != m:
                    todo += [(a, (b & ~m) - 1), (b & ~m, b)]
                    break
        else:
            out.append(list(zip(chr(a).encode(), chr(b).encode(), strict=True)))
    return out


def _ranges_node(ranges: list[tuple[int, int]]) -> Node:
    alts: list[Node] = []
    for lo, hi in ranges:
        for seq in _utf8_ranges(lo, hi):
            alts.append(("seq", [("set", _byte_set(a, b)) for a, b in seq]))
    return ("alt", alts)


def _literal(ch: str) -> Node:
    return ("seq", [("set", 1 << b) for b in ch.encode("utf-8", "surrogatepass")])


@dataclass
class _Class:
    """A set of characters: ASCII ones as a bit mask, others as code point ranges or all of them."""

    ascii: int = 0
    ranges: list[tuple[int, int]] | None = None
    all_other: bool = False

    def add_range(self, lo: int, hi: int) -> None:
        if lo < 0x80:
            self.ascii |= _byte_set(lo, min(hi, 0x7F))
        if hi >= 0x80:
            self.ranges = (self.ranges or []) + [(max(lo, 0x80), hi)]

    def merge(self, other: _Class) -> None:
        self.ascii |= other.ascii
        if other.ranges:
            self.ranges = (self.ranges or []) + other.ranges
        self.all_other |= other.all_other

    def negated(self, where: str) -> _Class:
        if self.ranges and not self.all_other:
            raise RegexError(
                f"a negated character class with non-ASCII characters is not supported ({where})"
            )
        return _Class(ascii=ASCII & ~self.ascii, all_other=not self.all_other)

    def node(self) -> Node:
        alts: list[Node] = [("set", self.ascii)] if self.ascii else []
        if self.all_other:
            alts.append(_ranges_node([(0x80, MAX_CODEPOINT)]))
        elif self.ranges:
            alts.append(_ranges_node(self.ranges))
        return ("alt", alts)


def _class_of(kind: str) -> _Class:
    c = _Class()
    low = kind.lower()
    if low == "d":
        c.add_range(ord("0"), ord("9"))
    elif low == "w":
        for a, b in ("az", "AZ", "09", "__"):
            c.add_range(ord(a), ord(b))
    else:  # s
        for ch in " \t\n\r\f\v":
            c.add_range(ord(ch), ord(ch))
    return c.negated("") if kind.isupper() else c


_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}


class _Parser:
    def __init__(self, pattern: str, raw: Mapping[str, int] | None = None) -> None:
        self.p = pattern
        self.i = 0
        self.depth = 0  # groups open
        self.raw = raw or {}

    def error(self, what: str, at: int | None = None) -> RegexError:
        return RegexError(f"{what} at position {self.i if at is None else at} of the pattern")

    def peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def take(self) -> str:
        ch = self.peek()
        self.i += 1
        return ch

    def parse(self) -> Node:
        node = self.alternation()
        if self.i < len(self.p):
            raise self.error("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> Node:
        items: list[Node] = []
        while self.i < len(self.p) and self.peek() not in "|)":
            atom = self.atom()
            quant = self.quantifier()
            items.append(atom if quant is None else ("rep", atom, *quant))
        return ("seq", items)

    def quantifier(self) -> tuple[int, int | None] | None:
        ch = self.peek()
        q: tuple[int, int | None] | None
        if ch in ("*", "+", "?"):
            self.i += 1
            q = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        else:
            q = self.braces() if ch == "{" else None
        if q is None:
            return None
        if self.peek() == "?":  # lazy: the same language
            self.i += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifiers are not supported")
        lo, hi = q
        if lo > MAX_REPEAT or (hi is not None and hi > MAX_REPEAT):
            raise self.error(f"a repetition bound above {MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise self.error("min repeat greater than max repeat")
        if self.peek() in ("*", "+", "?") and self.peek() or self.braces(look=True):
            raise self.error("multiple repeat")
        return q

    def braces(self, look: bool = False) -> tuple[int, int | None] | None:
        """{n} {n,} {n,m} {,m} (consumed unless `look`); None where '{' is a literal, as in Python's re."""
        if self.peek() != "{" or (end := self.p.find("}", self.i)) < 0:
            return None
        lo_s, comma, hi_s = self.p[self.i + 1 : end].partition(",")
        if not all(x.isdigit() for x in (lo_s, hi_s) if x) or not (lo_s or (comma and hi_s)):
            return None
        if not look:
            self.i = end + 1
        lo = int(lo_s) if lo_s else 0
        return (lo, lo) if not comma else (lo, int(hi_s) if hi_s else None)

    def atom(self) -> Node:
        ch = self.take()
        if ch == "(":
            self.depth += 1
            if self.depth > MAX_GROUP_DEPTH:
                raise self.error(f"groups nested more than {MAX_GROUP_DEPTH} deep")
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i) or (
                self.p.startswith("?<", self.i) and self.p[self.i + 2 : self.i + 3] not in ("=", "!")
            ):
                close = self.p.find(">", self.i)
                if close < 0:
                    raise self.error("unterminated group name")
                self.i = close + 1
            elif self.peek() == "?":
                raise self.error("lookarounds, inline flags and other (?...) groups are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.i += 1
            self.depth -= 1
            return node
        if ch == "[":
            return self.char_class()
        if ch == ".":
            return _Class(ascii=ASCII & ~NEWLINE, all_other=True).node()
        if ch == "^":
            if self.i != 1:
                raise self.error("'^' is only supported at the start")
            return ("seq", [])
        if ch == "$":
            if self.i != len(self.p):
                raise self.error("'$' is only supported at the end")
            return ("seq", [])
        if ch == "\\":
            got = self.escape()
            return got.node() if isinstance(got, _Class) else _literal(got)
        if ch in "*+?":
            self.i -= 1
            raise self.error("nothing to repeat")
        if ch == ")":
            self.i -= 1
            raise self.error("unbalanced ')'")
        if ch in self.raw:  # a marker character standing for one byte no UTF-8 text holds
            return ("set", 1 << self.raw[ch])
        return _literal(ch)

    def escape(self) -> _Class | str:
        """After a backslash: a class (`\\d`...) or one character."""
        at = self.i - 1  # (errors point at the backslash)
        ch = self.take()
        if not ch:
            raise self.error("a pattern cannot end with a backslash", at)
        if ch in "dDwWsS":
            return _class_of(ch)
        if ch in _SIMPLE_ESCAPES and not (ch == "0" and self.peek().isdigit()):
            return _SIMPLE_ESCAPES[ch]
        width = {"x": 2, "u": 4, "U": 8}.get(ch)
        if width is not None:
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise self.error(f"bad escape {chr(92) + ch + digits!r}", at)
            self.i += width
            cp = int(digits, 16)
            if cp > MAX_CODEPOINT:
                raise self.error(f"bad escape {chr(92) + ch + digits!r}", at)
            return chr(cp)
        if ch.isalnum():
            raise self.error(f"the escape \\{ch} is not supported", at)
        return ch

    def class_char(self) -> _Class | str:
        ch = self.take()
        if not ch:
            raise self.error("unterminated character class")
        return self.escape() if ch == "\\" else ch

    def char_class(self) -> Node:
        neg = self.peek() == "^"
        if neg:
            self.i += 1
        c = _Class()
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.error("unterminated character class")
            if self.peek() == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_char()
            if isinstance(lo, _Class):
                c.merge(lo)
                continue
            if self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_char()
                if isinstance(hi, _Class) or ord(hi) < ord(lo):
                    raise self.error("bad character range")
                c.add_range(ord(lo), ord(hi))
            else:
                c.add_range(ord(lo), ord(lo))
        return (c.negated(f"at position {self.i} of the pattern") if neg else c).node()


# ---- automata ---------------------------------------------------------------------------------------------
class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int]]] = []  # (byte mask, target)

    def new(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise RegexError(f"the pattern is too large (more than {MAX_NFA_STATES} automaton states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def emit(self, node: Node, s: int) -> int:
        """Add `node`'s fragment starting at state s; its end state."""
        kind = node[0]
        if kind == "set":
            e = self.new()
            if node[1]:
                self.edges[s].append((node[1], e))
            return e
        if kind == "seq":
            for child in node[1]:
                s = self.emit(child, s)
            return s
        if kind == "alt":
            e = self.new()
            for child in node[1]:
                b = self.new()
                self.eps[s].append(b)
                self.eps[self.emit(child, b)].append(e)
            return e
        _, body, lo, hi = node
        for _ in range(lo):
            s = self.emit(body, s)
        if hi is None:
            b = self.new()
            self.eps[s].append(b)
            self.eps[self.emit(body, b)].append(b)
            e = self.new()
            self.eps[b].append(e)
            return e
        e = self.new()
        for _ in range(hi - lo):
            self.eps[s].append(e)
            s = self.emit(body, s)
        self.eps[s].append(e)
        return e


def _closure(nfa: _NFA, states: frozenset[int] | set[int]) -> frozenset[int]:
    out = set(states)
    todo = list(states)
    while todo:
        for t in nfa.eps[todo.pop()]:
            if t not in out:
                out.add(t)
                todo.append(t)
    return frozenset(out)


def _byte_classes(masks: set[int]) -> list[int]:
    """The coarsest partition of the 256 bytes that every mask is a union of (as masks)."""
    classes = [(1 << 256) - 1]
    for m in masks:
        nxt = []
        for c in classes:
            a, b = c & m, c & ~m
            nxt += [x for x in (a, b) if x]
        classes = nxt
    return classes


def compile_regex(pattern: str, raw: Mapping[str, int] | None = None) -> DFA:
    """The DFA of `pattern` over UTF-8 bytes (see the module docstring); RegexError when it cannot be.

    `raw` maps marker characters to single bytes: each unescaped occurrence of one outside a class matches
    that byte alone (0xC0, 0xC1, 0xF5-0xFF: bytes no UTF-8 text holds), for automata that carry markers beside the
    text (`guided.NestedGuide`'s calls)."""
    if not isinstance(pattern, str):
        raise RegexError(f"a pattern must be a string, got {type(pattern).__name__}")
    assert all(b in (0xC0, 0xC1) or b >= 0xF5 for b in (raw or {}).values()), raw
    nfa = _NFA()
    start = nfa.new()
    final = nfa.emit(_Parser(pattern, raw).parse(), start)
    classes = _byte_classes({m for edges in nfa.edges for m, _ in edges})
    # each edge's classes (indices); a class lies inside a mask or outside it
    of_mask = {m: [k for k, c in enumerate(classes) if c & m] for edges in nfa.edges for m, _ in edges}
    edge_classes = [[(t, of_mask[m]) for m, t in edges] for edges in nfa.edges]
    first = _closure(nfa, {start})
    index = {first: 0}
    sets = [first]
    rows: list[list[int]] = []
    todo = deque([first])
    while todo:
        cur = todo.popleft()
        targets: dict[int, set[int]] = {}
        for s in cur:
            for t, ks in edge_classes[s]:
                for k in ks:
                    targets.setdefault(k, set()).add(t)
        row = [-1] * len(classes)
        for k, ts in targets.items():
            nxt = _closure(nfa, ts)
            j = index.get(nxt)
            if j is None:
                if len(sets) >= MAX_DFA_STATES:
                    raise RegexError(
                        f"the pattern is too complex (more than {MAX_DFA_STATES} automaton states)"
                    )
                j = index[nxt] = len(sets)
                sets.append(nxt)
                todo.append(nxt)
            row[k] = j
        rows.append(row)
    accept = np.array([final in s for s in sets], dtype=bool)
    # pruned and minimised over byte classes, then spread over the 256 bytes
    keep, by_class = _minimise(
        _prune(np.array(rows, dtype=np.int32).reshape(len(sets), len(classes)), accept), accept
    )
    byte_class = np.zeros(256, dtype=np.int64)
    for k, c in enumerate(classes):
        for b in range(256):
            if c >> b & 1:
                byte_class[b] = k
    return DFA(np.ascontiguousarray(by_class[:, byte_class]), accept[keep])


def _prune(trans: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """trans with every move into a state that cannot reach an accepting one made -1."""
    n = trans.shape[0]
    live = accept.copy()
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, t in zip(*np.nonzero(trans >= 0), strict=True):
        preds[int(trans[s, t])].append(int(s))
    todo = [int(s) for s in np.nonzero(live)[0]]
    while todo:
        for p in preds[todo.pop()]:
            if not live[p]:
                live[p] = True
                todo.append(p)
    out = trans.copy()
    out[(trans >= 0) & ~live[np.maximum(trans, 0)]] = -1
    return out


def _minimise(trans: np.ndarray, accept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the states kept, their transitions renumbered): one state per class of equivalent states (Moore's
    refinement: states split while some input sends them to different blocks), start state kept at 0.
    Refinement that has not settled after MINIMISE_ROUNDS rounds (long chains of distinct states, which
    merge little) keeps the DFA as it is."""
    n = trans.shape[0]
    block = [int(a) for a in accept]
    count = len(set(block))
    rows = trans.tolist()
    for _ in range(MINIMISE_ROUNDS):
        ids: dict[tuple[int, ...], int] = {}
        nxt = [
            ids.setdefault((block[s], *(block[t] if t >= 0 else -1 for t in rows[s])), len(ids))
            for s in range(n)
        ]
        if len(ids) == count:
            break
        block, count = nxt, len(ids)
    else:
        return np.arange(n), trans
    # renumber blocks in order of first appearance (the start state's block is 0); one state stands for each
    first: dict[int, int] = {}
    for s, b in enumerate(block):
        first.setdefault(b, s)
    new_id = {b: i for i, b in enumerate(first)}
    keep = np.array(list(first.values()), dtype=np.int64)
    ren = np.array([new_id[b] for b in block], dtype=np.int32)
    small = trans[keep]
    return keep, np.where(small >= 0, ren[np.maximum(small, 0)], -1).astype(np.int32)
