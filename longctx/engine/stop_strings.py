"""Stop strings: where a request's output text reaches one of its stop strings.

They are matched in the decoded text, not in token ids, and no match may end within the text of the
request's first min_tokens tokens. After a step only the tail of the output that its new tokens could
complete is decoded (`ends_in_stop`); a finished request's text is cut at its first match (`stop_in`
from its first token), as `generate` returns it: before it, or after it with include_stop_str_in_output.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from longctx.engine.request import Request, find_stop


def stop_in(tokenizer: Tokenizer, req: Request, start: int) -> tuple[str, int | None]:
    """The text of req's tokens from `start` on, and where it is cut for its stop strings (`find_stop`:
    where the first begins, or with include_stop_str_in_output where the first to complete ends; None:
    nowhere). No stop string may end within the first min_tokens tokens' text."""
    ids, n_min = req.output_ids, req.params.min_tokens
    text = tokenizer.decode(ids[start:])
    if not req.params.stop:
        return text, None
    floor = len(tokenizer.decode(ids[start:n_min])) if n_min > start else 0
    return text, find_stop(text, req.params.stop, floor=floor, include=req.params.include_stop_str_in_output)


def ends_in_stop(tokenizer: Tokenizer, req: Request, new_tokens: int) -> bool:
    """Whether req's last `new_tokens` output tokens complete one of its stop strings."""
    p = req.params
    if not (p.stop and new_tokens and len(req.output_ids) > p.min_tokens):
        return False
    # A new match must end in the new tokens, so only a tail can hold it: a stop string of
    # n characters spans at most 4n tokens (one UTF-8 byte per token at worst), plus one
    # token whose partial character may decode as U+FFFD.
    window = 4 * max(len(s) for s in p.stop) + new_tokens + 1
    return stop_in(tokenizer, req, max(0, len(req.output_ids) - window))[1] is not None
