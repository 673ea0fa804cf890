"""Token sampling: logit bias and min_tokens, penalties, greedy, temperature, min-p, top-k, top-p, seeded
per request and per token.

Every sampled row of a step draws at once (`draw_rows`): the masks batched, then one Gumbel-max
kernel (`longctx.kernels.gumbel`) whose noise for token n of a request is hashed from (request
seed, n) and the token id, so a request samples the same tokens whatever it is batched with and
whichever process samples it. `_sample` is the one-row reference.

Penalties (`Penalties`) change the logits a token is drawn from, greedy ones included; logprobs stay
the model's own distribution. The last stage keeps, per penalised request, the tokens it sampled by
index on the device (a token sampled again for the same index replaces the first), so counting them
needs no host round trip, and the prompt's token set for a repetition penalty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from longctx.kernels.argmax import argmax_rows
from longctx.kernels.gumbel import gumbel_argmax, gumbel_argmax_ref, scale_logits_ref
from longctx.kernels.penalties import penalise
from longctx.seeds import MASK63, generator_seed

_MIX = 0x9E3779B97F4A7C15
# temperatures below this draw greedily (vLLM's _SAMPLING_EPS): dividing by a smaller one overflows the
# logits to inf, and a row of inf is NaN probabilities, which fail the whole step's batch
GREEDY_BELOW = 1e-5


def _token_seed(seed: int, step: int) -> int:
    # (a seed is taken modulo 2**63, see SamplingParams.validate)
    return (generator_seed(seed & MASK63) * 1_000_003 + step * _MIX) & MASK63


def sample_rows_device(
    logits: torch.Tensor, rows: list, penalties: Penalties | None = None, backend: str = "auto"
) -> torch.Tensor:
    """logits [R, vocab] -> one token per row (rows carry temperature/top_p/top_k/seed/step and the
    penalties), as an int64 tensor on logits' device. Nothing is read back here: the caller reads the
    whole batch with one transfer, the step's only host synchronisation (`StageWorker.resolve`).
    Penalised rows need `penalties`, which records the tokens drawn for them. The sampled rows draw
    together (`draw_rows`; `backend` picks its Gumbel kernel's implementation)."""
    shaped = [i for i, r in enumerate(rows) if r.shaped]
    if shaped:
        logits = shape_logits(logits, rows, shaped)
    penalised = [i for i, r in enumerate(rows) if r.penalised]
    if penalised:
        if penalties is None:
            raise ValueError("penalised rows need the last stage's Penalties")
        logits = penalties.apply(logits, rows, penalised, backend)
    toks = draw_rows(logits, rows, backend)
    if penalised:
        assert penalties is not None
        penalties.record(toks, rows, penalised)
    return toks


def shape_logits(logits: torch.Tensor, rows: Sequence[Any], which: Iterable[int]) -> torch.Tensor:
    """A float32 copy of logits [R, vocab] with rows `which` shaped: each row's logit_bias added, its
    `suppress` tokens set to -inf, and with `allowed` tokens every other one too (before the penalties, as
    vLLM orders its logits processors); then a guided row's tokens outside its `guide_mask` -inf."""
    x = logits.float().clone()
    vocab = x.shape[1]
    bias_at: list[int] = []  # flat indices into x (row * vocab + token): one copy and one launch a step
    bias: list[float] = []
    off: list[int] = []
    keep_rows: list[int] = []  # rows with allowed tokens, and those tokens' flat indices
    keep: list[int] = []
    guided: list[int] = []
    for i in which:
        r = rows[i]
        bias_at += [i * vocab + t for t, _ in r.logit_bias]
        bias += [b for _, b in r.logit_bias]
        off += [i * vocab + t for t in r.suppress]
        if r.allowed:
            keep_rows.append(i)
            keep += [i * vocab + t for t in r.allowed]
        if r.guide_mask:
            guided.append(i)
    if not bias_at and not off and not keep and not guided:
        return x
    flat = x.view(-1)
    ints = [*bias_at, *off, *keep, *keep_rows, *guided]
    cols: list[tuple[Any, torch.dtype]] = [(ints, torch.int64), (bias, torch.float32)]
    if guided:  # the packed masks ride the same copy (8x fewer bytes than bools) and are unpacked there
        packed = np.stack([np.frombuffer(rows[i].guide_mask, dtype=np.uint8) for i in guided])
        if packed.shape[1] * 8 < vocab:
            raise ValueError(f"a guide mask of {packed.shape[1] * 8} bits for a vocabulary of {vocab}")
        cols.append((torch.from_numpy(packed).view(-1), torch.uint8))
    at, values, *masks = _all_on(x.device, *cols)
    nb, no, nk, nr = len(bias_at), len(off), len(keep), len(keep_rows)
    if bias_at:
        flat.index_add_(0, at[:nb], values)
    if off:
        flat.index_fill_(0, at[nb : nb + no], float("-inf"))
    if keep:  # the allowed tokens' values kept, their rows' other tokens -inf
        kept = flat.index_select(0, at[nb + no : nb + no + nk])
        x.index_fill_(0, at[nb + no + nk : nb + no + nk + nr], float("-inf"))
        flat.index_copy_(0, at[nb + no : nb + no + nk], kept)
    if guided:  # each mask byte's 8 tokens looked up as "not allowed" bits: one gather
        off_bits = _not_allowed(x.device)[masks[0].long()].view(len(guided), -1)[:, :vocab]
        if guided == list(range(x.shape[0])):  # (every row guided: shaped in place)
            x.masked_fill_(off_bits, float("-inf"))
        else:
            g_at = at[nb + no + nk + nr :]
            x.index_copy_(0, g_at, x.index_select(0, g_at).masked_fill_(off_bits, float("-inf")))
    return x


_NOT_ALLOWED: dict[torch.device, torch.Tensor] = {}


def _not_allowed(device: torch.device) -> torch.Tensor:
    """bool [256, 8] on `device`: byte -> its 8 bits (least significant first, `Guide.mask`'s order) negated,
    the tokens a mask byte does not allow (made once per device: a copy each step would wait for the host)."""
    t = _NOT_ALLOWED.get(device)
    if t is None:
        t = _NOT_ALLOWED[device] = (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0).to(device)
    return t


def _on(device: torch.device, values: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor on `device`, copied from pinned memory so the step does not wait for it."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def _all_on(device: torch.device, *cols: tuple[Any, torch.dtype]) -> list[torch.Tensor]:
    """Each (values, dtype) as a 1-D tensor on `device` (values: a sequence, or a 1-D host tensor of that
    dtype), all through one buffer: on CUDA one copy from
    pinned memory for every column (a sampled step's per-row numbers: temperatures, seeds, top-k, top-p,
    ...), where `_on` per column was a pinned allocation and a copy each. Each column starts at a multiple
    of 8 bytes of the buffer, so its view has its dtype's alignment. The CPU packs the same way (one code
    path, tested there)."""
    host = [v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dt) for v, dt in cols]
    offs: list[int] = []
    size = 0
    for h in host:
        offs.append(size)
        size += -(-h.numel() * h.element_size() // 8) * 8
    cuda = device.type == "cuda"
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    for h, o in zip(host, offs):
        buf[o : o + h.numel() * h.element_size()].copy_(h.view(torch.uint8))
    dev = buf.to(device, non_blocking=cuda)
    return [dev[o : o + h.numel() * h.element_size()].view(h.dtype) for h, o in zip(host, offs)]


def shape_ref(
    logits: torch.Tensor,
    logit_bias: Sequence[tuple[int, float]] = (),
    suppress: Sequence[int] = (),
    allowed: Sequence[int] = (),
) -> torch.Tensor:
    """Reference for one row's logits [vocab], token by token."""
    x = logits.float().clone()
    for t, b in logit_bias:
        x[t] += b
    for t in suppress:
        x[t] = float("-inf")
    if allowed:
        for t in range(x.numel()):
            if t not in allowed:
                x[t] = float("-inf")
    return x


def penalise_row_ref(
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
    """Per-request device state of the penalties (the last stage's). Each request holds a slot of two pools:
    the counts of the tokens it has sampled (int32 [S, vocab], kept up to date as tokens are recorded, so a
    step reads them instead of counting its history again) and its prompt's token set (uint8 [S, vocab]);
    and its tokens by step, to replace a step sampled again and to take back steps a rewound request
    samples anew. Freed by `release`."""

    def __init__(self) -> None:
        self._out: dict[str, torch.Tensor] = {}  # rid -> int64 [capacity] tokens by step index
        self._n: dict[str, int] = {}  # rid -> steps recorded (those the counts hold)
        self._slot: dict[str, int] = {}  # rid -> its row of the pools
        self._free: list[int] = []
        self._prompted: set[str] = set()  # requests whose prompt set was given
        self._counts = torch.zeros(0, 0, dtype=torch.int32)
        self._prompt = torch.zeros(0, 0, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self._slot)

    def apply(
        self, logits: torch.Tensor, rows: Sequence[Any], which: Iterable[int], backend: str = "auto"
    ) -> torch.Tensor:
        """A float32 copy of logits [R, vocab] with rows `which` penalised (their tokens 0..step-1), every
        row in one pass (`longctx.kernels.penalties.penalise`; on CUDA its kernel only with
        PENALTIES_KERNEL_CUDA)."""
        which = list(which)
        if not which:
            return logits.float().clone()
        dev, vocab = logits.device, logits.shape[1]
        sel = [rows[i] for i in which]
        for r in sel:  # (checked before anything changes)
            if self._n.get(r.rid, 0) < r.step:
                raise ValueError(
                    f"request {r.rid}: sampling token {r.step} but only {self._n.get(r.rid, 0)} were recorded"
                )
            if r.repetition_penalty != 1.0 and r.rid not in self._prompted and not r.penalty_prompt:
                raise ValueError(f"request {r.rid}: a repetition penalty without the prompt's tokens")
        self._make_room(sel, vocab, dev)
        gone: list[torch.Tensor] = []  # tokens of steps taken back (past the one sampled now), by slot
        gone_slots: list[int] = []
        for r in sel:
            slot = self._slot[r.rid]
            if r.penalty_prompt:
                self._prompt[slot].zero_()
                self._prompt[slot].index_fill_(0, _on(dev, r.penalty_prompt, torch.int64), 1)
                self._prompted.add(r.rid)
            n = self._n.get(r.rid, 0)
            if n > r.step:  # they leave the counts
                gone.append(self._out[r.rid][r.step : n])
                gone_slots += [slot] * (n - r.step)
                self._n[r.rid] = r.step
        if gone:
            self._count(torch.cat(gone), gone_slots, [-1] * len(gone_slots))
        slots = [-1] * len(rows)
        rep, freq, pres = [1.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows)
        for i, r in zip(which, sel):
            slots[i] = self._slot[r.rid]
            rep[i], freq[i], pres[i] = r.repetition_penalty, r.frequency_penalty, r.presence_penalty
        slot_col, floats = _all_on(dev, (slots, torch.int32), ([*rep, *freq, *pres], torch.float32))
        if logits.is_cuda and not PENALTIES_KERNEL_CUDA:
            backend = "torch"
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        return penalise(logits, slot_col, self._counts, self._prompt, *floats.view(3, -1), backend=backend)

    def _make_room(self, sel: Sequence[Any], vocab: int, dev: torch.device) -> None:
        """A slot for each request of `sel` without one, the pools grown (doubled) to hold them; its counts
        zeroed (its prompt row is read only under a repetition penalty, whose first `apply` sets it)."""
        new = [r.rid for r in sel if r.rid not in self._slot]
        if self._counts.device != dev or self._counts.shape[1] != vocab:
            if self._slot:
                raise ValueError(f"penalties: logits of {vocab} tokens on {dev} after other ones")
            self._counts = torch.zeros(0, vocab, dtype=torch.int32, device=dev)
            self._prompt = torch.zeros(0, vocab, dtype=torch.uint8, device=dev)
        have = self._counts.shape[0]
        if len(new) > len(self._free):
            grow = max(4, have, len(new) - len(self._free))
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grow, vocab)])
            self._prompt = torch.cat([self._prompt, self._prompt.new_zeros(grow, vocab)])
            self._free += range(have + grow - 1, have - 1, -1)
        for rid in new:
            slot = self._slot[rid] = self._free.pop()
            self._counts[slot].zero_()

    def _count(self, tokens: torch.Tensor, slots: list[int], signs: list[int]) -> None:
        """counts[slots[j], tokens[j]] += signs[j] for every j, in one atomic scatter (exact: integers)."""
        at, change = _all_on(tokens.device, (slots, torch.int64), (signs, torch.int32))
        flat = torch.add(tokens, at, alpha=self._counts.shape[1])
        self._counts.view(-1).index_add_(0, flat, change)

    def record(self, toks: torch.Tensor, rows: Sequence[Any], which: Iterable[int]) -> None:
        """Keep row i's sampled token toks[i] as its request's token `step` and count it (device to device:
        the tokens by step in one multi-tensor copy, the counts in one scatter; a step sampled again
        gives back its earlier token's count first)."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        at_slot: list[int] = []  # the counts' changes: (slot, token, +-1), the tokens on the device
        tok: list[torch.Tensor] = []
        sign: list[int] = []
        for i in which:
            r = rows[i]
            n = self._n.get(r.rid, 0)
            assert r.step <= n, (r.rid, r.step, n)
            out = self._out.get(r.rid)
            if out is None or out.numel() <= r.step:
                grown = torch.zeros(max(16, 2 * (r.step + 1)), dtype=torch.int64, device=toks.device)
                if out is not None:
                    grown[: out.numel()] = out
                self._out[r.rid] = out = grown
            slot = self._slot[r.rid]
            cell, new = out[r.step : r.step + 1], toks[i : i + 1]
            if r.step < n:  # (read before the copy below replaces it: same stream)
                at_slot.append(slot)
                tok.append(cell)
                sign.append(-1)
            at_slot.append(slot)
            tok.append(new)
            sign.append(1)
            self._n[r.rid] = max(n, r.step + 1)
            dst.append(cell)
            src.append(new)
        if not dst:
            return
        self._count(torch.cat(tok), at_slot, sign)
        torch._foreach_copy_(dst, src)

    def release(self, rids: Iterable[str]) -> None:
        """Forget these requests; with none left the pools go too (a burst of penalised requests does not
        keep its ~0.8 MB a slot at a GLM vocabulary)."""
        for rid in rids:
            self._out.pop(rid, None)
            self._n.pop(rid, None)
            self._prompted.discard(rid)
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
        if not self._slot and self._counts.numel():
            self._free.clear()
            self._counts = self._counts.new_zeros(0, self._counts.shape[1])
            self._prompt = self._prompt.new_zeros(0, self._prompt.shape[1])


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    step: int,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The reference for one row of `draw_rows`, mask by mask: a 0-d tensor on logits' device, argmax when
    temperature is 0 (below GREEDY_BELOW), else a seeded draw (min_p, then top-k, then top-p, as vLLM
    applies them; the draw is the Gumbel-max of `longctx.kernels.gumbel` over every token)."""
    if temperature < GREEDY_BELOW:
        return torch.argmax(logits)
    x = scale_logits_ref(
        logits.float()[None], torch.tensor([[temperature]], dtype=torch.float32, device=logits.device)
    )[0]
    if min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k and top_k < x.numel():  # the k likeliest tokens (of equal logits, the lower ids)
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        x = torch.full_like(x, float("-inf")).scatter(0, order[:top_k], sorted_x[:top_k])
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False  # (a top_p that is 0 in fp32, 1e-320, would drop the first too)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    key = torch.tensor([_token_seed(seed, step)], dtype=torch.int64, device=x.device)
    return gumbel_argmax_ref(x[None], key)[0]


