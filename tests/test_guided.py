"""Guided decoding: the regex -> DFA compiler against Python's `re`, guides' token masks, JSON schemas, and
the engine's guided generation (greedy, sampled, batched with unguided rows, across stages)."""

from __future__ import annotations

import json
import random
import re
import zlib

import numpy as np
import pytest

from longctx.checkpoint.tokenizer import make_tokenizer, token_bytes_table
from longctx.engine.guided import (
    MAX_JSON_DEPTH,
    Guide,
    GuideCache,
    GuideState,
    NestedGuide,
    VocabBytes,
    guide_of,
    guide_regex,
)
from longctx.engine.regex_dfa import MAX_DFA_STATES, RegexError, compile_regex
from longctx.errors import RequestError
from tests.conftest import run_requests

PATTERNS = [
    r"abc",
    r"a|b|cd",
    r"(ab)*c",
    r"[a-c]+x?",
    r"\d{2,4}-\w+",
    r"[^ab]*",
    r".{0,3}é",
    r"(?:foo|bar){2}",
    r"(?P<x>f)o+?",
    r"x{,2}y",
    r"a{3,}",
    r"[\u00e0-\u00ff\d]+",
    r"^(yes|no)$",
    r"[\]\-a]+",
    r"\s?\S+",
    r"a{",
    r"\x41\u00e9|[é-ë]",
    r"\D\W",
    r"[^\d\s]{2}",
    r"",
]
ALPHABET = list("abcdxyfor1209- \n]{ABé") + ["ê", "ë", "ü", "\u20ac", "\U0001f600"]


def _matches(dfa, text: str) -> bool:
    s = dfa.walk(0, text.encode())
    return s >= 0 and bool(dfa.accept[s])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_matches_exactly_what_re_fullmatch_does(pattern):
    dfa = compile_regex(pattern)
    rng = random.Random(zlib.crc32(pattern.encode()))
    hits = 0
    for _ in range(1500):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        want = re.fullmatch(pattern, text, re.ASCII) is not None  # (\w \d \s: ASCII meanings)
        assert _matches(dfa, text) == want, (pattern, text)
        hits += want
    # and every prefix state is live exactly when some completion exists: walking a match byte by byte
    # never meets -1
    for text in ("abc", "12-x", "ab" * 3 + "c", "yes", "fooo", "aaaa"):
        if re.fullmatch(pattern, text):
            s = 0
            for b in text.encode():
                s = int(dfa.trans[s, b])
                assert s >= 0


def test_dead_ends_are_pruned_and_the_dfa_is_minimal():
    dfa = compile_regex(r"ab|ac")
    assert dfa.num_states == 3  # start, after a, accept
    assert (dfa.trans[0] >= 0).sum() == 1  # only "a" leads anywhere
    # a branch that can never finish (an empty class) is no way forward
    assert compile_regex(r"x(?:[^\s\S]|y)").walk(0, b"x") >= 0
    dfa = compile_regex(r"x[^\s\S]")
    assert dfa.walk(0, b"x") == -1


@pytest.mark.parametrize(
    "pattern, words",
    [
        ("(a", "missing ')'"),
        ("a)", "unbalanced ')'"),
        ("*a", "nothing to repeat"),
        ("a**", "multiple repeat"),
        ("a++", "possessive"),
        ("(?=a)", "lookarounds"),
        ("(?i)a", "inline flags"),
        (r"\b", r"\b is not supported"),
        (r"\1", r"\1 is not supported"),
        ("[^é]", "negated character class"),
        ("a{3,2}", "min repeat greater"),
        ("[a", "unterminated character class"),
        ("\\", "cannot end with a backslash"),
        ("a^", "'^' is only supported at the start"),
        ("a{100000}", "repetition bound"),
        (r"\xZZ", "bad escape '\\\\xZZ'"),
        ("[z-a]", "bad character range"),
        ("(" * 3000 + "a" + ")" * 3000, "groups nested more than 100 deep"),
        ("(?:" * 101 + "a" + ")" * 101, "groups nested more than 100 deep"),
    ],
)
def test_patterns_a_dfa_cannot_hold_are_refused_in_one_line(pattern, words):
    with pytest.raises(RegexError, match=re.escape(words)) as e:
        compile_regex(pattern)
    assert "\n" not in str(e.value)


