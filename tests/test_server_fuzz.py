"""Fuzzed bad input on every HTTP route of `longctx serve` (the fake engine), from a fixed seed.

The contract: bad input never crashes anything. Every answer is a 4xx with an OpenAI-style error body whose
message says what is wrong (not Python's words for its internals), or a 2xx where the input happens to be
valid; never a 5xx or a dropped connection; the server answers valid requests afterwards; and the requests
it had accepted (long ones kept running in the background all through the fuzz) complete with exactly the
output they would have had.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .server_helpers import fake_server

SEED = 20261206
N = 2500  # requests (about 10 s)
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONTEXT = 512
JSON = {"content-type": "application/json"}
# what no message of a 4xx may hold: Python's own words for its internals, not what is wrong with the input
UNCLEAR = re.compile(
    r"Traceback|internal error|set_int_max_str_digits|has no attribute|unhashable|not subscriptable"
    r"|maximum recursion depth|NoneType"
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with fake_server(
        tmp_path_factory.mktemp("fuzz"),
        "--api-key",
        KEY,
        "--max-context",
        str(MAX_CONTEXT),
        "--served-model-name",
        "fake",
        step_delay_s=0.002,
    ) as s:
        yield s


# ---- what is sent ----------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
# values of the wrong type or range for most fields (each route's own edge values are added below)
GENERIC: list[Any] = [
    None, True, False, 0, 1, -1, 2**31, 2**63, 2**70, -(2**70), 10**400, 1.5, -0.0, NAN, INF, -INF, 1e308,
    "", " ", "x", "5", "\u0000", "\ud800", "\U0001f600", "x" * 3000, [], [None], [1], [[1]], [[]], ["a"],
    [""], [1.5], [-1], [2**70], [True], {}, {"a": 1}, {"": None}, [[[[[]]]]],
]  # fmt: skip
SAMPLING: dict[str, list[Any]] = {
    "model": ["fake", "gpt-4", "../x", "\ud83d"],
    "max_tokens": [0, 1, 3, 2**63 - 1 + 1, -(2**63)],
    "temperature": [0, 0.0, 1e-320, 100, 100.0001, -1e-9],
    "top_p": [1e-320, 1, 1.0000001, 0],
    "top_k": [-1, 0, 2**31 - 1, 2**31, -2],
    "seed": [-1, -2, 0, 2**63 - 1, 2**63],
    "stop": [[""], ["a"] * 17, ["x" * 1000], "a", ["a", 5], ["\ud800"], ["\U0001f600"], "\n"],
    "stream": [True, "true", 1],
    "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, {"continuous_usage_stats": True},
                       {"include_usage": True, "continuous_usage_stats": True}, []],
    "n": [0, 1, 2, 16, 17, 2**63],
    "presence_penalty": [-2, 2, 2.0001, -2.5],
    "frequency_penalty": [-2, 2, 3],
    "repetition_penalty": [0, 1e-300, 100, 100.5, -1],
    "ignore_eos": [True, "no", 0],
    "include_stop_str_in_output": [True, False, "yes", 1],
    "allowed_token_ids": [[5], [97, 98], [], [-1], [2**63], [319], [320], "7", [True], list(range(1025))],
    "use_beam_search": [False, True, "no"],
    "logits_processors": [[], ["pkg.Proc"], "x"],
    "bad_words": [[], ["bad"], None, [""], [" "], ["a"] * 65, "bad", [5]],
    "truncate_prompt_tokens": [-1, 0, 1, 3, -2, 2**63, 1.5],
    "user": ["u", 5],
    "min_tokens": [0, 1, 2, 3, 2**63, -1],
    "min_p": [0, 1, 1.01, -0.01],
    "stop_token_ids": [[0], [319], [320], [-1], [2**63], "7", [True], list(range(1025))],
    "logit_bias": [{"5": 100}, {"5": 101}, {"9" * 5000: 1}, {"0" * 5000 + "5": 1}, {"x": 1}, {"-1": 1},
                   {"\u00b2": 1}, {"5": "1"}, {"5": NAN}, {str(i): 1 for i in range(1025)}, [5, 1],
                   {"320": 1}, {" 7": 1, "7": 2}],
    "guided_regex": ["a+", "(", "", 5, "[^\u00e9]", "(?=a)", "a{99999}", "\ud800", "x" * 70000],
    "guided_choice": [["a", "b"], [], "a", [1], [""], ["\ud800"], ["a"] * 1025],
    "guided_json": [{"type": "object"}, {}, True, 3, "nope", "{}", {"minimum": 1}, {"$ref": "#"},
                    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}],
    "response_format": [{"type": "json_object"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": 5},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "array"}}}, {"type": "xml"}, "json"],
    "structured_outputs": [{"regex": "a"}, {"choice": ["a"]}, {"json": {}}, {"json_object": True}, {"grammar": "x"},
                           {}, [], {"regex": 5}],
    "guided_grammar": ["root ::= x", None],
    "tools": [[], [{"type": "function", "function": {"name": "f"}}], [{"type": "function"}], [5], "f",
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 1}}}],
              [{"type": "function", "function": {"name": "f"}}] * 2],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "g"}}, "any", 5],
}  # fmt: skip
MESSAGES: list[Any] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "wizard", "content": "hi"}],
    [{"role": "user"}],
    [{"content": "hi"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"text": "a"}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": ["a"]}],
    [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}],
    [{"role": "assistant", "content": "  "}],
    [{"role": "tool", "content": "x", "name": "f"}],
    [{"role": "user", "content": "a", "name": "<|user|>"}],
    [{"role": "user", "content": "{{ 7 * 7 }}{% for x in y %}"}],
    [{"role": "user", "content": "x" * (4 * MAX_CONTEXT)}],
    [{"role": "user", "content": "hi"}] * 40,
    ["hi"],
    [None],
    [],
    "hi",
]
CHAT_ONLY: dict[str, list[Any]] = {
    "messages": MESSAGES,
    "max_completion_tokens": [0, 2, -1, 2**63],
    "logprobs": [True, False, 1, 0],
    "top_logprobs": [0, 20, 21, -1],
    "add_generation_prompt": [True, False, "no"],
    "continue_final_message": [True, False, 1],
    "prompt_logprobs": [0, 20, 21, -1, True, "1"],
}
PROMPTS: list[Any] = [
    "hi", "", " ", "\u0000", "\U0001f600" * 5, [1, 2, 3], [], [[]], [[1], [2, 3]], ["a", "b"], ["a", ""],
    ["a", [1]], [0], [319], [320], [-1], [2**63], [1.0], [True], ["a"] * 65, [[1]] * 64, "x" * (4 * MAX_CONTEXT),
    [1] * (MAX_CONTEXT + 1), "[gMASK]<sop><|user|>",
]  # fmt: skip
COMPLETION_ONLY: dict[str, list[Any]] = {
    "prompt": PROMPTS,
    "logprobs": [0, 5, 20, 21, -1, True],
    "echo": [True, False, "yes"],
    "suffix": ["", "s", 5],
    "best_of": [1, 2, 3, 0, 2**70],
    "prompt_logprobs": [0, 20, 21, -1, True, "1"],
}
# route -> (valid body, fields with their edge values)
BODIES: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2}, {**SAMPLING, **COMPLETION_ONLY}),
    "/v1/chat/completions": ({"messages": MESSAGES[0], "max_tokens": 2}, {**SAMPLING, **CHAT_ONLY}),
    "/v1/documents/{doc}/ask": (
        {"question": "q?", "max_tokens": 2},
        {
            **SAMPLING,
            "question": ["", " ", "q", "\ud800", "x" * (4 * MAX_CONTEXT)],
            "logprobs": [True, 1],
            "top_logprobs": [0, 21],
        },
    ),  # fmt: skip
    "/v1/documents": (
        {"text": "a short document"},
        {"text": ["", " ", "\ud800", "x" * (4 * MAX_CONTEXT)], "name": ["n", "\u0000", 5]},
    ),  # fmt: skip
    "/tokenize": (
        {"prompt": "hi"},
        {
            "prompt": PROMPTS,
            "messages": MESSAGES,
            "add_special_tokens": [True, "no"],
            "add_generation_prompt": [False, 1],
            "continue_final_message": [True, 1],
            "model": ["fake", "x"],
        },
    ),  # fmt: skip
    "/detokenize": (
        {"tokens": [65, 66]},
        {
            "tokens": [[], [0], [319], [320], [-1], [2**63], [-(2**63) - 1], [1.0], ["a"], 5, [[1]]],
            "model": ["fake", "x"],
        },
    ),  # fmt: skip
}
RAW: list[bytes] = [
    b"", b" ", b"null", b"true", b"0", b"[]", b"[{}]", b'"s"', b"{", b"}", b"{]", b"{'a': 1}", b'{"a": 1,}',
    b"\xff\xfe\xfd", b"\xef\xbb\xbf{}", b"\x00" * 32, b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}',
    b"[" * 20000 + b"]" * 20000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"a": 1' + b"0" * 5000 + b"}",
    b'{"a": 1e999999}', b'{"a": "\\ud800"}', b'{"a": "\\x"}', b'{} trailing', b'{}\x00', "{\"a\": \"\u00e9\"}".encode("latin-1"),
    "{}".encode("utf-16"), b'{"a": "' + b"\xc3" + b'"}',
]  # fmt: skip
CONTENT_TYPES: list[str | None] = [
    "application/json", None, "text/plain", "application/json; charset=latin-1", "multipart/form-data",
    "multipart/form-data; boundary=", "application/x-www-form-urlencoded", "application/octet-stream",
]  # fmt: skip
GETS = ["/v1/models", "/v1/stats", "/health", "/metrics", "/v1/documents"]
JUNK_IDS = [
    "x",
    "doc-0",
    "%ff%fe",
    "%00",
    "a" * 3000,
    "..",
    "%2e%2e%2fhealth",
    "fake%20",
    "\u00e9",
    "%F0%9F%98%80",
]


def json_value(rng: random.Random, depth: int = 0) -> Any:
    """An arbitrary JSON value (NaN and infinities included, json.dumps writes them), nested a few deep."""
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice(GENERIC)
    if kind == 1:
        return rng.choice([rng.randint(-(2**70), 2**70), rng.randint(-3, 400)])
    if kind == 2:
        return rng.choice([rng.uniform(-1e3, 1e3), rng.choice([NAN, INF, -INF, 5e-324])])
    if kind == 3:
        alphabet = 'ab \n\t"\\\u00e9\u4e2d\U0001f600\ud800\u0000{}[]'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.choice([True, False, None])
    if kind in (5, 6):
        return [json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(["role", "content", "type", "text", "x", ""]): json_value(rng, depth + 1) for _ in range(2)
    }


def mutated(rng: random.Random, base: dict[str, Any], fields: dict[str, list[Any]]) -> dict[str, Any]:
    """`base` with one to three fields set to an edge value, a wrong-typed one or an arbitrary JSON value,
    or removed; now and then an unknown field too."""
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(list(fields))
        r = rng.random()
        if r < 0.5:
            body[name] = rng.choice(fields[name])
        elif r < 0.75:
            body[name] = rng.choice(GENERIC)
        elif r < 0.9:
            body[name] = json_value(rng)
        else:
            body.pop(name, None)
    if rng.random() < 0.1:
        body[rng.choice(["unknown", "functions", "tools", "response_format", ""])] = json_value(rng)
    # (a valid body without a limit would generate the whole context; keep the fuzz quick)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8 and body["max_tokens"] < 2**63:
        body["max_tokens"] = 2
    if "max_tokens" not in body or body["max_tokens"] is None:
        body["max_completion_tokens" if "messages" in base else "max_tokens"] = 2
    return body


def encode(rng: random.Random, body: dict[str, Any]) -> bytes:
    """`body` as JSON (NaN and Infinity as the JSON extensions Python writes; lone surrogates as \\u escapes),
    now and then with a key written twice (the parser keeps the last)."""
    text = json.dumps(body, allow_nan=True)
    if body and rng.random() < 0.1:
        k = rng.choice(list(body))
        text = "{" + json.dumps(k) + ": " + json.dumps(json_value(rng), allow_nan=True) + ", " + text[1:]
    return text.encode()


def multipart(rng: random.Random) -> tuple[bytes, str]:
    """A document upload as multipart, valid or broken."""
    parts = {
        "file": b'Content-Disposition: form-data; name="file"; filename="a.txt"',
        "file*": b"Content-Disposition: form-data; name=\"file\"; filename*=utf-8''%E2%82%AC.txt",
        "bad*": b"Content-Disposition: form-data; name=\"file\"; filename*=bogus''%FF",
        "text": b'Content-Disposition: form-data; name="text"',
        "other": b'Content-Disposition: form-data; name="other"',
        "none": b"Content-Type: text/plain",
    }
    datas = [b"a document", b"", b"h\xe9llo", b"\xed\xa0\x80", b"[gMASK]<sop>", b"x" * (4 * MAX_CONTEXT)]
    out = b""
    for _ in range(rng.randint(0, 3)):
        out += b"--XX\r\n" + rng.choice(list(parts.values())) + b"\r\n\r\n" + rng.choice(datas) + b"\r\n"
    out += rng.choice([b"--XX--\r\n", b"", b"--XX"])
    ctype = rng.choice(["multipart/form-data; boundary=XX", "multipart/form-data", "multipart/form-data; boundary=YY",
                        "multipart/form-data; boundary=XX; charset=bogus"])  # fmt: skip
    return out, ctype


def requests(rng: random.Random, doc: str, n: int) -> Iterator[tuple[str, str, bytes | None, dict[str, str]]]:
    """n (method, path, body, headers) to send."""
    posts = [p.replace("{doc}", doc) for p in BODIES]
    for _ in range(n):
        r = rng.random()
        headers = dict(AUTH)
        if r < 0.55:  # one route's body with fields of the wrong type or range
            route = rng.choice(list(BODIES))
            base, fields = BODIES[route]
            yield (
                "POST",
                route.replace("{doc}", doc),
                encode(rng, mutated(rng, base, fields)),
                {**headers, **JSON},
            )
        elif r < 0.7:  # a body that is not a JSON object, or of another content type
            ctype = rng.choice(CONTENT_TYPES)
            if ctype is not None:
                headers["content-type"] = ctype
            yield "POST", rng.choice(posts), rng.choice(RAW), headers
        elif r < 0.75:  # an arbitrary JSON value as a whole body
            yield (
                "POST",
                rng.choice(posts),
                json.dumps(json_value(rng), allow_nan=True).encode(),
                {**headers, **JSON},
            )
        elif r < 0.8:  # a document upload as multipart
            body, ctype = multipart(rng)
            yield "POST", "/v1/documents", body, {**headers, "content-type": ctype}
        elif r < 0.9:  # the GET routes, the id routes with ids of no document or model, other methods
            method = rng.choice(["GET", "GET", "DELETE", "PUT", "PATCH", "OPTIONS", "POST"])
            path = rng.choice([*GETS, *posts, f"/v1/documents/{rng.choice(JUNK_IDS)}",
                               f"/v1/models/{rng.choice(JUNK_IDS)}", f"/v1/documents/{rng.choice(JUNK_IDS)}/ask",
                               "/nope", "/v1", "/v1/documents/", f"/health?{rng.choice(JUNK_IDS)}=1"])  # fmt: skip
            if method == "DELETE" and path.rstrip("/") == f"/v1/documents/{doc}":
                method = "GET"  # (the fuzz's own document stays)
            yield method, path, rng.choice([None, b"{}", rng.choice(RAW)]), headers
        else:  # a valid body with a missing, wrong or malformed key
            route = rng.choice(list(BODIES))
            auth = rng.choice([{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                               {"Authorization": "Basic " + KEY}, {"Authorization": b"Bearer \xff\xfe"},
                               {"Authorization": "bearer  " + KEY}])  # fmt: skip
            yield "POST", route.replace("{doc}", doc), json.dumps(BODIES[route][0]).encode(), {**auth, **JSON}


# ---- what is checked ----------------------------------------------------------------------------------


def check(r: httpx.Response, what: str) -> None:
    """A 4xx with one clear line in an OpenAI error body, or a 2xx whose body is whole."""
    assert r.status_code < 500, (what, r.status_code, r.text[:300])
    if r.request.method == "HEAD":
        return
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, r.text[:300])
        msg = err["message"]
        assert isinstance(msg, str) and msg.strip(), (what, r.text[:300])
        assert not UNCLEAR.search(msg), (what, msg[:300])
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (what, r.text[-300:])
        for e in events[:-1]:
            err = json.loads(e).get("error")
            assert err is None or err["type"] != "server_error", (what, e)
    elif r.headers.get("content-type", "").startswith("application/json"):
        r.json()


class Canaries:
    """Valid long requests (streamed and not, completions and chat) sent one after another in the background,
    each checked against the output the fake engine gives it (greedy: the prompt's tokens, echoed)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.done: list[str] = []
        self.failed: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        kinds: list[Callable[[httpx.Client, int], str | None]] = [self.plain, self.streamed, self.chat]
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as h:
            i = 0
            while not self.stop.is_set():
                try:
                    bad = kinds[i % len(kinds)](h, 150 + i % 7)
                except Exception as e:  # a dropped connection, a timeout
                    bad = f"{type(e).__name__}: {e}"
                (self.failed if bad else self.done).append(bad or kinds[i % len(kinds)].__name__)
                i += 1

    @staticmethod
    def plain(h: httpx.Client, n: int) -> str | None:
        body = {"prompt": "abc", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = h.post("/v1/completions", json=body)
        c = r.json()["choices"][0] if r.status_code == 200 else {}
        ok = c.get("text") == ("abc" * n)[:n] and c.get("finish_reason") == "length"
        return None if ok else f"plain: {r.status_code} {r.text[:200]}"

    @staticmethod
    def streamed(h: httpx.Client, n: int) -> str | None:
        body = {"prompt": "xyz", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
        text, finish, lines = "", None, []
        with h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines += [line] if line else []
                if line.startswith("data: {"):
                    c = json.loads(line[6:])["choices"][0]
                    text += c["text"]
                    finish = c["finish_reason"] or finish
        ok = (
            r.status_code == 200
            and text == ("xyz" * n)[:n]
            and finish == "length"
            and lines[-1] == "data: [DONE]"
        )
        return None if ok else f"streamed: {r.status_code} {lines[-3:]}"

    @staticmethod
    def chat(h: httpx.Client, n: int) -> str | None:
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = h.post("/v1/chat/completions", json=body)
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
        return None if ok else f"chat: {r.status_code} {r.text[:200]}"


def test_fuzzed_bad_input_on_every_route(srv):
    rng = random.Random(SEED)
    with httpx.Client(base_url=srv.url, timeout=60) as h:
        r = h.post("/v1/documents", json={"text": "the fuzz's document", "name": "fuzz"}, headers=AUTH)
        assert r.status_code == 200, r.text
        doc = r.json()["id"]
        canaries = Canaries(srv.url)
        canaries.thread.start()
        sent = 0
        for i, (method, path, body, headers) in enumerate(requests(rng, doc, N)):
            what = f"#{i} {method} {path[:80]} {body[:200] if body else body!r} {headers}"
            try:
                r = h.request(method, path, content=body, headers=headers)
            except httpx.HTTPError as e:  # (a dropped connection)
                raise AssertionError(f"{what}: {type(e).__name__}: {e}") from None
            check(r, what)
            sent += 1
            if i % 100 == 0:
                assert h.get("/health").status_code == 200, what
        canaries.stop.set()
        canaries.thread.join(60)
        assert not canaries.failed, canaries.failed
        assert len(canaries.done) >= 3, canaries.done  # (accepted requests ran all through the fuzz)
        # every route still answers a valid request, the fuzz's document still there
        assert h.get("/health").json()["status"] == "ok"
        for route, (base, _) in BODIES.items():
            r = h.post(route.replace("{doc}", doc), json=base, headers=AUTH)
            assert r.status_code == 200, (route, r.text)
        assert h.get(f"/v1/documents/{doc}", headers=AUTH).json()["name"] == "fuzz"
        for path in GETS:
            assert h.get(path, headers=AUTH).status_code == 200, path
    assert sent == N


def test_logit_bias_keys_past_pythons_digit_limit_name_the_field():
    """A logit_bias key of more than 4300 digits was refused in int()'s words ("Exceeds the limit (4300 digits)
    for integer string conversion ... use sys.set_int_max_str_digits()"); it is refused as a key that is no
    token id, and leading zeros past that limit are still read."""
    from pydantic import ValidationError

    from longctx.server.protocol import CompletionRequest, validation_error

    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "a", "logit_bias": {"9" * 5000: 1}})
    err = validation_error(e.value)
    assert (
        err.status == 400
        and str(err) == "logit_bias: keys are token ids, got '99999999999999999999'... (5000 characters)"
    )
    ok = CompletionRequest.model_validate({"prompt": "a", "logit_bias": {"0" * 5000 + "5": 1, " 7": 2}})
    assert ok.bias_pairs() == ((5, 1.0), (7, 2.0))


@pytest.mark.parametrize(
    "body, says",
    [
        (b'{"prompt": 1' + b"0" * 5000 + b"}", "request body has a number of more than 4300 digits"),
        (b"[" * 20000 + b"]" * 20000, "request body is nested too deeply"),
    ],
)
def test_json_pythons_parser_refuses_for_its_own_limits_says_so(srv, body, says):
    """(Both said "request body is not valid JSON:" and then Python's message: "Exceeds the limit (4300 digits)
    for integer string conversion: value has 5001 digits; use sys.set_int_max_str_digits() to increase the
    limit", "maximum recursion depth exceeded while decoding a JSON array from a unicode string".)"""
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={**AUTH, **JSON})
    assert r.status_code == 400 and r.json()["error"]["message"] == says, r.text
    assert r.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    "name, shown",
    [
        ("gpt-4", "`gpt-4`"),
        ("a\nb", "'a\\nb'"),
        ("m" * 5000, "'" + "m" * 200 + "'... (5000 characters)"),
    ],
)
def test_an_unknown_model_name_is_repeated_on_one_short_line(srv, name, shown):
    """The 404 repeated the client's model name as given: a name with a line break gave a message of two lines,
    and a long one came back whole."""
    r = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": "a"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert r.json()["error"]["message"] == f"The model {shown} does not exist; this server serves `fake`"


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ],
)
def test_output_the_server_does_not_make_is_refused_not_ignored(srv, route, body):
    """Grammar-guided decoding, beam search and logits processors were ignored as unknown fields: the client got
    free text it had not asked for and no word of it. They are a 400 naming the field; the forms that change
    nothing (a "text" response_format, tools the model may not call, empty lists) and the guides longctx makes
    (JSON mode and schemas, vLLM's regex / choice / json, tool calls by name, "required" or "auto") are served.
    Tool calls are a chat's: completions refuse them."""
    refused = {
        "tool_choice": ({"tool_choice": "any"}, 'must be "none", "auto", "required"'),
        "functions": ({"functions": [{"name": "f"}], "function_call": "auto"}, "not supported"),
        "guided_grammar": ({"guided_grammar": "root ::= 'a'"}, "not supported"),
        "structured_outputs": (
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            "grammar is not supported",
        ),
        "use_beam_search": ({"use_beam_search": True}, "not supported"),
        "logits_processors": ({"logits_processors": ["pkg.Proc"]}, "not supported"),
        "response_format": ({"response_format": {"type": "xml"}}, 'type must be "text"'),
        "guided_regex": ({"guided_regex": 5}, "must be a string"),
        "guided_choice": ({"guided_choice": "yes"}, "must be a list of strings"),
        "guided_json": ({"guided_json": 3}, "must be a JSON schema"),
    }
    for param, (extra, words) in refused.items():
        r = httpx.post(srv.url + route, json={**body, **extra}, headers=AUTH)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text
    # two guides at once
    r = httpx.post(srv.url + route, json={**body, "guided_regex": "a+", "guided_choice": ["a"]}, headers=AUTH)
    assert r.status_code == 400 and "at most one guide" in r.json()["error"]["message"], r.text
    served = [
        {"response_format": {"type": "text"}},
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            }
        },
        {"guided_json": {"type": "object"}},
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"regex": "a+"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
        {"tools": [], "tool_choice": "auto"},
        {"functions": [{"name": "f"}], "function_call": "none"},
        {"guided_json": None},
        {"use_beam_search": False, "logits_processors": []},
    ]
    for extra in served:
        r = httpx.post(srv.url + route, json={**body, **extra}, headers=AUTH)
        assert r.status_code == 200, (extra, r.text)
    # tool calls by name, "required" or "auto" (the default): a chat's (two tokens: no whole call, text back)
    for choice in ("required", {"type": "function", "function": {"name": "f"}}, "auto", None):
        tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": choice}
        r = httpx.post(
            srv.url + route, json={**body, **{k: v for k, v in tools.items() if v is not None}}, headers=AUTH
        )
        if "chat" in route:
            assert r.status_code == 200, r.text
        else:
            err = r.json()["error"]
            assert (
                r.status_code == 400 and err["param"] == "tools" and "for chat completions" in err["message"]
            )
