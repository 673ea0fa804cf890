"""Token sampling: logit bias and min_tokens, penalties, greedy, temperature, min-p, top-k, top-p, seeded
per request and per token.

The generator for token n of a request is seeded from (request seed, n), so a request samples the
same tokens whatever it is batched with and whichever process samples it.

Penalties (`Penalties`) change the logits a token is drawn from, greedy ones included; logprobs stay
the model's own distribution. The last stage keeps, per penalised request, the tokens it sampled by
index on the device (a token sampled again for the same index replaces the first), so counting them
needs no host round trip, and the prompt's token set for a repetition penalty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from longctx.seeds import MASK63, generator_seed

_MIX = 0x9E3779B97F4A7C15
# temperatures below this draw greedily (vLLM's _SAMPLING_EPS): dividing by a smaller one overflows the
# logits to inf, and a row of inf is NaN probabilities, which fail the whole step's batch
GREEDY_BELOW = 1e-5


def _token_seed(seed: int, step: int) -> int:
    # (a seed is taken modulo 2**63, see SamplingParams.validate)
    return (generator_seed(seed & MASK63) * 1_000_003 + step * _MIX) & MASK63


def sample_rows_device(logits: torch.Tensor, rows: list, penalties: Penalties | None = None) -> torch.Tensor:
    """logits [R, vocab] -> one token per row (rows carry temperature/top_p/top_k/seed/step and the
    penalties), as an int64 tensor on logits' device. Nothing is read back here: the caller reads the
    whole batch with one transfer, the step's only host synchronisation (`StageWorker.resolve`).
    Penalised rows need `penalties`, which records the tokens drawn for them."""
    shaped = [i for i, r in enumerate(rows) if r.shaped]
    if shaped:
        logits = shape_logits(logits, rows, shaped)
    penalised = [i for i, r in enumerate(rows) if r.penalised]
    if penalised:
        if penalties is None:
            raise ValueError("penalised rows need the last stage's Penalties")
        logits = penalties.apply(logits, rows, penalised)
    toks = torch.argmax(logits, dim=-1)
    for i, r in enumerate(rows):
        if r.temperature > 0.0:
            toks[i] = _sample(logits[i], r.temperature, r.top_p, r.top_k, r.seed, r.step, r.min_p)
    if penalised:
        assert penalties is not None
        penalties.record(toks, rows, penalised)
    return toks


def shape_logits(logits: torch.Tensor, rows: Sequence[Any], which: Iterable[int]) -> torch.Tensor:
    """A float32 copy of logits [R, vocab] with rows `which` shaped: each row's logit_bias added and its
    `suppress` tokens set to -inf (before the penalties, as vLLM orders its logits processors)."""
    x = logits.float().clone()
    vocab = x.shape[1]
    bias_at: list[int] = []  # flat indices into x (row * vocab + token): one copy and one launch a step
    bias: list[float] = []
    off: list[int] = []
    for i in which:
        r = rows[i]
        bias_at += [i * vocab + t for t, _ in r.logit_bias]
        bias += [b for _, b in r.logit_bias]
        off += [i * vocab + t for t in r.suppress]
    flat = x.view(-1)
    if bias_at:
        flat.index_add_(0, _on(x.device, bias_at, torch.int64), _on(x.device, bias, torch.float32))
    if off:
        flat.index_fill_(0, _on(x.device, off, torch.int64), float("-inf"))
    return x


def _on(device: torch.device, values: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor on `device`, copied from pinned memory so the step does not wait for it."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def shape_ref(
    logits: torch.Tensor, logit_bias: Sequence[tuple[int, float]] = (), suppress: Sequence[int] = ()
) -> torch.Tensor:
    """Reference for one row's logits [vocab], token by token."""
    x = logits.float().clone()
    for t, b in logit_bias:
        x[t] += b
    for t in suppress:
        x[t] = float("-inf")
    return x