def test_an_automaton_past_the_state_cap_is_refused():
    with pytest.raises(RegexError, match=f"more than {MAX_DFA_STATES}"):
        compile_regex(r"[ab]*a[ab]{20}")  # (the classic exponential DFA)


# ---- guides over a vocabulary ----------------------------------------------------------------------------
def unpack_mask(packed: bytes, vocab: int) -> np.ndarray:
    """bool [vocab] of a `Guide.mask` (bits little-endian within each byte)."""
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
    assert bits.shape[0] >= vocab
    return bits[:vocab].astype(bool)


@pytest.fixture(scope="module")
def byte_vocab():
    return VocabBytes.build(token_bytes_table(make_tokenizer(), 300), eos=[257])


def _multi_byte_vocab(rng: random.Random) -> VocabBytes:
    """Tokens of several bytes (some split a UTF-8 character), a few specials and ids past the tokenizer."""
    pieces: list[bytes | None] = [bytes([b]) for b in range(256)]
    words = [
        "ab",
        "abc",
        "yes",
        "no",
        "ye",
        "s",
        '{"',
        '":',
        '"}',
        "12",
        "3.5",
        "true",
        "null",
        " ",
        "\u00e9",
    ]
    pieces += [w.encode() for w in words]
    pieces += ["\u00e9".encode()[:1], "\u20ac".encode()[1:]]
    pieces += [bytes(rng.randrange(256) for _ in range(rng.randint(2, 5))) for _ in range(40)]
    pieces += [None, None]  # specials (eos among them)
    return VocabBytes.build(pieces, eos=[len(pieces) - 2])


def _allowed_ref(guide: Guide, state: int) -> np.ndarray:
    """Token by token: a token is allowed when its bytes keep a match possible; EOS where it accepts."""
    v = guide.vocab
    ok = np.zeros(v.size, dtype=bool)
    for t, b in enumerate(v.of):
        if b and state >= 0 and guide.dfa.walk(state, b) >= 0:
            ok[t] = True
    if state < 0 or guide.dfa.accept[state] or not ok.any():
        ok[list(v.eos)] = True
    return ok


