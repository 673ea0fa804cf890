"""The byte-level tokenizer written into random checkpoints (and the loader for any tokenizer.json).

Ids 0..255 are the 256 single bytes (id == byte value), so any UTF-8 text round-trips exactly
and arbitrary bytes round-trip through `encode_bytes`/`decode_bytes`. Special tokens follow from
id 256 in the order of `SPECIAL_TOKENS`. There are no merges: one token per byte keeps tests
predictable (a token count is a byte count).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from longctx.config import ModelConfig
from longctx.errors import CheckpointError, ConfigError

SPECIAL_TOKENS = (
    "<|pad|>",  # 256
    "<|endoftext|>",  # 257
    "<|user|>",  # 258
    "<|assistant|>",  # 259
    "<|system|>",  # 260
    "<|observation|>",  # 261
    "[gMASK]",  # 262
    "<sop>",  # 263
)
NUM_BYTES = 256
TOKENIZER_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def make_tokenizer(cfg: ModelConfig | None = None) -> Tokenizer:
    """Build the byte-level tokenizer; checks it fits in `cfg.vocab_size` when a config is given."""
    if cfg is not None and cfg.vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size {cfg.vocab_size} is too small for the byte tokenizer ({TOKENIZER_VOCAB_SIZE} tokens)"
        )
    vocab = {c: b for b, c in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == NUM_BYTES + i, t
    return tok


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The model directory's `tokenizer.json`, or None when it has none."""
    p = Path(model_dir) / "tokenizer.json"
    if not p.exists():
        return None
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the tokenizers library raises plain Exceptions with multi-line text
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read {p}: {msg}") from None


def encode_bytes(tok: Tokenizer, data: bytes) -> list[int]:
    """Token ids of raw bytes (valid UTF-8 or not): one single-byte token per byte."""
    b2u = byte_to_unicode()
    ids = [tok.token_to_id(b2u[b]) for b in data]
    if any(i is None for i in ids):
        raise CheckpointError("tokenizer has no single-byte tokens: it is not byte-level")
    return ids  # type: ignore[return-value]


def decode_bytes(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> bytes:
    """The exact bytes of a byte-level token sequence (no UTF-8 repair), e.g. for streaming output.

    Special tokens are emitted as their UTF-8 text unless `skip_special_tokens`.
    """
    u2b = unicode_to_byte()
    added = tok.get_added_tokens_decoder()  # id -> AddedToken: text as is, not byte-level chars
    out = bytearray()
    for i in ids:
        a = added.get(i)
        if a is not None:
            if not (skip_special_tokens and a.special):
                out.extend(a.content.encode("utf-8"))
            continue
        t = tok.id_to_token(i)
        if t is None or not all(c in u2b for c in t):
            raise CheckpointError(f"token id {i} is not a byte-level token of this tokenizer")
        out.extend(u2b[c] for c in t)
    return bytes(out)


def tokenizer_config(cfg: ModelConfig, chat_template: str) -> dict:
    """`tokenizer_config.json` so transformers' AutoTokenizer loads the directory as a fast tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": chat_template,
    }


def save_tokenizer(cfg: ModelConfig, out_dir: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (with the GLM-like chat template)."""
    from longctx.checkpoint.chat_template import DEFAULT_CHAT_TEMPLATE

    out = Path(out_dir)
    make_tokenizer(cfg).save(str(out / "tokenizer.json"))
    text = json.dumps(tokenizer_config(cfg, DEFAULT_CHAT_TEMPLATE), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(text + "\n")


def token_bytes_table(tok: Tokenizer, size: int) -> list[bytes | None]:
    """Each token id's bytes below `size` (a model's vocabulary may pass its tokenizer's): a byte-level
    piece read back through GPT-2's alphabet, a `<0xNN>` byte-fallback piece as its byte, another piece
    as its UTF-8 text (SentencePiece's '▁' a space); None for special tokens and ids without a piece."""
    u2b = unicode_to_byte()
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    out: list[bytes | None] = []
    for i in range(size):
        piece = None if i in special else tok.id_to_token(i)
        if not piece:
            out.append(None)
        elif m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            out.append(bytes([int(m.group(1), 16)]))
        elif all(c in u2b for c in piece):
            out.append(bytes(u2b[c] for c in piece))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out
