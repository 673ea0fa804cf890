"""Guided decoding: outputs held to a regular expression, a list of choices or a JSON schema (vLLM's
`guided_regex` / `guided_choice` / `guided_json`, OpenAI's `response_format`).

A guide is a DFA over UTF-8 bytes (`regex_dfa`). Its state after the output so far decides which tokens
may come next: a token is allowed when its bytes lead the automaton to a state from which a match can
still be completed; the model's EOS tokens when the output so far is a whole match. The scheduler sends
each guided row's allowed tokens to the last stage as a bit mask (`Guide.mask`, cached per state), which
`sampling.shape_logits` applies after the other shaping (greedy rows too; logprobs stay the model's own).
An output that is a match from which nothing can follow finishes there (`finish_reason` "stop") without
a step for its EOS. A state that no token of the vocabulary can leave (the pattern needs bytes no token
has) allows the EOS tokens alone, so a generation never draws from an empty row.

Every guide is a regular expression underneath:
  * `("regex", pattern)`;
  * `("choice", json list of strings)`: exactly one of the strings;
  * `("json", json schema)`: a JSON text valid against the schema (`_Schema`: the subset below);
  * `("json_object", "")`: any JSON object.

Free JSON values (JSON mode's, a schema's `{}` / `true` / typeless parts) and recursive `$ref`s (to an object
or array schema) nest to any depth up to MAX_JSON_DEPTH: their regex holds a call marker where such a
container may be, and the guide is a `NestedGuide`, a pushdown automaton over that DFA.

JSON is written compactly or lightly spaced: at most JSON_WS whitespace characters between tokens.
Schemas: `type` (one or a list), `enum`, `const`, `anyOf` / `oneOf`, `allOf` of one schema, local `$ref`s
(`#/$defs/...`, `#/definitions/...`, nested up to MAX_SCHEMA_DEPTH), objects' `properties` in their
order with `required` (every other property optional; `additionalProperties` allows what is listed),
arrays' `items` with `minItems` / `maxItems`, strings' `minLength` / `maxLength` / `pattern` / `format`
(date, time, date-time, uuid; a length bound with neither); annotation keywords are ignored. Other
validation keywords (`minimum`, `multipleOf`, `uniqueItems`, `not`, ...) are refused by name, as a schema
longctx would not enforce.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longctx.engine.regex_dfa import DFA, RegexError, compile_regex
from longctx.errors import RequestError

KINDS = ("regex", "choice", "json", "json_object")
FIELD = {
    "regex": "guided_regex",
    "choice": "guided_choice",
    "json": "guided_json",
    "json_object": "response_format",
}
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
JSON_WS = 8  # whitespace characters allowed between JSON tokens
MAX_JSON_DEPTH = 64  # objects and arrays nested in a JSON guide's free values (`NestedGuide`)
MAX_SCHEMA_DEPTH = 6
MAX_OPTIONAL = 16  # optional properties of one object (the regex grows with their square)
CACHED_GUIDES = 32
# a mask walks each class string of tokens once where the automaton has at most this many classes of bytes
# (`_Classed`; a [a-z ] regex: 2 classes, 155K tokens -> 7K walks; a JSON schema ~40 classes, merging few)
MAX_BYTE_CLASSES = 16
WARM_STATES = 64  # masks a new guide makes as it is compiled (`Guide.warm`)
CACHED_MASKS = 4096  # per guide, and no more than MASK_BYTES_PER_GUIDE of them
MASK_BYTES_PER_GUIDE = 8 << 20  # (412 masks of a 154K-token vocabulary; 256 MiB for CACHED_GUIDES guides)

_WS = f"[ \\t\\n]{{0,{JSON_WS}}}"
_SEP = f"{_WS},{_WS}"  # between a JSON array's items or an object's members
_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_STRING = f'"{_STRING_CHAR}*"'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_FORMATS["date-time"] = _FORMATS["date"] + "T" + _FORMATS["time"]
# A nested guide's regex (`NestedGuide`): marker characters, each compiled to one byte no UTF-8 text holds.
# CALLS[k] stands where a container of kind k may be (a call of its automaton): kind 0 any object or array
# (a free value's), kinds 1.. a recursive $ref's target. The regex is TOP (the guide's own pattern) |
# CONTS[k] (one container of kind k, whose values hold calls in turn) for each kind.
MAX_CALLABLES = 6  # kinds of containers a nested guide calls (the free one and up to 5 recursive $refs)
_TOP = "\ue000"
_CALLS = tuple(chr(0xE001 + 2 * k) for k in range(MAX_CALLABLES))
_CONTS = tuple(chr(0xE002 + 2 * k) for k in range(MAX_CALLABLES))
_NOT_UTF8 = (0xC0, 0xC1, *range(0xF5, 0x100))  # the 13 bytes UTF-8 never has
_MARKER_BYTES = dict(zip((_TOP, *(c for pair in zip(_CALLS, _CONTS) for c in pair)), _NOT_UTF8, strict=True))
_CALL, _CONT = _CALLS[0], _CONTS[0]
_SCALARS = [_STRING, _NUMBER, "true", "false", "null"]
_VALUE = "(?:" + "|".join([*_SCALARS, _CALL]) + ")"  # any JSON value, containers through a call
# keywords that only describe (no effect on what is valid), and those this module enforces
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "additionalProperties", "discriminator"}  # fmt: skip
_HANDLED = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required", "items",
            "minItems", "maxItems", "minLength", "maxLength", "pattern", "format"}  # fmt: skip


def _error(field: str, value: object, problem: str) -> RequestError:
    """RequestError.about `field`, naming it as the request field at fault too (an HTTP 400's param)."""
    e = RequestError.about(field, value, problem)
    e.param = field
    return e


def _lit(text: str) -> str:
    """A regex matching exactly `text` (re.escape's output is inside this module's syntax; a marker
    character is escaped, so it stays the text's character)."""
    out = re.escape(text)
    for m in _MARKER_BYTES:
        out = out.replace(m, f"\\u{ord(m):04x}")
    return out


def _join(parts: Sequence[str]) -> str:
    return "(?:" + "|".join(parts) + ")" if len(parts) != 1 else parts[0]


def _count(unit: str, lo: int, hi: int | None) -> str:
    return f"(?:{unit}){{{lo},{'' if hi is None else hi}}}"


class _Schema:
    """JSON schema -> regex (the subset in the module docstring)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nested = False  # whether the regex holds free values (calls of the container automaton)
        self.active: list[str] = []  # the $refs being expanded (one met again is a recursion: a call)
        self.callables: dict[str, int] = {}  # a recursive $ref -> its container kind (1..)

    def error(self, what: str) -> RequestError:
        return _error("guided_json", None, what)

    def regex(self, s: Any, depth: int = 0) -> str:
        if depth > MAX_SCHEMA_DEPTH:
            raise self.error(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (a recursive $ref?)")
        if s is True or s == {}:
            return self.any_value()
        if not isinstance(s, dict):
            raise self.error(f"a schema must be an object, got {json.dumps(s)[:60]}")
        unknown = sorted(set(s) - _ANNOTATIONS - _HANDLED)
        if unknown:
            raise self.error(f"the keyword {unknown[0]!r} is not supported by guided decoding")
        if "$ref" in s:
            ref = s["$ref"]
            target = self.resolve(ref)
            if ref in self.active:  # a recursion: the target through a call of its own automaton
                return self.call(ref, target)
            self.active.append(ref)
            try:
                return self.regex(target, depth + 1)
            finally:
                self.active.pop()
        if "const" in s:
            return _lit(json.dumps(s["const"], ensure_ascii=False))
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.error("enum must be a non-empty list")
            return _join([_lit(json.dumps(v, ensure_ascii=False)) for v in s["enum"]])
        for key in ("anyOf", "oneOf"):
            if key in s:
                if not isinstance(s[key], list) or not s[key]:
                    raise self.error(f"{key} must be a non-empty list")
                alternatives = [self.regex(x, depth + 1) for x in s[key]]
                # a free alternative holds every value the others do: the union is free (else a pushdown
                # guide's text transitions would follow a specific object where any object may stand)
                return _VALUE if _VALUE in alternatives else _join(alternatives)
        if "allOf" in s:
            if not isinstance(s["allOf"], list) or len(s["allOf"]) != 1:
                raise self.error("allOf is supported with one schema only")
            return self.regex(s["allOf"][0], depth + 1)
        t = s.get("type")
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else None
        if t is None:
            return self.any_value()
        if isinstance(t, list):
            return _join([self.regex({**s, "type": x}, depth) for x in t])
        if t == "string":
            return self.string(s)
        if t in ("integer", "number"):
            return _INTEGER if t == "integer" else _NUMBER
        if t == "boolean":
            return "(?:true|false)"
        if t == "null":
            return "null"
        if t == "array":
            return self.array(s, depth)
        if t == "object":
            return self.object(s, depth)
        raise self.error(f"unknown type {t!r}")

    def resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.error(f"only local $refs (#/...) are supported, got {ref!r}")
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise self.error(f"$ref {ref!r} points nowhere")
            node = node[part]
        return node

    def _bound(self, s: dict, name: str) -> int | None:
        v = s.get(name)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise self.error(f"{name} must be a non-negative integer")
        return v

    def string(self, s: dict) -> str:
        if ("pattern" in s or s.get("format") in _FORMATS) and ("minLength" in s or "maxLength" in s):
            raise self.error("minLength / maxLength together with a pattern or a format are not supported")
        if "pattern" in s:
            p = s["pattern"]
            if not isinstance(p, str):
                raise self.error("pattern must be a string")
            if any(m in p for m in _MARKER_BYTES):
                raise self.error(
                    f"pattern holds a private-use character U+E000-U+{ord(max(_MARKER_BYTES)):04X}"
                )
            return f'"{p.removeprefix("^").removesuffix("$")}"'
        fmt = s.get("format")
        if fmt in _FORMATS:
            return f'"{_FORMATS[fmt]}"'
        lo, hi = self._bound(s, "minLength") or 0, self._bound(s, "maxLength")
        if lo == 0 and hi is None:
            return _STRING
        return f'"{_count(_STRING_CHAR, lo, hi)}"'

    def array(self, s: dict, depth: int) -> str:
        item = self.regex(s.get("items", True), depth + 1)
        lo, hi = self._bound(s, "minItems") or 0, self._bound(s, "maxItems")
        if hi is not None and hi < lo:
            raise self.error("maxItems is below minItems")
        if hi == 0:
            return f"\\[{_WS}\\]"
        rest = _count(_SEP + item, max(lo - 1, 0), None if hi is None else hi - 1)
        body = f"{item}{rest}"
        return f"\\[{_WS}{body if lo else f'(?:{body})?'}{_WS}\\]"

    def object(self, s: dict, depth: int) -> str:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise self.error("properties must be an object")
        required = s.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else required
            raise self.error(f"required names properties the schema does not have: {missing!r}")
        names = list(props)
        opt = [n for n in names if n not in required]
        if len(opt) > MAX_OPTIONAL:
            raise self.error(f"an object with more than {MAX_OPTIONAL} optional properties")
        items = [
            f"{_lit(json.dumps(n, ensure_ascii=False))}{_WS}:{_WS}{self.regex(props[n], depth + 1)}"
            for n in names
        ]
        # the first property written is some i up to the first required one; after it every later property
        # follows a comma, the optional ones each optional
        first_req = next((i for i, n in enumerate(names) if n in required), len(names))
        starts = []
        for i in range(min(first_req + 1, len(names))):
            tail = "".join(
                _SEP + items[j] if names[j] in required else f"(?:{_SEP}{items[j]})?"
                for j in range(i + 1, len(names))
            )
            starts.append(items[i] + tail)
        body = _join(starts) if starts else ""
        if starts and first_req == len(names):  # nothing required: the object may be empty
            body = f"(?:{body})?"
        return f"\\{{{_WS}{body}{_WS}\\}}"

    def call(self, ref: str, target: Any) -> str:
        """The call marker of a recursive $ref's kind: its target must be an object or an array (a container,
        whose closing bracket ends it), and a guide holds at most MAX_CALLABLES - 1 of them."""
        t = target.get("type") if isinstance(target, dict) else None
        if not (
            t in ("object", "array")
            or (t is None and isinstance(target, dict) and ("properties" in target or "items" in target))
        ):
            raise self.error(f"the recursive $ref {ref!r} must point to an object or array schema")
        k = self.callables.get(ref)
        if k is None:
            if len(self.callables) >= MAX_CALLABLES - 1:
                raise self.error(f"more than {MAX_CALLABLES - 1} recursive $refs")
            k = self.callables[ref] = len(self.callables) + 1
        self.nested = True
        return _CALLS[k]

    def any_value(self) -> str:
        """Any JSON value; an object or an array through a call of the container automaton (nested up to
        MAX_JSON_DEPTH)."""
        self.nested = True
        return _VALUE

    def pattern(self) -> str:
        """The guide's regex: the root schema's, wrapped for a `NestedGuide` when it holds free values or
        recursive $refs (each recursive target's container then an automaton of its own)."""
        top = self.regex(self.root)
        if not self.nested:
            return top
        bodies: dict[int, str] = {}
        while len(bodies) < len(self.callables):  # (a body may call targets not met before)
            ref, k = next((r, k) for r, k in self.callables.items() if k not in bodies)
            self.active = [ref]
            bodies[k] = self.regex(self.resolve(ref), 1)
        return nested_regex(top, bodies)


def any_object() -> str:
    """A JSON object of any members, their values free (calls)."""
    member = f"{_STRING}{_WS}:{_WS}{_VALUE}"
    return f"\\{{{_WS}(?:{member}(?:{_SEP}{member})*)?{_WS}\\}}"


def nested_regex(top: str, bodies: dict[int, str] | None = None) -> str:
    """A `NestedGuide`'s regex: `top` (holding calls) after the TOP marker, then after each kind's CONT marker
    the container a call of that kind matches: kind 0 one object or array whose values hold calls, kinds 1..
    `bodies`' (recursive $refs' targets)."""
    array = f"\\[{_WS}(?:{_VALUE}(?:{_SEP}{_VALUE})*)?{_WS}\\]"
    parts = [f"{_TOP}(?:{top})", f"{_CONT}(?:{any_object()}|{array})"]
    parts += [f"{_CONTS[k]}(?:{body})" for k, body in sorted((bodies or {}).items())]
    return "|".join(parts)


def check_guided(guided: Any) -> None:
    """SamplingParams.guided's shape: a (kind, spec) pair of strings, the kind one of KINDS (RequestError)."""
    if not (
        isinstance(guided, tuple | list) and len(guided) == 2 and all(isinstance(x, str) for x in guided)
    ):
        raise _error("guided", None, "must be a (kind, spec) pair of strings")
    if guided[0] not in KINDS:
        raise _error("guided", guided[0], f"must be one of {', '.join(KINDS)}")


def guide_regex(kind: str, spec: str) -> str:
    """The regular expression of a guide (RequestError naming the request's field when it has none)."""
    check_guided((kind, spec))
    name = FIELD[kind]
    if len(spec) > MAX_SPEC_CHARS:
        raise _error(name, None, f"must be a string of at most {MAX_SPEC_CHARS} characters")
    if kind == "regex":
        return spec
    if kind == "json_object":
        return nested_regex(any_object())
    try:
        value = json.loads(spec)
    except ValueError as e:
        raise _error(name, None, f"is not JSON ({e})") from None
    except RecursionError:
        raise _error(name, None, "nests too deep") from None
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise _error(name, None, "must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise _error(name, None, f"has {len(value)} choices, at most {MAX_CHOICES}")
        return "|".join(_lit(c) for c in value)
    return _Schema(value).pattern()


@dataclass(frozen=True)
class VocabBytes:
    """A vocabulary's token bytes laid out for walking every token through an automaton at once: the
    tokens that have bytes, longest first (`order`, their ids), their bytes in `table` [n, longest]
    (zero padded), `active[j]` tokens longer than j; `eos` the ids allowed where the output may end."""

    size: int
    order: np.ndarray
    table: np.ndarray
    active: np.ndarray
    eos: tuple[int, ...]
    of: tuple[bytes | None, ...]  # token id -> its bytes (None: a special token, never allowed)

    @classmethod
    def build(cls, pieces: Sequence[bytes | None], eos: Sequence[int]) -> VocabBytes:
        ids = [i for i, b in enumerate(pieces) if b]
        ids.sort(key=lambda i: -len(pieces[i]))  # type: ignore[arg-type]
        longest = len(pieces[ids[0]]) if ids else 0  # type: ignore[arg-type]
        table = np.zeros((len(ids), longest), dtype=np.uint8)
        lens = np.zeros(len(ids), dtype=np.int64)
        for r, i in enumerate(ids):
            b = pieces[i]
            assert b is not None
            table[r, : len(b)] = np.frombuffer(b, dtype=np.uint8)
            lens[r] = len(b)
        active = np.array([int((lens > j).sum()) for j in range(longest)], dtype=np.int64)
        eos_ids = tuple(sorted({e for e in eos if 0 <= e < len(pieces)}))
        return cls(len(pieces), np.array(ids, dtype=np.int64), table, active, eos_ids, tuple(pieces))

    def lengths_valid(self) -> np.ndarray:
        """bool [n, longest]: which entries of `table` are token bytes (not padding)."""
        return np.arange(len(self.order))[:, None] < self.active[None, :]

    def rows(self, which: np.ndarray) -> VocabBytes:
        """The tokens at rows `which` (ascending) of `table`, laid out the same way."""
        active = np.searchsorted(which, self.active).astype(np.int64)
        keep = int((active > 0).sum())
        return VocabBytes(
            self.size, self.order[which], self.table[which, :keep], active[:keep], self.eos, self.of
        )


def _walk_tokens(trans: np.ndarray, v: VocabBytes, state: int, ok: np.ndarray) -> None:
    """Set ok[t] for the tokens of `v` whose bytes walk the DFA `trans` from `state` without dying."""
    # the tokens still alive (rows of v.table, ascending: longest first) and their states; a row that runs
    # out of bytes alive is allowed, one that meets -1 drops out
    idx = np.arange(len(v.order))
    cur = np.full(len(v.order), state, dtype=np.int32)
    for j, k in enumerate(v.active):
        m = int(np.searchsorted(idx, k))
        ok[v.order[idx[m:]]] = True  # (their j bytes are all walked)
        nxt = trans[cur[:m], v.table[idx[:m], j]]
        keep = nxt >= 0
        idx, cur = idx[:m][keep], nxt[keep]
    ok[v.order[idx]] = True


@dataclass(frozen=True)
class _Classed:
    """A vocabulary's tokens merged where an automaton cannot tell them apart: bytes whose columns of the
    transition table are equal fall in one class, and tokens whose bytes fall in the same classes walk
    alike from every state. `unique` holds one token of each class string (its `order` is its own row
    number); `of_row[r]` is the unique row of `v.table`'s row r. A mask walks the unique rows only."""

    unique: VocabBytes
    of_row: np.ndarray
    ids: np.ndarray  # the token ids of the rows (`v.order`)

    @classmethod
    def build(cls, trans: np.ndarray, v: VocabBytes) -> _Classed | None:
        """The merged tokens, or None where the automaton has more than MAX_BYTE_CLASSES classes of bytes
        (then few tokens merge and the merged walk is no faster than the plain one)."""
        _, rep_at, byte_class = np.unique(trans.T, axis=0, return_index=True, return_inverse=True)
        if len(rep_at) > MAX_BYTE_CLASSES or not len(v.order):
            return None
        rep = rep_at[byte_class.reshape(-1)].astype(np.uint8)  # byte -> the first byte of its class
        valid = v.lengths_valid()
        key = np.where(valid, rep[v.table], 0).astype(np.uint8)
        lens = valid.sum(axis=1)
        key = np.concatenate([(lens[:, None] >> np.array([8, 0])) & 255, key], axis=1).astype(np.uint8)
        rows = key.view(np.dtype((np.void, key.shape[1]))).reshape(-1)  # (astype's copy: C-contiguous)
        _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
        perm = np.argsort(first)  # (the unique rows in table order: longest first, as a walk needs)
        rank = np.empty_like(perm)
        rank[perm] = np.arange(len(perm))
        u = v.rows(first[perm])
        unique = VocabBytes(len(perm), np.arange(len(perm)), u.table, u.active, (), ())
        return cls(unique, rank[inverse.reshape(-1)], v.order)

    def walk(self, trans: np.ndarray, state: int, ok: np.ndarray) -> None:
        """`_walk_tokens(trans, v, state, ok)` over the merged tokens."""
        hit = np.zeros(len(self.unique.order), dtype=bool)
        _walk_tokens(trans, self.unique, state, hit)
        ok[self.ids[hit[self.of_row]]] = True


@dataclass
class Guide:
    """One compiled guide over one vocabulary: allowed-token masks per automaton state, cached."""

    dfa: DFA
    vocab: VocabBytes
    masks: OrderedDict[int, bytes] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(
        default_factory=threading.Lock, repr=False
    )  # (masks: warmed on another thread)

    def __post_init__(self) -> None:
        pass  # (NestedGuide's derives its tables here)

    @functools.cached_property
    def _classed(self) -> _Classed | None:
        """The tokens walked by the DFA alone, merged by byte classes (made by the first mask)."""
        return _Classed.build(self.dfa.trans, self._plain_tokens())

    def _plain_tokens(self) -> VocabBytes:
        """The tokens whose walk is the DFA's alone (all of them here)."""
        return self.vocab

    def _walk_plain(self, state: int, ok: np.ndarray) -> None:
        """Set ok[t] for the plain tokens t whose bytes walk the DFA from `state` without dying."""
        c = self._classed
        if c is None:
            _walk_tokens(self.dfa.trans, self._plain_tokens(), state, ok)
        else:
            c.walk(self.dfa.trans, state, ok)

    @property
    def start(self) -> Any:
        """The state before any output."""
        return 0

    def matches(self, data: bytes) -> bool:
        """Whether `data` is a whole match."""
        st = self.dfa.walk(0, data)
        return st >= 0 and bool(self.dfa.accept[st])

    def advance(self, state: int, token: int) -> int:
        b = self.vocab.of[token] if 0 <= token < self.vocab.size else None
        return -1 if b is None or state < 0 else self.dfa.walk(state, b)

    def complete(self, state: int) -> bool:
        """A whole match that nothing can extend: the output ends here."""
        return state >= 0 and bool(self.dfa.accept[state]) and not bool((self.dfa.trans[state] >= 0).any())

    def allowed(self, state: int) -> np.ndarray:
        """bool [vocab]: the tokens that may follow `state` (EOS where it accepts, or where nothing else can)."""
        v = self.vocab
        ok = np.zeros(v.size, dtype=bool)
        if state >= 0:
            self._walk_plain(state, ok)
        if state < 0 or bool(self.dfa.accept[state]) or not ok.any():
            ok[list(v.eos)] = True
        return ok

    def key(self, state: Any) -> Any:
        """What `allowed(state)` depends on: the masks' cache key."""
        return state

    def mask(self, state: Any) -> bytes:
        """`allowed(state)` packed into bits (little-endian within each byte), as a plan row carries it."""
        key = self.key(state)
        with self.lock:
            got = self.masks.get(key)
            if got is not None:
                self.masks.move_to_end(key)
                return got
        got = np.packbits(self.allowed(state), bitorder="little").tobytes()
        with self.lock:
            self.masks[key] = got
            if len(self.masks) > min(CACHED_MASKS, max(1, MASK_BYTES_PER_GUIDE // len(got))):
                self.masks.popitem(last=False)
        return got

    def reachable(self, limit: int) -> list[Any]:
        """The first `limit` states breadth-first from the start (those outputs reach first)."""
        order, seen = [0], {0}
        for s in order:
            if len(order) >= limit:
                break
            for t in np.unique(self.dfa.trans[s]).tolist():
                if t >= 0 and t not in seen:
                    seen.add(t)
                    order.append(t)
        return order[:limit]

    def warm(self, limit: int = WARM_STATES) -> None:
        """The masks of the `reachable` states, made now rather than in the steps that reach them."""
        for s in self.reachable(limit):
            self.mask(s)


# A nested guide's state: (automaton state, the call stack: the states each open container returns to)
Config = tuple[int, tuple[int, ...]]
DEAD: Config = (-1, ())


class NestedGuide(Guide):
    """A guide whose free JSON values nest objects and arrays to any depth (up to MAX_JSON_DEPTH): a
    pushdown automaton over the DFA of `nested_regex`.

    Where a value may be an object or an array, the automaton has a call marker byte instead of an
    unrolled nesting, one per kind of container (any object or array for a free value; each recursive
    $ref's target). A byte with no transition from state q, where q has a call of a kind whose container
    can start with that byte, starts one: the state after the call is pushed and the walk goes on in that
    kind's automaton (entered through its CONT marker). A container's closing byte leads to a state that
    accepts and has no way on (`done`): there the pushed state is popped, and the walk resumes after the
    call. A text byte always takes its own transition first, so where a schema allows a specific container
    and a called one at one place (an `anyOf` of an object and a recursive $ref's object), a container
    follows the specific one (what is generated is valid, a subset of the schema's instances). An `anyOf` /
    `oneOf` with a free alternative is free as a whole, so a free value never meets this. The state is a
    `Config`; masks are cached per (state, the top of the stack any one token can pop to, the room left for
    tokens' pushes)."""

    def __post_init__(self) -> None:
        t = self.dfa.trans
        self.top = int(t[0, _MARKER_BYTES[_TOP]])
        self.marker = np.zeros(256, dtype=bool)
        self.marker[list(_MARKER_BYTES.values())] = True
        # each container kind's (state after a call from q, -1: none; its automaton's entry state), the
        # recursive $refs' kinds before the free one (a call takes the first kind that can start there)
        kinds = [*range(1, MAX_CALLABLES), 0]
        self.kinds = [
            (t[:, _MARKER_BYTES[_CALLS[k]]].copy(), int(t[0, _MARKER_BYTES[_CONTS[k]]]))
            for k in kinds
            if t[0, _MARKER_BYTES[_CONTS[k]]] >= 0
        ]
        self.done = self.dfa.accept & ~(t >= 0).any(axis=1)
        # bytes that start a container / close one; tokens push and pop at most so many times
        opens = np.zeros(256, dtype=bool)
        for _, entry in self.kinds:
            opens |= t[entry] >= 0
        opens &= ~self.marker
        closes = ((t >= 0) & self.done[np.maximum(t, 0)]).any(axis=0) & ~self.marker
        v = self.vocab
        valid = v.lengths_valid()
        self.max_pops = int((closes[v.table] & valid).sum(axis=1).max(initial=0))
        self.max_pushes = int((opens[v.table] & valid).sum(axis=1).max(initial=0))
        # tokens with no byte that may open or close a container (or a marker) walk the DFA alone
        special = ((opens | closes | self.marker)[v.table] & valid).any(axis=1)
        self.plain = v.rows(np.nonzero(~special)[0])
        self.structural = v.rows(np.nonzero(special)[0])

    def _plain_tokens(self) -> VocabBytes:
        return self.plain

    @property
    def start(self) -> Config:
        return (self.top, ())

    def step(self, c: Config, b: int) -> Config:
        """The state after byte `b` (DEAD once no match is possible)."""
        q, stack = c
        if q < 0 or self.marker[b]:
            return DEAD
        t = self.dfa.trans
        n = int(t[q, b])
        if n < 0:  # a container starts here, where a call may
            if len(stack) >= MAX_JSON_DEPTH:
                return DEAD
            for calls, entry in self.kinds:
                r, n = int(calls[q]), int(t[entry, b])
                if r >= 0 and n >= 0:
                    stack = (*stack, r)
                    break
            else:
                return DEAD
        if self.done[n] and stack:  # a container closed: back to after its call
            n, stack = stack[-1], stack[:-1]
        return (n, stack)

    def walk(self, c: Config, data: bytes) -> Config:
        for b in data:
            c = self.step(c, b)
        return c

    def matches(self, data: bytes) -> bool:
        q, stack = self.walk(self.start, data)
        return q >= 0 and not stack and bool(self.dfa.accept[q])

    def advance(self, state: Config, token: int) -> Config:  # type: ignore[override]
        b = self.vocab.of[token] if 0 <= token < self.vocab.size else None
        return DEAD if b is None else self.walk(state, b)

    def complete(self, state: Config) -> bool:  # type: ignore[override]
        q, stack = state
        return q >= 0 and not stack and bool(self.done[q])

    def _poppable(self, stack: tuple[int, ...]) -> tuple[int, ...]:
        """The top of `stack` one token can pop to (`allowed` reads no deeper)."""
        return stack[max(0, len(stack) - self.max_pops) :] if self.max_pops else ()

    def key(self, state: Config) -> Any:
        q, stack = state
        return (q, self._poppable(stack), min(MAX_JSON_DEPTH - len(stack), self.max_pushes))

    def allowed(self, state: Config) -> np.ndarray:  # type: ignore[override]
        """bool [vocab]: `Guide.allowed` for a pushdown state. Every token walks at once; each holds its own
        pushes (`local`) and its pops below them read the state's stack (`base`)."""
        q0, stack = state
        ok = np.zeros(self.vocab.size, dtype=bool)
        v = self.structural
        if q0 >= 0:
            self._walk_plain(q0, ok)
            base = np.array(self._poppable(stack), dtype=np.int32)
            off = len(stack) - len(base)
            n = len(v.order)
            idx = np.arange(n)
            cur = np.full(n, q0, dtype=np.int32)
            lsp = np.zeros(n, dtype=np.int32)  # each token's own pushes
            bsp = np.full(n, len(stack), dtype=np.int32)  # the state's stack entries not popped yet
            local = np.zeros((n, max(1, self.max_pushes)), dtype=np.int32)
            trans = self.dfa.trans
            for j, k in enumerate(v.active):
                m = int(np.searchsorted(idx, k))
                ok[v.order[idx[m:]]] = True  # (their j bytes are all walked)
                idx, cur, lsp, bsp, local = idx[:m], cur[:m], lsp[:m], bsp[:m], local[:m]
                b = v.table[idx, j]
                nxt = trans[cur, b]
                nxt[self.marker[b]] = -1
                want = (nxt < 0) & (bsp + lsp < MAX_JSON_DEPTH) & ~self.marker[b]
                for calls, entry in self.kinds:  # (the first kind that can start here takes the row)
                    if not want.any():
                        break
                    ret, ent = calls[cur], trans[entry, b]
                    rows = np.nonzero(want & (ret >= 0) & (ent >= 0))[0]
                    local[rows, lsp[rows]] = ret[rows]
                    lsp[rows] += 1
                    nxt[rows] = ent[rows]
                    want[rows] = False
                pop = (nxt >= 0) & self.done[np.maximum(nxt, 0)] & (bsp + lsp > 0)
                if pop.any():
                    rows = np.nonzero(pop)[0]
                    has = lsp[rows] > 0
                    mine, below = rows[has], rows[~has]
                    lsp[mine] -= 1
                    nxt[mine] = local[mine, lsp[mine]]
                    bsp[below] -= 1
                    nxt[below] = base[bsp[below] - off]
                keep = nxt >= 0
                idx, cur, lsp, bsp, local = idx[keep], nxt[keep], lsp[keep], bsp[keep], local[keep]
            ok[v.order[idx]] = True
        accepting = q0 >= 0 and not stack and bool(self.dfa.accept[q0])
        if q0 < 0 or accepting or not ok.any():
            ok[list(self.vocab.eos)] = True
        return ok

    def reachable(self, limit: int) -> list[Any]:
        """`Guide.reachable` over pushdown states (breadth-first by byte, one per mask key)."""
        order, seen = [self.start], {self.key(self.start)}
        for c in order:
            if len(order) >= limit:
                break
            for b in range(256):
                nxt = self.step(c, b)
                key = self.key(nxt)
                if nxt[0] >= 0 and key not in seen:
                    seen.add(key)
                    order.append(nxt)
        return order[:limit]


@dataclass
class GuideState:
    """A request's place in its guide: the automaton state after each prefix of its output."""

    guide: Guide
    states: list[Any] = field(default_factory=list)
    walked: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.states:
            self.states.append(self.guide.start)

    def at(self, output_ids: Sequence[int], step: int | None = None) -> Any:
        """The state after output_ids[:step] (all of it by default)."""
        n = len(output_ids) if step is None else step
        k = len(self.walked)
        while k and (k > n or self.walked[k - 1] != output_ids[k - 1]):  # (taken back or replaced)
            k -= 1
        del self.walked[k:], self.states[k + 1 :]
        for t in output_ids[k:n]:
            self.states.append(self.guide.advance(self.states[-1], t))
            self.walked.append(t)
        return self.states[n]

    def mask(self, output_ids: Sequence[int]) -> bytes:
        return self.guide.mask(self.at(output_ids))

    def complete(self, output_ids: Sequence[int]) -> bool:
        return self.guide.complete(self.at(output_ids))


class GuideCache:
    """Compiled guides by (kind, spec), least recently used dropped past CACHED_GUIDES (requests already
    holding one keep it)."""

    def __init__(self, vocab: VocabBytes) -> None:
        self.vocab = vocab
        self.guides: OrderedDict[tuple[str, str], Guide] = OrderedDict()
        self._lock = threading.Lock()  # (a server compiles off its step loop: `EngineCore.prepare_guide`)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self.guides

    def get(self, kind: str, spec: str) -> Guide:
        """The guide of (kind, spec), compiled now unless cached (RequestError naming the request's field
        for a bad one). Safe across threads; two threads asking for one new guide may both compile it."""
        key = (kind, spec)
        with self._lock:
            g = self.guides.get(key)
            if g is not None:
                self.guides.move_to_end(key)
                return g
        dfa, nested = self._compile(kind, spec)
        g = (NestedGuide if nested else Guide)(dfa, self.vocab)
        g.warm()
        with self._lock:
            self.guides[key] = g
            if len(self.guides) > CACHED_GUIDES:
                self.guides.popitem(last=False)
        return g

    @staticmethod
    def _compile(kind: str, spec: str) -> tuple[DFA, bool]:
        """The guide's DFA, and whether it is a `NestedGuide`'s."""
        pattern = guide_regex(kind, spec)
        nested = kind in ("json", "json_object") and pattern.startswith(_TOP)  # (a schema's, or JSON mode's)
        try:
            dfa = compile_regex(pattern, _MARKER_BYTES if nested else None)
        except RegexError as e:
            raise _error(FIELD[kind], None, str(e)) from None
        if not dfa.accept.any() and not (dfa.trans[0] >= 0).any():
            raise _error(FIELD[kind], None, "matches no text")
        return dfa, nested


def guide_of(
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    json_schema: Any = None,
    json_object: bool = False,
    names: tuple[str, str, str, str] = ("guided_regex", "guided_choice", "guided_json", "guided_json_object"),
) -> tuple[str, ...]:
    """SamplingParams.guided of at most one of a regex, a list of choices, a JSON schema (a dict, or its
    JSON text) and any JSON object; () for none. `names` are the caller's for them, said in errors."""
    given = [
        (n, k, v)
        for n, k, v in zip(names, KINDS, (regex, choice, json_schema, json_object or None), strict=True)
        if v is not None
    ]
    if len(given) > 1:
        raise _error(given[1][0], None, f"cannot be combined with {given[0][0]}: at most one guide")
    if not given:
        return ()
    name, kind, v = given[0]
    if kind == "regex" and not isinstance(v, str):
        raise _error(name, None, "must be a string")
    if kind == "choice":
        if isinstance(v, str) or not isinstance(v, Sequence) or not all(isinstance(c, str) for c in v):
            raise _error(name, None, "must be a list of strings")
        return ("choice", json.dumps(list(v), ensure_ascii=False))
    if kind == "json":
        if isinstance(v, str):
            return ("json", v)
        if not isinstance(v, dict | bool):
            raise _error(name, None, "must be a JSON schema (an object or its JSON text)")
        return ("json", json.dumps(v, ensure_ascii=False))
    return (kind, "" if kind == "json_object" else v)