@pytest.mark.parametrize("seed", [0, 1])
def test_masks_equal_a_token_by_token_walk_and_round_trip_packed(seed, byte_vocab):
    rng = random.Random(seed)
    vocab = _multi_byte_vocab(rng)
    for v in (byte_vocab, vocab):
        cache = GuideCache(v)
        for kind, spec in (
            ("regex", r"(ab|yes|no)[0-9]{1,3}(\.5)?"),
            ("regex", r"[a-z ]{1,20}"),  # (two classes of bytes: the tokens merge into a few walks)
            ("choice", json.dumps(["yes", "no", "ab\u00e9"])),
            (
                "json",
                json.dumps({"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}),
            ),
        ):
            g = cache.get(kind, spec)
            classed = g._classed  # the tokens merged by the DFA's byte classes, where it has few of them
            if spec == r"[a-z ]{1,20}":
                assert classed is not None and len(classed.unique.order) < len(v.order) // 2
            for state in range(g.dfa.num_states):
                want = _allowed_ref(g, state)
                assert np.array_equal(g.allowed(state), want), (kind, state)
                assert np.array_equal(unpack_mask(g.mask(state), v.size), want)
            assert np.array_equal(g.allowed(-1), _allowed_ref(g, -1))
        assert cache.get(kind, spec) is g  # (cached)


def test_guide_state_follows_the_output_and_its_rewinds(byte_vocab):
    g = GuideCache(byte_vocab).get("choice", json.dumps(["yes", "no"]))
    st = GuideState(g)
    out = list(b"ye")
    s = st.at(out)
    assert s == g.dfa.walk(0, b"ye") and not st.complete(out)
    out.append(ord("s"))
    assert st.complete(out)
    assert st.at(out, step=1) == g.dfa.walk(0, b"y")
    out[1:] = list(b"o")  # replaced after the first token: an invalid path
    assert st.at(out) == -1
    assert st.at(list(b"n")) == g.dfa.walk(0, b"n")


def _random_walk(g: Guide, rng: random.Random, limit: int = 400) -> bytes:
    out: list[int] = []
    st = GuideState(g)
    for _ in range(limit):
        ok = np.nonzero(unpack_mask(st.mask(out), g.vocab.size))[0]
        t = int(rng.choice(list(ok)))
        if t in g.vocab.eos:
            break
        out.append(t)
        if st.complete(out):
            break
    return b"".join(g.vocab.of[t] or b"" for t in out)


SCHEMA = {
    "$defs": {"tag": {"enum": ["a", "b", 3, None]}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6, "description": "ignored"},
        "age": {"type": "integer"},
        "score": {"type": ["number", "null"]},
        "ok": {"type": "boolean"},
        "when": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "kind": {"const": "x"},
        "any": {
            "anyOf": [
                {"type": "string", "pattern": "^[A-Z]{2}$"},
                {"type": "array", "items": {"type": "null"}},
            ]
        },
    },
    "required": ["age", "tags"],
}


def _valid(value, schema, root=SCHEMA) -> bool:
    """A small validator for SCHEMA's keywords."""
    if "$ref" in schema:
        return _valid(value, root["$defs"][schema["$ref"].split("/")[-1]], root)
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_valid(value, s, root) for s in schema["anyOf"])
    t = schema.get("type")
    if isinstance(t, list):
        return any(_valid(value, {**schema, "type": x}, root) for x in t)
    if t == "object":
        props = schema["properties"]
        return (
            isinstance(value, dict)
            and set(value) <= set(props)
            and all(r in value for r in schema.get("required", []))
            and all(_valid(v, props[k], root) for k, v in value.items())
        )
    if t == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 1 << 30)
        return (
            isinstance(value, list)
            and lo <= len(value) <= hi
            and all(_valid(v, schema["items"], root) for v in value)
        )
    if t == "string":
        if not isinstance(value, str) or len(value) > schema.get("maxLength", 1 << 30):
            return False
        if "pattern" in schema:
            return re.fullmatch(schema["pattern"].strip("^$"), value) is not None
        return schema.get("format") != "date" or re.fullmatch(r"\d{4}-\d\d-\d\d", value) is not None
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    return value is None


def test_random_walks_of_a_json_schema_guide_are_valid_instances(byte_vocab):
    rng = random.Random(7)
    g = GuideCache(byte_vocab).get("json", json.dumps(SCHEMA))
    done = 0
    for _ in range(40):
        text = _random_walk(g, rng)
        if not g.matches(text):
            continue  # (hit the walk's length limit)
        value = json.loads(text.decode())
        assert _valid(value, SCHEMA), text
        done += 1
    assert done >= 20


def test_json_object_and_choice_walks(byte_vocab):
    rng = random.Random(3)
    cache = GuideCache(byte_vocab)
    for _ in range(20):
        value = json.loads(_random_walk(cache.get("json_object", ""), rng, 2000).decode())
        assert isinstance(value, dict)
        assert _random_walk(cache.get("choice", json.dumps(["red", "green", "r\u00e9d"])), rng).decode() in (
            "red",
            "green",
            "r\u00e9d",
        )


