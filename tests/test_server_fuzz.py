"""Bad input over HTTP refused in the input's words, not Python's (`longctx serve`, the fake engine)."""

from __future__ import annotations

import pytest


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