# top-k without top-p up to this k: a select and a tie rank over the row instead of sorting it
TOP_K_SELECT_MAX = 1024


def _keep_top_k(x: torch.Tensor, top_k: Sequence[int], k: torch.Tensor) -> torch.Tensor:
    """x [D, V] with each row's tokens outside its top_k (0: off) at -inf, the sort's set without a
    sort: the tokens above the row's kth value, then as many equal to it as are left, lower ids first.
    `k`: top_k on x's device (int64 [D, 1])."""
    if not any(top_k):
        return x
    kth = torch.topk(x, max(top_k), dim=1).values.gather(1, (k - 1).clamp_min(0))
    above = x > kth
    tie = x == kth
    keep = above | (tie & (tie.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))
    return x.masked_fill((k > 0) & ~keep, float("-inf"))


def _top_k_sorted(
    x: torch.Tensor, top_k: Sequence[int], k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [D, max(k)] of each row's top k (every row has one) in the stable descending
    sort's order, and -inf past k: what sorting the whole row and cutting it at k gives, from a select
    of max(k) over `_keep_top_k`'s exact set and two sorts of the candidates alone (by id, then stably
    by value). `k` as `_keep_top_k`'s."""
    kept = _keep_top_k(x, top_k, k)
    vals, ids = torch.topk(kept, max(top_k), dim=1)
    by_id = torch.argsort(ids, dim=1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_val = torch.sort(vals, dim=1, descending=True, stable=True).indices
    return vals.gather(1, by_val), ids.gather(1, by_val)


# top-p rows (without a top-k, or with one up to it): first try drawing from this many candidates, the
# likeliest; a step whose top-p rows need more (their first TOP_P_CANDIDATES tokens hold less than top_p of
# the mass) sorts whole rows instead. 0: always sort. On CUDA only with TOP_P_CANDIDATES_CUDA: knowing
# whether the candidates suffice reads a flag back, which makes the host wait for the step's forward, and
# an overlapped decode (step n+1 launched while step n runs) loses its overlap; on the CPU nothing overlaps.
TOP_P_CANDIDATES = 1024
TOP_P_CANDIDATES_CUDA = False
# Temperature-only rows drawn apart from top-p rows in a mixed batch (`draw_rows`), so only the latter sort:
# on the CPU 4-6x faster (1 row in 4 with top_p 0.9, GLM vocabulary: batch 8 78 -> 17 ms, batch 32 328 ->
# 82); on CUDA, where a sort of 32 rows costs less than the launches of a second group, only with
# SPLIT_PLAIN_CUDA (H100, bench.sampling: a mixed batch of 8 split 1.11 ms, 8 top-p rows sorted 0.77).
SPLIT_PLAIN_CUDA = False
# A temperature-only group draws in one launch of the Gumbel kernel on the raw logits (it scales them
# itself) instead of scaling them first (False: scaled first, on CUDA). Checked on an H100
# (bench.gpu_kernel_check --only gumbel_t: the reference's tokens) and faster there at batch 1, 8 and 32
# (bench.sampling, fifty-fourth session: 0.32-0.41 ms against 0.38-0.65, peaked rows); the interpreter
# checks it in CI.
SCALE_IN_KERNEL_CUDA = True
# The penalties in one launch of `longctx.kernels.penalties` (False: the same pools through its torch form,
# on CUDA). Checked on an H100 (bench.gpu_kernel_check --only penalise: bit for bit) and 3.5x faster there
# (bench.sampling, fifty-fourth session: 0.12-0.15 ms against 0.43-0.54 at batch 1-32); the interpreter
# checks it in CI.
PENALTIES_KERNEL_CUDA = True


def _cut_top_p(sx: torch.Tensor, probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sorted logits sx [D, W] (descending, stable) with each row's tokens past its top-p prefix at -inf:
    the smallest prefix whose mass (probs, the row's probabilities in the same order) reaches top_p
    (p: float32 [D, 1] on sx's device)."""
    drop = (probs.cumsum(dim=-1) - probs >= p) & (p < 1.0)
    drop[:, 0] = False  # (a top_p that is 0 in fp32, 1e-320, would drop the first too)
    return sx.masked_fill(drop, float("-inf"))


def _candidates_width(vocab: int) -> int:
    return min(TOP_P_CANDIDATES, vocab - 1)


def _top_p_candidates(
    x: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], cols: _DrawColumns
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a batch with top-p rows where every row has a top-p or a top-k <= TOP_P_CANDIDATES: the
    (values, token ids) [D, W] of each row's kept tokens in sorted order (-inf past them), from its
    likeliest W = TOP_P_CANDIDATES tokens (or its top k) alone, when those hold at least top_p of each
    top-p row's mass; else None (a row needs more: the caller sorts whole rows). The one host
    synchronisation of a step that takes it, where it avoids a sort of every row. `cols`: the draw's
    columns on the device."""
    cap = _candidates_width(x.shape[1])
    if cap <= 0 or all(p >= 1.0 for p in top_p) or (x.is_cuda and not TOP_P_CANDIDATES_CUDA):
        return None
    if any(not (0 < k <= cap or (not k and p < 1.0)) for k, p in zip(top_k, top_p)):
        return None
    sx, order = _top_k_sorted(x, [k or cap for k in top_k], cols.k_or_cap)
    # each row's probabilities under its own normaliser: over its top k (the sort's -inf past k), or over
    # the whole row for a top-p row without one
    has_k = cols.top_k > 0
    top = sx[:, :1]  # (each row's largest logit; softmax's shift, which keeps huge magnitudes finite)
    e = torch.exp(sx - top)
    z = torch.where(has_k, e.sum(dim=1, keepdim=True), torch.exp(x - top).sum(dim=1, keepdim=True))
    probs = e / z
    cut = _cut_top_p(sx, probs, cols.top_p)
    # a top-p row is covered when its last candidate is dropped already (its prefix reached top_p before it;
    # every later token would be dropped too); a top-k row always is
    if not bool((has_k[:, 0] | torch.isneginf(cut[:, -1]) | torch.isneginf(sx[:, -1])).all()):
        return None
    return cut, order


class _DrawColumns:
    """A draw's per-row numbers on the device, as [D, 1] columns (keys [D]): copied there together, in one
    transfer (`_all_on`). top_k is 0 where off; k_or_cap / k_or_vocab put the candidates' width
    (`_candidates_width`) / the vocabulary there instead."""

    def __init__(self, cols: list[torch.Tensor]) -> None:
        f, i = cols
        d = i.numel() // 4
        self.temperature, self.min_p, self.top_p = (c[:, None] for c in f.view(3, d))
        self.keys = i[:d]
        self.top_k, self.k_or_cap, self.k_or_vocab = (c[:, None] for c in i[d:].view(3, d))

    @staticmethod
    def spec(rows: Sequence[Any], vocab: int) -> tuple[tuple[list[Any], torch.dtype], ...]:
        """The two `_all_on` columns of `rows` the constructor takes."""
        top_k = [_top_k_of(r, vocab) for r in rows]
        cap = _candidates_width(vocab)
        floats = [r.temperature for r in rows] + [r.min_p for r in rows] + [r.top_p for r in rows]
        ints = [_token_seed(r.seed, r.step) for r in rows] + top_k
        ints += [k or cap for k in top_k] + [k or vocab for k in top_k]
        return (floats, torch.float32), (ints, torch.int64)


def _top_k_of(r: Any, vocab: int) -> int:
    return r.top_k if 0 < r.top_k < vocab else 0


def draw_rows(logits: torch.Tensor, rows: Sequence[Any], backend: str = "auto") -> torch.Tensor:
    """One token per row of logits [D, V]: the argmax for a temperature below GREEDY_BELOW, else a seeded
    draw (temperature, min_p, top-k, top-p masks as `_sample` applies them, then the Gumbel-max of
    `longctx.kernels.gumbel` keyed by (seed, step)). The rows go in up to three groups, each done at
    once: greedy rows; rows of a temperature alone (no top-p, no top-k: drawn over the whole row); and
    rows that need their tokens in order (top-p, a top-k above TOP_K_SELECT_MAX), which alone sort or
    take their candidates (`_draw`; a temperature-alone row among them would make `_top_p_candidates`
    refuse and every row be sorted; on CUDA only with SPLIT_PLAIN_CUDA). Rows of a top-k up to
    TOP_K_SELECT_MAX without top-p join the second group, or the third when there is one. Every drawn
    row's numbers and the groups' row indices reach the device in one transfer. The noise belongs to
    token ids, so a row draws the same token in any batch and whichever way its masks were made. int64
    [D] on logits' device."""
    dev = logits.device
    d, vocab = logits.shape
    ordered = (not logits.is_cuda or SPLIT_PLAIN_CUDA) and any(
        r.top_p < 1.0 or _top_k_of(r, vocab) > TOP_K_SELECT_MAX for r in rows
    )
    greedy: list[int] = []
    plain: list[int] = []
    rest: list[int] = []
    for i, r in enumerate(rows):
        if r.temperature < GREEDY_BELOW:
            greedy.append(i)
        elif ordered and r.top_p >= 1.0 and not _top_k_of(r, vocab):
            plain.append(i)
        else:
            rest.append(i)
    if len(greedy) == d:
        return argmax_rows(logits, backend=backend)
    groups = [g for g in (plain, rest) if g]
    if not greedy and len(groups) == 1:
        return _draw(logits, rows, _DrawColumns(_all_on(dev, *_DrawColumns.spec(rows, vocab))), backend)
    at, *cols = _all_on(
        dev,
        (sum(groups, []), torch.int64),
        *(c for g in groups for c in _DrawColumns.spec([rows[i] for i in g], vocab)),
    )
    if greedy:
        toks = argmax_rows(logits, backend=backend)
    else:
        toks = torch.empty(d, dtype=torch.int64, device=dev)
    a = 0
    for n, g in enumerate(groups):
        at_g = at[a : a + len(g)]
        a += len(g)
        picked = _draw(
            logits.index_select(0, at_g), [rows[i] for i in g], _DrawColumns(cols[2 * n : 2 * n + 2]), backend
        )
        toks.index_copy_(0, at_g, picked)
    return toks


def _draw(logits: torch.Tensor, rows: Sequence[Any], cols: _DrawColumns, backend: str) -> torch.Tensor:
    """`draw_rows` for one group of rows, all at once, `cols` their numbers on the device. When every row
    has a top-k (<= TOP_K_SELECT_MAX), only its candidates are sorted and drawn from (`_top_k_sorted`);
    else without top-p the top-k is a mask (`_keep_top_k`) and the draw runs over the vocabulary; else,
    when every row has a top-p or a top-k <= TOP_P_CANDIDATES and each top-p row's likeliest
    TOP_P_CANDIDATES tokens hold top_p of its mass, from those candidates (`_top_p_candidates`: one host
    synchronisation to know); else each row is sorted once (both masks cut a suffix of the sorted row).
    Nothing is read back but that one flag."""
    dev = logits.device
    vocab = logits.shape[1]
    min_p = [r.min_p for r in rows]
    top_k = [_top_k_of(r, vocab) for r in rows]
    top_p = [r.top_p for r in rows]
    keys = cols.keys
    alone = not any(top_k) and all(p >= 1.0 for p in top_p) and not any(m > 0.0 for m in min_p)
    if alone and (not logits.is_cuda or SCALE_IN_KERNEL_CUDA):
        # a temperature alone: the kernel scales the logits itself (one launch, nothing written first)
        return gumbel_argmax(logits, keys, temperature=cols.temperature[:, 0], backend=backend)
    x = scale_logits_ref(logits, cols.temperature)
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < cols.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    selectable = any(top_k) and max(top_k) <= TOP_K_SELECT_MAX
    p_cut = False  # whether sx has its top-p cut already
    if selectable and all(top_k):  # every row's candidates are its top k (-inf past k): sort those alone
        sx, order = _top_k_sorted(x, top_k, cols.top_k)
        width = max(top_k)
    elif (cands := _top_p_candidates(x, top_k, top_p, cols)) is not None:  # the likeliest tokens suffice
        (sx, order), p_cut = cands, True
        width = sx.shape[1]
    else:
        if all(p >= 1.0 for p in top_p) and (selectable or not any(top_k)):
            return gumbel_argmax(_keep_top_k(x, top_k, cols.top_k), keys, backend=backend)
        sx, order = torch.sort(x, dim=-1, descending=True, stable=True)
        if any(top_k):
            sx = sx.masked_fill(torch.arange(vocab, device=dev)[None] >= cols.k_or_vocab, float("-inf"))
        # every row with a top-k: only the first max(k) sorted columns can hold a candidate
        width = max(top_k) if all(top_k) else vocab
    if not p_cut and any(p < 1.0 for p in top_p):
        sx = _cut_top_p(sx, torch.softmax(sx, dim=-1), cols.top_p)
    col = gumbel_argmax(sx[:, :width].contiguous(), keys, order[:, :width].contiguous(), backend=backend)
    return order.gather(1, col[:, None])[:, 0]


def logprobs_row(logits: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-probability of `token` under the model's distribution, and the top-n alternatives (the
    reference for one row of `logprobs_rows`)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if n:
        v, i = torch.topk(lp, n)
        top = tuple((int(a), float(b)) for a, b in zip(i.tolist(), v.tolist()))
    return float(lp[token].item()), top


def logprobs_rows(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], ns: Sequence[int]
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """`logprobs_row` for rows `rows` of logits [R, vocab] (their tokens, their top-n) at once: one
    log-softmax, one top-max(n), and two reads back for all of them (per row, three reads were three
    host synchronisations)."""
    lp = torch.log_softmax(logits.index_select(0, _on(logits.device, rows, torch.int64)).float(), dim=-1)
    chosen = lp.gather(1, _on(lp.device, tokens, torch.int64)[:, None])[:, 0]
    width = max(ns, default=0)
    if not width:
        return [(c, ()) for c in chosen.tolist()]
    top = torch.topk(lp, width, dim=-1)
    vals = torch.cat([chosen[:, None], top.values], dim=1).tolist()
    ids = top.indices.tolist()
    return [(v[0], tuple(zip(i[:n], v[1 : n + 1]))) for v, i, n in zip(vals, ids, ns)]


# positions whose full-vocabulary logits exist at once (a 2K chunk of a GLM vocabulary would be 1.2 GB)
PROMPT_LP_ROWS = 256


def prompt_logprobs_device(
    to_logits: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, targets: Sequence[int], n: int
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `targets` (the next token of position i, whose hidden row is h[i]) with their top-n
    alternatives and their ranks (1 + the tokens likelier than it), left on the device: (targets, chosen
    [m], top values [m, n], top ids [m, n], rank [m]). `to_logits` (the lm head) runs PROMPT_LP_ROWS
    positions at a time."""
    parts = []
    for a in range(0, len(targets), PROMPT_LP_ROWS):
        b = min(a + PROMPT_LP_ROWS, len(targets))
        lp = torch.log_softmax(to_logits(h[a:b]).float(), dim=-1)
        chosen = lp.gather(1, _on(lp.device, targets[a:b], torch.int64)[:, None])[:, 0]
        rank = (lp > chosen[:, None]).sum(dim=-1) + 1
        if n:
            top = torch.topk(lp, n, dim=-1)
            parts.append((chosen, top.values, top.indices, rank))
        else:
            parts.append((chosen, lp.new_empty(b - a, 0), lp.new_empty(b - a, 0, dtype=torch.int64), rank))
    return list(targets), *(torch.cat(x) for x in zip(*parts))  # type: ignore[return-value]


def prompt_logprobs_host(
    targets: list[int], chosen: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor, rank: torch.Tensor
) -> tuple[tuple[int, float, tuple[tuple[int, float], ...], int], ...]:
    """`prompt_logprobs_device`'s result as (token, logprob, ((alternative, logprob), ...), rank) per
    target."""
    vals, ids = top_v.tolist(), top_i.tolist()
    return tuple(
        (t, float(c), tuple((int(a), float(b)) for a, b in zip(ii, vv)), int(k))
        for t, c, vv, ii, k in zip(targets, chosen.tolist(), vals, ids, rank.tolist())
    )