def _json_vocab(rng: random.Random) -> VocabBytes:
    """Single bytes, then tokens that open, close and mix several containers at once, and JSON-ish pieces."""
    pieces: list[bytes | None] = [bytes([b]) for b in range(256)]
    pieces += [
        *(w.encode() for w in ('{"', '"}', "}}", "]]", "[[", "[{", "}]", '": ', "}}}", "]}]", '{"a":[{"b":')),
        *(
            w.encode()
            for w in ('"x"}', ', "', "null}", "1]", "[]", "{}", "],[", "}, {", '":[', "[[[[", "]]]]")
        ),
    ]
    text = b'{}[]",:ab1 '
    pieces += [bytes(rng.choice(text) for _ in range(rng.randint(2, 6))) for _ in range(200)]
    pieces += [None]
    return VocabBytes.build(pieces, eos=[len(pieces) - 1])


def _nested_allowed_ref(g: NestedGuide, state) -> np.ndarray:
    """Token by token through the pushdown walk; EOS where the output so far is a whole match."""
    v = g.vocab
    ok = np.array([bool(b) and g.walk(state, b)[0] >= 0 for b in v.of])
    q, stack = state
    if q < 0 or (not stack and g.dfa.accept[q]) or not ok.any():
        ok[list(v.eos)] = True
    return ok


def _checked_walk(g: NestedGuide, rng: random.Random, limit: int) -> tuple[bytes, int]:
    """A random walk of a pushdown guide, each state's mask (made now, and cached) checked against the
    token-by-token walk on the way: (its text, the deepest stack it reached)."""
    st, out, deepest = GuideState(g), [], 0
    for _ in range(limit):
        s = st.at(out)
        want = _nested_allowed_ref(g, s)
        assert np.array_equal(g.allowed(s), want), s
        assert np.array_equal(unpack_mask(g.mask(s), g.vocab.size), want), s
        deepest = max(deepest, len(s[1]))
        t = int(rng.choice(list(np.nonzero(want)[0])))
        if t in g.vocab.eos:
            break
        out.append(t)
        if st.complete(out):
            break
    return b"".join(g.vocab.of[t] or b"" for t in out), deepest


FREE = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "data": {}, "tags": {"type": "array", "items": True}},
    "required": ["id", "data"],
}


@pytest.mark.parametrize("kind, spec", [("json_object", ""), ("json", json.dumps(FREE))])
def test_nested_json_guides_masks_walks_and_depth(kind, spec):
    """Free JSON values nest to any depth through the pushdown guide: its masks (cached ones too, shared by
    states whose stacks differ below what a token can pop) equal a token-by-token walk, random walks are
    valid documents nesting past the old unrolled depth of 3, and MAX_JSON_DEPTH bounds the nesting."""
    rng = random.Random(5)
    v = _json_vocab(rng)
    g = GuideCache(v).get(kind, spec)
    assert isinstance(g, NestedGuide) and g.max_pops >= 3 and g.max_pushes >= 4
    deepest = done = 0
    for _ in range(25):
        text, depth = _checked_walk(g, rng, 300)
        deepest = max(deepest, depth)
        if g.matches(text):
            value = json.loads(text)
            assert isinstance(value, dict), text
            if kind == "json":  # (FREE's instances: an integer id, any data, tags a list of anything)
                assert set(value) - {"tags"} == {"id", "data"} and type(value["id"]) is int, text
                assert isinstance(value.get("tags", []), list), text
            done += 1
    assert done >= 10 and deepest > 3
    # nesting: up to MAX_JSON_DEPTH containers open inside the top object, not one more
    head = b'{"id": 1, "data": ' if kind == "json" else b'{"a":'
    opened = g.walk(g.start, head + b"[" * MAX_JSON_DEPTH)
    assert len(opened[1]) == MAX_JSON_DEPTH and g.step(opened, ord("[")) == (-1, ())
    assert g.matches(head + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}")
    assert not g.matches(head + b"[" * 5 + b"]" * 4 + b"}")


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "n": {"type": "string", "maxLength": 3},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                "tag": {"$ref": "#/$defs/tag"},
            },
            "required": ["n"],
        },
        # mutually recursive with itself through an array of pairs: a second kind of container
        "tag": {
            "type": "array",
            "maxItems": 2,
            "items": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/tag"}]},
        },
    },
    "$ref": "#/$defs/node",
}


