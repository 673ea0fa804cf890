"""Bad input over HTTP refused in the input's words, not Python's (`longctx serve`, the fake engine)."""

from __future__ import annotations

import httpx
import pytest

from .server_helpers import fake_server

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONTEXT = 512
JSON = {"content-type": "application/json"}


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
