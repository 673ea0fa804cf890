"""Batch plans: what one forward pass computes, as plain data (sent to stage processes as msgpack).

A plan lists rows; each row is a contiguous run of new tokens of one request, with the pages that
hold its KV. Every stage owns a pool with the same page ids (one allocator in the scheduler), so
the same plan drives all stages of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RowPlan:
    rid: str
    token_ids: tuple[int, ...]  # the new tokens (stage 0 embeds them)
    start: int  # absolute position of token_ids[0]
    pages: tuple[int, ...]  # the request's page table (covers start + len(token_ids) tokens)
    logits: str = "last"  # "last" | "all" | "none": which rows the last stage returns/samples
    # sampling (used by the last stage when logits == "last")
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    step: int = 0  # index of the token being sampled (with seed, keys the draw's noise)
    logprobs: int | None = None
    # penalties (SamplingParams'); `penalty_prompt`: the prompt's distinct token ids, sent with a
    # repetition-penalised request's first sampling row only (the last stage keeps them until release)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_prompt: tuple[int, ...] = ()
    # logits shaping before the penalties: `logit_bias` (token, bias) pairs added, `suppress` tokens never
    # drawn (a request's EOS and stop tokens while it has fewer than min_tokens), `allowed` the only tokens
    # drawn (empty: all); `min_p` (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()
    suppress: tuple[int, ...] = ()
    allowed: tuple[int, ...] = ()
    # guided decoding: the tokens this row may draw as a bit mask (`guided.Guide.mask`; empty: any),
    # applied after the shaping above
    guide_mask: bytes = b""
    min_p: float = 0.0
    # prompt logprobs: the prompt tokens this row's positions predict (position start + i predicts
    # prompt_lp_targets[i]), each reported with its top-`prompt_logprobs` alternatives
    prompt_lp_targets: tuple[int, ...] = ()
    prompt_logprobs: int = 0
    # pages only grow at their end within one epoch (`RequestPages.epoch`): consumers that cache a
    # row's page table (the decode graphs) copy just the new entries; 0 = unknown, always refresh
    pages_epoch: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shaped(self) -> bool:
        return bool(self.logit_bias or self.suppress or self.allowed or self.guide_mask)

    def pages_extend(self, epoch: int, n: int) -> bool:
        """Whether a copy of this request's first `n` pages taken at `epoch` is still a prefix of
        `pages` (so only pages[n:] are new). Epoch 0 means unknown: never."""
        return bool(self.pages_epoch) and epoch == self.pages_epoch and n <= len(self.pages)


@dataclass(frozen=True)
class BatchPlan:
    step_id: int
    rows: tuple[RowPlan, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass
class RowResult:
    """What the last stage returns for one row."""

    rid: str
    token_id: int | None = None  # sampled token (logits == "last")
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    logits: object | None = None  # [n, vocab] fp32 tensor (logits == "all")
    # (token, logprob, top alternatives, rank) of each of the row's `prompt_lp_targets`
    prompt_logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...], int], ...] = ()


@dataclass
class BatchResult:
    step_id: int
    rows: list[RowResult] = field(default_factory=list)