def _tree_ok(v) -> bool:
    def tag(t) -> bool:
        return isinstance(t, list) and len(t) <= 2 and all(type(x) is int or tag(x) for x in t)

    return (
        isinstance(v, dict)
        and set(v) <= {"n", "kids", "tag"}
        and isinstance(v.get("n"), str)
        and len(v["n"]) <= 3
        and all(_tree_ok(k) for k in v.get("kids", []))
        and isinstance(v.get("kids", []), list)
        and ("tag" not in v or tag(v["tag"]))
    )


def test_recursive_refs_nest_to_any_depth():
    """A recursive $ref (a tree of nodes, an array nesting itself) is a call of its own container automaton:
    instances of any depth match, masks equal a token-by-token walk, random walks are valid trees."""
    rng = random.Random(11)
    v = _json_vocab(rng)
    g = GuideCache(v).get("json", json.dumps(TREE))
    assert isinstance(g, NestedGuide) and len(g.kinds) == 3  # (node, tag and the free kind)
    deep = '{"n": "a", "kids": [' * 9 + '{"n": "b", "tag": [1, [2, [3]]]}' + "]}" * 9
    assert g.matches(deep.encode()) and _tree_ok(json.loads(deep))
    assert not g.matches(b'{"kids": []}') and not g.matches(b'{"n": "a", "tag": [1, 2, 3]}')
    done = 0
    for _ in range(25):
        text, _ = _checked_walk(g, rng, 250)
        if g.matches(text):
            assert _tree_ok(json.loads(text)), text
            done += 1
    assert done >= 5


def test_marker_characters_in_a_schema_stay_text(byte_vocab):
    """The private-use characters a nested guide's markers are written with: in a const they are text (even
    beside free values), in a pattern they are refused."""
    schema = {
        "type": "object",
        "properties": {"k": {"const": "\ue000\ue001"}, "v": {}},
        "required": ["k", "v"],
    }
    g = GuideCache(byte_vocab).get("json", json.dumps(schema))
    assert isinstance(g, NestedGuide)
    assert g.matches('{"k": "\ue000\ue001", "v": [[{}]]}'.encode())
    assert not g.matches(b'{"k": "", "v": 1}')
    with pytest.raises(RequestError, match="private-use"):
        GuideCache(byte_vocab).get("json", json.dumps({"type": "string", "pattern": "a\ue000"}))


@pytest.mark.parametrize(
    "kind, spec, words",
    [
        ("regex", "(a", "guided_regex: missing ')'"),
        ("choice", "[]", "non-empty list"),
        ("choice", '["a", 3]', "non-empty list"),
        ("choice", "nope", "is not JSON"),
        ("json", "[" * 30_000 + "]" * 30_000, "nests too deep"),
        ("json", '{"type": "integer", "minimum": 3}', "'minimum' is not supported"),
        ("json", '{"$ref": "#/$defs/missing"}', "points nowhere"),
        ("json", '{"$ref": "#"}', "must point to an object or array schema"),
        (
            "json",
            '{"type": "array", "items": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/s"}]}, "$defs": {"s": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/s"}]}}}',
            "must point to an object or array",
        ),
        ("json", '{"type": "object", "properties": {"a": {}}, "required": ["b"]}', "required names"),
        ("json", '{"type": "tuple"}', "unknown type"),
        ("json", '{"type": "string", "pattern": "a+", "maxLength": 3}', "minLength / maxLength together"),
        ("regex", "[^\\s\\S]", "matches no text"),
        ("xml", "", "must be one of"),
    ],
)
def test_bad_guides_are_request_errors_naming_the_field(kind, spec, words, byte_vocab):
    with pytest.raises(RequestError, match=re.escape(words)):
        GuideCache(byte_vocab).get(kind, spec)


