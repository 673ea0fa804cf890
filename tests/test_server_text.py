"""The frontend's chat rendering: continue_final_message (vLLM's) leaves the last message open."""

from __future__ import annotations

import pytest

from longctx.server.text import TextCodec

from .server_helpers import with_chat_template

# a template that closes every turn, as most do
CLOSING = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def codec(tmp_path):
    return TextCodec(str(with_chat_template(tmp_path, CLOSING)))


def test_continue_final_message_drops_the_end_of_the_last_turn(codec):
    msgs = [{"role": "user", "content": "What is the number?"}, {"role": "assistant", "content": "It is "}]
    closed = codec.render_chat(msgs, add_generation_prompt=False)
    assert closed.endswith("<|assistant|>It is <|end|>\n")
    assert (
        codec.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
        == closed[: -len("<|end|>\n")]
    )
    # the last message's content is found at the end even when it also appears earlier
    twice = [{"role": "user", "content": "It is"}, {"role": "assistant", "content": "It is"}]
    assert codec.render_chat(twice, add_generation_prompt=False, continue_final_message=True).endswith(
        "|>It is"
    )
    with pytest.raises(ValueError, match="cannot both be true"):
        codec.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="does not keep the last message"):
        codec.render_chat(
            [{"role": "user", "content": ""}], add_generation_prompt=False, continue_final_message=True
        )


def test_continue_final_message_over_http(tmp_path):
    """A chat that continues the assistant's begun answer is tokenised as the open text (/tokenize), and a
    bad combination is a 400."""
    import httpx

    from tests.server_helpers import fake_server

    with_chat_template(tmp_path, CLOSING)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    with fake_server(tmp_path) as s:
        body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
        t = httpx.post(s.url + "/tokenize", json=body).json()
        d = httpx.post(s.url + "/detokenize", json={"tokens": t["tokens"]}).json()
        assert d["prompt"].endswith("<|end|>\nHello")  # (the role markers are special tokens, skipped)
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == t["count"]
        bad = httpx.post(s.url + "/v1/chat/completions", json={**body, "add_generation_prompt": True})
        assert bad.status_code == 400 and "cannot both be true" in bad.json()["error"]["message"]


def test_min_tokens_is_a_lower_bound(codec):
    text = "a " * 5000 + "The end."
    assert codec.encode(text) == list(codec.tok.encode(text, add_special_tokens=False).ids)
    for text in ["", "a", "hello world " * 50, "\u00e9\u4e2d\U0001f600" * 40, "<|endoftext|>" * 9]:
        assert codec.min_tokens(text) <= len(codec.encode(text))
    assert codec.min_tokens("x" * 10_000_000) > 10_000_000 // (4 * 64)


def test_token_bytes_join_back_into_the_text(codec):
    """OpenAI's logprobs `bytes`: a token inside a UTF-8 character has its own byte, not the bytes of
    U+FFFD (which is what its decoded text holds)."""
    text = "caf\u00e9 \u4e2d\u6587 \U0001f600!"
    ids = codec.encode(text)
    assert any("\ufffd" in codec.decode([t]) for t in ids)  # (the case in question)
    assert b"".join(codec.token_bytes(t) for t in ids).decode("utf-8") == text
