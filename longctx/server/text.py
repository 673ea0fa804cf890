"""Text <-> tokens for the frontend: tokenizer, chat template, incremental detokenizer.

The model directory's `tokenizer.json` and chat template are read with the checkpoint helpers
(`longctx.checkpoint.tokenizer` / `chat_template`), so the server renders prompts exactly as
`longctx generate` and transformers do. A directory without a tokenizer (the fake engine's) gets
the byte-level tokenizer random checkpoints ship.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from longctx.checkpoint.chat_template import apply_chat_template, load_chat_template
from longctx.checkpoint.tokenizer import load_tokenizer, make_tokenizer, unicode_to_byte
from longctx.errors import LongctxError

log = logging.getLogger("longctx.server")

_SENTINEL = "\u2063LONGCTX_DOCUMENT\u2063"
NORMALISER_SLACK = 4


class TextCodec:
    """Tokenizer + chat template of one model directory."""

    def __init__(self, model_dir: str | None, chat_template: str | None = None) -> None:
        """`chat_template`: this template instead of the model directory's (`serve --chat-template`)."""
        d = Path(model_dir) if model_dir else None
        tok = load_tokenizer(d) if d is not None and d.is_dir() else None
        if tok is None:
            log.info("no tokenizer.json in %s: using the byte-level tokenizer", model_dir)
            tok = make_tokenizer()
        self.tok: Any = tok
        # the most text characters one token can stand for, with room for a normaliser that composes
        # characters: so len(text) / this is a lower bound on its tokens (`min_tokens`)
        self.max_chars_per_token = NORMALISER_SLACK * max(
            (len(k) for k in tok.get_vocab(with_added_tokens=True)), default=1
        )
        self.chat_template = chat_template or (
            load_chat_template(d) if d is not None and d.is_dir() else None
        )

    # ---- tokens -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch, not encode: the single-text call holds the GIL while it works, and a long text
        # tokenised on a worker thread froze the server's event loop (seconds per megabyte)
        return list(self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without tokenising it (a text far too long for the
        context is refused before a tokeniser spends seconds on it)."""
        return -(-len(text) // self.max_chars_per_token)

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` stands for. Its decoded text, unless that holds a replacement
        character (a token that is part of a UTF-8 character): then its own bytes, read from the
        byte-level alphabet or a `<0xNN>` byte-fallback piece, so a client can join tokens' bytes
        back into the text (OpenAI's `bytes`)."""
        text = self.decode([tid])
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tok.id_to_token(tid) or ""
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(m.group(1), 16)])
        table = unicode_to_byte()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    # ---- chat -------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's text for `messages` (raises ValueError on a template error).

        continue_final_message (vLLM's): the text ends with the last message's content, open, without the
        end of its turn, so the model goes on from it (an assistant's answer begun by the client)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            kw: dict[str, Any] = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            text = apply_chat_template(messages, add_generation_prompt, template=self.chat_template, **kw)
        except LongctxError as e:
            raise ValueError(str(e)) from None
        if not continue_final_message:
            return text
        last = str(messages[-1].get("content") or "")
        core = last.strip()
        at = text.rfind(core) if core else -1
        if at < 0:
            raise ValueError(
                "continue_final_message: the chat template does not keep the last message's text"
            )
        end = at + len(core)
        tail = last[len(last.rstrip()) :]  # (the message's own trailing space, where the template kept it)
        return text[: end + len(tail)] if text.startswith(tail, end) else text[:end]

    def document_frame(self) -> tuple[str, str]:
        """(text before, text after) the user turn's content in a one-message chat.

        A document prompt is `before + document + separator + question + after`; tokenising
        `before + document` on its own keeps the document's tokens a stable prefix.
        """
        text = self.render_chat([{"role": "user", "content": _SENTINEL}])
        before, sep, after = text.partition(_SENTINEL)
        if not sep:
            raise ValueError("the chat template drops the user's message")
        return before, after


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    vLLM's scheme: decode a short window ending at the new tokens and emit the part after the
    previously emitted window; hold back while the tail is an incomplete UTF-8 sequence.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int] | tuple[int, ...]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.codec.decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete sequence decodes to U+FFFD)."""
        prefix_text = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.codec.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