def penalise_ref(
    logits: torch.Tensor,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> torch.Tensor:
    """Reference for one row's logits [vocab]: the repetition penalty over every token of the prompt
    and the output (a positive logit divided by it, a negative one multiplied), then
    logit -= frequency_penalty * count + presence_penalty * (count > 0) over the output's counts."""
    x = logits.float().clone()
    seen = sorted(set(prompt_ids) | set(output_ids))
    if repetition_penalty != 1.0 and seen:
        v = x[seen]
        x[seen] = torch.where(v > 0, v / repetition_penalty, v * repetition_penalty)
    for t in set(output_ids):
        x[t] -= frequency_penalty * list(output_ids).count(t) + presence_penalty
    return x


class Penalties:
    """Per-request device state of the penalties (the last stage's): the tokens sampled so far, by
    index, and the prompt's token set. Freed by `release`."""

    def __init__(self) -> None:
        self._out: dict[str, torch.Tensor] = {}  # rid -> int64 [capacity] tokens by step index
        self._prompt: dict[str, torch.Tensor] = {}  # rid -> bool [vocab]

    def __len__(self) -> int:
        return len(self._out.keys() | self._prompt.keys())

    def apply(self, logits: torch.Tensor, rows: Sequence[Any], which: Iterable[int]) -> torch.Tensor:
        """A float32 copy of logits [R, vocab] with rows `which` penalised (their tokens 0..step-1)."""
        x = logits.float().clone()
        vocab = x.shape[1]
        for i in which:
            r = rows[i]
            if r.penalty_prompt:
                mask = torch.zeros(vocab, dtype=torch.bool, device=x.device)
                mask[torch.tensor(r.penalty_prompt, dtype=torch.int64).to(x.device)] = True
                self._prompt[r.rid] = mask
            out = self._out.get(r.rid)
            have = 0 if out is None else min(r.step, out.numel())
            if have < r.step:
                raise ValueError(f"request {r.rid}: sampling token {r.step} but only {have} were recorded")
            counts = torch.bincount(out[: r.step], minlength=vocab) if out is not None and r.step else None
            row = x[i]
            if r.repetition_penalty != 1.0:
                seen = self._prompt.get(r.rid)
                if seen is None:
                    raise ValueError(f"request {r.rid}: a repetition penalty without the prompt's tokens")
                if counts is not None:
                    seen = seen | (counts > 0)
                hit = torch.where(row > 0, row / r.repetition_penalty, row * r.repetition_penalty)
                row = torch.where(seen, hit, row)
            if counts is not None:
                row = row - r.frequency_penalty * counts - r.presence_penalty * (counts > 0).float()
            x[i] = row
        return x

    def record(self, toks: torch.Tensor, rows: Sequence[Any], which: Iterable[int]) -> None:
        """Keep row i's sampled token toks[i] as its request's token `step` (device to device)."""
        for i in which:
            r = rows[i]
            out = self._out.get(r.rid)
            if out is None or out.numel() <= r.step:
                grown = torch.zeros(max(16, 2 * (r.step + 1)), dtype=torch.int64, device=toks.device)
                if out is not None:
                    grown[: out.numel()] = out
                self._out[r.rid] = out = grown
            out[r.step : r.step + 1] = toks[i : i + 1]

    def release(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self._out.pop(rid, None)
            self._prompt.pop(rid, None)


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    step: int,
    min_p: float = 0.0,
) -> torch.Tensor:
    """A 0-d tensor on logits' device: argmax when temperature is 0 (below GREEDY_BELOW), else a seeded draw
    (min_p, then top-k, then top-p, as vLLM applies them)."""
    if temperature < GREEDY_BELOW:
        return torch.argmax(logits)
    x = logits.float() / temperature
    # (a tiny repetition penalty divides the seen tokens' positive logits to +inf: those tokens, equally,
    # instead of NaN probabilities; every token suppressed, min_tokens with the whole vocabulary in
    # stop_token_ids: a uniform draw)
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    x = torch.where(torch.isneginf(x).all(), torch.zeros_like(x), x)
    if min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k and top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False  # (a top_p that is 0 in fp32, 1e-320, would drop the first too)
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


# positions whose full-vocabulary logits exist at once (a 2K chunk of a GLM vocabulary would be 1.2 GB)
PROMPT_LP_ROWS = 256


def prompt_logprobs_device(
    to_logits: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: Sequence[int], n: int
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `targets` (the next token of position i, whose hidden row is h[i]) with their top-n
    alternatives, left on the device: (targets, chosen [m], top values [m, n], top ids [m, n]).
    `to_logits` (the lm head) runs PROMPT_LP_ROWS positions at a time."""
    parts = []
    for a in range(0, len(targets), PROMPT_LP_ROWS):
        b = min(a + PROMPT_LP_ROWS, len(targets))
        lp = torch.log_softmax(to_logits(h[a:b]).float(), dim=-1)
        chosen = lp.gather(1, _on(lp.device, targets[a:b], torch.int64)[:, None])[:, 0]
        if n:
            top = torch.topk(lp, n, dim=-1)
            parts.append((chosen, top.values, top.indices))
        else:
            parts.append((chosen, lp.new_empty(b - a, 0), lp.new_empty(b - a, 0, dtype=torch.int64)))
    return list(targets), *(torch.cat(x) for x in zip(*parts))  # type: ignore[return-value]


def prompt_logprobs_host(
    targets: list[int], chosen: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor
) -> tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...]:
    """`prompt_logprobs_device`'s result as (token, logprob, ((alternative, logprob), ...)) per target."""
    vals, ids = top_v.tolist(), top_i.tolist()
    return tuple(
        (t, float(c), tuple((int(a), float(b)) for a, b in zip(ii, vv)))
        for t, c, vv, ii in zip(targets, chosen.tolist(), vals, ids)
    )