def test_guide_of_takes_at_most_one_guide():
    assert guide_of() == ()
    assert guide_of(regex="a+") == ("regex", "a+")
    assert guide_of(choice=["x", "\u00e9"]) == ("choice", '["x", "\u00e9"]')
    assert guide_of(json_schema={"type": "null"}) == ("json", '{"type": "null"}')
    assert guide_of(json_object=True) == ("json_object", "")
    with pytest.raises(RequestError, match="guided_choice: cannot be combined with guided_regex"):
        guide_of(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="must be a list of strings"):
        guide_of(choice="abc")
    # the regexes the schema keywords make are this module's syntax
    for fmt in ("date", "time", "date-time", "uuid"):
        compile_regex(guide_regex("json", json.dumps({"type": "string", "format": fmt})))


# ---- through the engine ----------------------------------------------------------------------------------
REGEX = r"[a-f]{2,4}@\d{1,3}\.(com|org)"


def test_guided_greedy_takes_the_likeliest_allowed_token_each_step(eng):
    """Greedy guided tokens are the argmax of the model's logits (`score`) over the guide's tokens at each
    step, and the text a whole match ending with "stop" (no EOS step after a match nothing can extend)."""
    import torch

    prompt = eng.encode("contact: ")
    out = eng.generate(prompt, max_new_tokens=30, guided_regex=REGEX)[0]
    assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop"
    guide = GuideCache(
        VocabBytes.build(token_bytes_table(eng.tokenizer, eng.cfg.vocab_size), eng.cfg.eos_ids())
    )
    g = guide.get("regex", REGEX)
    logits = eng.score(prompt + out.token_ids)[len(prompt) - 1 :]
    st = GuideState(g)
    for i, t in enumerate(out.token_ids):
        ok = torch.from_numpy(g.allowed(st.at(out.token_ids, i)))
        assert t == int(logits[i].masked_fill(~ok, float("-inf")).argmax()), i


def test_guided_sampling_choices_and_json_through_generate(eng):
    prompts = ["a", "bb", "ccc"]
    got = eng.generate(
        prompts, max_new_tokens=20, temperature=1.0, seed=11, guided_choice=["red", "green", "blue"]
    )
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in got)
    # the draw is seeded: the same tokens again
    again = eng.generate(
        prompts, max_new_tokens=20, temperature=1.0, seed=11, guided_choice=["red", "green", "blue"]
    )
    assert [c.token_ids for c in again] == [c.token_ids for c in got]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    }
    for c in eng.generate(prompts, max_new_tokens=60, temperature=0.7, seed=2, top_k=20, guided_json=schema):
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool), c.text
    for c in eng.generate("x", max_new_tokens=200, temperature=0.5, seed=5, guided_json_object=True):
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict)


