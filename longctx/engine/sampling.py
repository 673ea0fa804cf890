"""Token sampling: greedy, temperature, top-k, top-p, seeded per request and per token.

The generator for token n of a request is seeded from (request seed, n), so a request samples the
same tokens whatever it is batched with and whichever process samples it.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15


def _token_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * _MIX) & 0x7FFF_FFFF_FFFF_FFFF


def sample_rows_device(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """logits [R, vocab] -> one token per row (rows carry temperature/top_p/top_k/seed/step), as an
    int64 tensor on logits' device. Nothing is read back here: the caller reads the whole batch with
    one transfer, the step's only host synchronisation (`StageWorker.resolve`)."""
    toks = torch.argmax(logits, dim=-1)
    for i, r in enumerate(rows):
        if r.temperature > 0.0:
            toks[i] = _sample(logits[i], r.temperature, r.top_p, r.top_k, r.seed, r.step)
    return toks


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int, step: int
) -> torch.Tensor:
    """A 0-d tensor on logits' device: argmax when temperature is 0, else a seeded draw."""
    if temperature <= 0.0:
        return torch.argmax(logits)
    x = logits.float() / temperature
    if top_k and top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    gen = torch.Generator(device=probs.device).manual_seed(_token_seed(seed, step))
    return torch.multinomial(probs, 1, generator=gen)[0]


def logprobs_row(logits: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-probability of `token` under the model's distribution, and the top-n alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if n:
        v, i = torch.topk(lp, n)
        top = tuple((int(a), float(b)) for a, b in zip(i.tolist(), v.tolist()))
    return float(lp[token].item()), top
