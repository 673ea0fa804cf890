"""Token counting in the target model's tokenizer.

Lengths in the workloads are counted in the tokenizer of the model under test: the model
directory's `tokenizer.json` for the embedded engine, `--tokenizer DIR` for a server, and a UTF-8
byte count otherwise (exact for longctx's byte-level default tokenizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from longctx.errors import LongctxError


class TokenizerError(LongctxError):
    """A tokenizer directory that cannot be used."""


class TokenCounter(Protocol):
    """Counts (and, when it can, produces) the token ids of text, without special tokens."""

    name: str

    def count(self, text: str) -> int: ...

    def count_many(self, texts: list[str]) -> list[int]: ...

    def encode(self, text: str) -> list[int] | None: ...

    def decode(self, ids: list[int]) -> str | None: ...


class ByteCounter:
    """One token per UTF-8 byte (the byte-level tokenizer, or a stand-in when none is known)."""

    name = "bytes"

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def count_many(self, texts: list[str]) -> list[int]:
        return [len(t.encode("utf-8")) for t in texts]

    def encode(self, text: str) -> list[int] | None:
        return None

    def decode(self, ids: list[int]) -> str | None:
        return None


class HFCounter:
    """A Hugging Face `tokenizers.Tokenizer` (a model directory's tokenizer.json)."""

    def __init__(self, tokenizer, name: str = "tokenizer.json") -> None:  # tokenizers.Tokenizer
        self.tok = tokenizer
        self.name = name

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def count_many(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int] | None:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str | None:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_counter(tokenizer_dir: str | Path | None) -> TokenCounter:
    """The counter for `tokenizer_dir/tokenizer.json`, or a byte counter when `tokenizer_dir` is None."""
    if tokenizer_dir is None:
        return ByteCounter()
    p = Path(tokenizer_dir)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise TokenizerError(f"no tokenizer.json in {tokenizer_dir}")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises plain Exceptions with multi-line messages
        raise TokenizerError(f"cannot read {f}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    return HFCounter(tok, name=str(f))


class PieceCache:
    """Token counts of short text pieces, memoised: haystacks repeat the same words endlessly."""

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter
        self._memo: dict[str, int] = {}

    def counts(self, pieces: list[str]) -> list[int]:
        memo = self._memo
        missing = list(dict.fromkeys(p for p in pieces if p not in memo))
        if missing:
            memo.update(zip(missing, self.counter.count_many(missing)))
        return [memo[p] for p in pieces]