def test_a_guided_request_leaves_its_batch_neighbours_alone(eng):
    from longctx.engine.request import SamplingParams

    p, q = eng.encode("zz"), eng.encode("hello world")
    plain = SamplingParams(max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    alone = run_requests(eng, [q], [plain])
    guided = SamplingParams(max_new_tokens=12, temperature=0.9, seed=4, guided=("regex", REGEX))
    got = run_requests(eng, [p, q], [guided, plain])
    assert got[1] == alone[0]
    assert re.fullmatch(REGEX, bytes(got[0][0]).decode()) and got[0][1] == "stop"


def test_guided_tokens_are_the_same_overlapped_with_graphs_and_over_stages(tiny_dir, eng):
    from longctx import Engine
    from longctx.engine.request import SamplingParams

    prompts = ["one", "two two", "three three three"]
    kw = dict(max_new_tokens=16, temperature=0.8, seed=9, guided_regex=REGEX)
    want = [(c.token_ids, c.finish_reason) for c in eng.generate(prompts, **kw)]
    with Engine(tiny_dir, device="cpu", overlap=True, cuda_graphs=True) as ov:
        assert [(c.token_ids, c.finish_reason) for c in ov.generate(prompts, **kw)] == want
        # guided rows keep the overlap: step n+1's forward is launched before step n's tokens are read
        assert ov.stats()["device_fed_steps"] > 0
        # guided requests decoding beside plain ones, one finishing mid-way: each as without overlap
        ids = [eng.encode(q) for q in prompts]
        params = [
            SamplingParams(max_new_tokens=12, temperature=0.9, seed=4, guided=("regex", REGEX)),
            SamplingParams(max_new_tokens=10, temperature=0.7, seed=5, ignore_eos=True),
            SamplingParams(max_new_tokens=6, guided=("choice", json.dumps(["yes", "no", "maybe so"]))),
        ]
        fed = ov.stats()["device_fed_steps"]
        assert run_requests(ov, ids, params) == run_requests(eng, ids, params)
        assert ov.stats()["device_fed_steps"] > fed
        # and step n+2's forward was launched as soon as step n+1's draw was queued
        assert ov.stats()["launched_ahead"] > 0
    with Engine(tiny_dir, device="cpu", kv_pages=16, chunk_size=29, pp=2) as e:
        assert [(c.token_ids, c.finish_reason) for c in e.generate(prompts, **kw)] == want


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(guided_regex="(a"), "guided_regex: missing ')'"),
        (dict(guided_regex="a", guided_choice=["b"]), "at most one guide"),
        (dict(guided_regex="a+", min_tokens=2, max_new_tokens=4), "min_tokens: cannot be combined"),
        (dict(guided_regex="a+", ignore_eos=True), "ignore_eos: cannot be combined"),
        (dict(guided_regex="a+", allowed_token_ids=[97]), "allowed_token_ids: cannot be combined"),
        (dict(guided_regex="a+", bad_words=["b"]), "bad_words: cannot be combined"),
        (dict(guided_json={"type": "string", "multipleOf": 2}), "'multipleOf' is not supported"),
    ],
)
def test_bad_guided_requests_are_refused_and_the_engine_goes_on(eng, kw, words):
    with pytest.raises(RequestError, match=re.escape(words)):
        eng.generate("p", **{"max_new_tokens": 4, **kw})
    assert eng.generate("p", max_new_tokens=2, ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("vocab", [8, 13, 300])
def test_shape_logits_applies_each_guided_rows_mask_after_the_other_shaping(vocab):
    import torch

    from longctx.engine.plan import RowPlan
    from longctx.engine.sampling import shape_logits

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    masks = torch.rand(4, vocab, generator=g) < 0.5
    masks[:, 0] = True
    packed = [np.packbits(m.numpy(), bitorder="little").tobytes() for m in masks]
    rows = [
        RowPlan("a", (1,), 0, (0,), guide_mask=packed[0]),
        RowPlan("b", (1,), 0, (0,)),  # unguided, unshaped
        RowPlan("c", (1,), 0, (0,), guide_mask=packed[2], logit_bias=((0, 5.0),), suppress=(1,)),
        RowPlan("d", (1,), 0, (0,), logit_bias=((2 % vocab, -3.0),)),
    ]
    got = shape_logits(logits, rows, [i for i, r in enumerate(rows) if r.shaped])
    want = logits.clone()
    want[2, 0] += 5.0
    want[2, 1] = float("-inf")
    want[3, 2 % vocab] -= 3.0
    for i in (0, 2):
        want[i] = want[i].masked_fill(~masks[i], float("-inf"))
    assert torch.equal(got, want)
    # every row guided (shaped in place), and a batch of one
    every = [RowPlan(f"r{i}", (1,), 0, (0,), guide_mask=packed[i]) for i in range(4)]
    assert torch.equal(shape_logits(logits, every, range(4)), logits.masked_fill(~masks, float("-inf")))
    one = shape_logits(logits[2:3], every[2:3], [0])
    assert torch.equal(one, logits[2:3].masked_fill(~masks[2:3], float("-inf")))
    with pytest.raises(ValueError, match="guide mask of 8 bits"):
        shape_logits(torch.zeros(1, 9), [RowPlan("e", (1,), 0, (0,), guide_mask=b"\xff")], [0])


def test_mask_caches_are_bounded_in_states_and_bytes(monkeypatch):
    import longctx.engine.guided as guided

    pieces: list[bytes | None] = [bytes([b]) for b in range(256)] + [None] * 3000  # 409-byte masks
    g = GuideCache(VocabBytes.build(pieces, eos=[256])).get("regex", "[a-z]{0,50}")
    monkeypatch.setattr(guided, "MASK_BYTES_PER_GUIDE", 409 * 10)
    g.masks.clear()  # (those made as it was compiled)
    for s in range(30):
        g.mask(s)
    assert len(g.masks) == 10 and list(g.masks) == list(range(20, 30))
    g.mask(25)  # a hit moves to the newest end
    g.mask(40)
    assert list(g.masks)[-2:] == [25, 40] and 20 not in g.masks


def test_a_new_guide_has_the_masks_of_its_first_states_breadth_first(byte_vocab):
    g = GuideCache(byte_vocab).get("regex", "ab(c|d)e{0,9}")
    assert len(g.masks) == g.dfa.num_states  # (fewer than WARM_STATES: every one)
    g.masks.clear()
    g.warm(5)
    walked = [g.dfa.walk(0, t) for t in (b"", b"a", b"ab", b"abc", b"abce")]
    assert list(g.masks) == walked  # (c and d lead to one state)
    for s, packed in g.masks.items():
        assert np.array_equal(unpack_mask(packed, byte_vocab.size), g.allowed(s))


def test_random_specs_compile_or_are_request_errors(byte_vocab):
    """Arbitrary patterns and JSON as guides: each compiles (and its start state's mask is made) or is a
    RequestError; nothing else escapes (a RecursionError did, for groups nested thousands deep)."""
    from tests.test_server_fuzz import json_value

    rng = random.Random(17)
    alphabet = [*"ab()[]{}|*+?.^$\\-,:09dDwWsSxuU<>P=!é\n", "\\d", "[a-", "(?:", "(?P<n>", "{2,3}", "\\x4"]
    compiled = 0
    for _ in range(300):
        kind = rng.choice(["regex", "regex", "json", "choice"])
        if kind == "regex":
            spec = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        else:
            spec = json.dumps(json_value(rng), allow_nan=True)
        try:
            g = GuideCache(byte_vocab).get(kind, spec)
            g.mask(g.start)
            compiled += 1
        except RequestError as e:
            assert "\n" not in str(e) and e.param in ("guided_regex", "guided_json", "guided_choice")
    assert compiled > 20


def test_an_any_of_with_a_free_alternative_is_free():
    """`anyOf` / `oneOf` holding a free value ({} / true, directly or through a $ref) accepts every value: an
    object the specific alternative does not describe too, nested as deep as any free value."""
    specific = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for free in ({}, True, {"$ref": "#/$defs/anything"}):
        for key in ("anyOf", "oneOf"):
            schema = {
                "type": "object",
                "properties": {"v": {key: [specific, free]}},
                "required": ["v"],
                "$defs": {"anything": {"description": "any value"}},
            }
            g = GuideCache(_json_vocab(random.Random(0))).get("json", json.dumps(schema))
            assert isinstance(g, NestedGuide)
            for text in ('{"v": {"a": 1}}', '{"v": {"b": [1, {"c": null}]}}', '{"v": 3}', '{"v": "x"}'):
                assert g.matches(text.encode()), (free, key, text)
            assert not g.matches(b'{"v": }') and not g.matches(b'{"w": 1}')
    # without the free alternative the union stays the specific object's (and numbers)
    only = {"anyOf": [specific, {"type": "number"}]}
    g = GuideCache(_json_vocab(random.Random(0))).get("json", json.dumps(only))
    assert g.matches(b'{"a": 1}') and g.matches(b"2.5") and not g.matches(b'{"b": 1}')
