"""One pipeline stage's compute: its layer range, its KV pool, and a forward over a batch plan.

A `StageWorker` knows nothing about processes: the single-process engine calls it directly and the
stage processes in `longctx/stages/` wrap it (receiving hidden states from the previous stage,
sending them to the next).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from longctx.checkpoint.loader import iter_weights
from longctx.config import ModelConfig
from longctx.engine.plan import BatchPlan, RowPlan, RowResult
from longctx.engine.sampling import (
    Penalties,
    logprobs_rows,
    prompt_logprobs_device,
    prompt_logprobs_host,
    sample_rows_device,
)
from longctx.model.context import ForwardContext, KVCache
from longctx.model.model import CausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def keeps_fp8(cfg: ModelConfig, device: torch.device) -> bool:
    """Whether `build_model` keeps a checkpoint's block-fp8 weights in fp8 (on CUDA, where the fp8 GEMM
    reads them; elsewhere they are dequantised to the model dtype): what the loader holds and the room
    checks count."""
    return device.type == "cuda" and cfg.quant_block is not None


def build_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    layers: range,
    device: torch.device,
    dtype: torch.dtype,
    keep_fp8: bool,
    weight_filter=None,
    prepare=None,
) -> CausalLM:
    """Build layers [a, b) on the meta device and materialise them from the checkpoint.

    `prepare(model)` runs on the meta-built model before loading and `weight_filter(iterator)`
    wraps the checkpoint stream: tensor parallelism (`longctx.stages.tp`) uses both to shrink the
    modules to one rank's shard and slice the tensors as they stream in.
    """
    with torch.device("meta"):
        model = CausalLM(cfg, layers)
    if prepare is not None:
        prepare(model)
    weights = iter_weights(
        model_dir,
        cfg,
        layers=layers,
        dtype=dtype,
        keep_fp8=keep_fp8,
        embed=model.has_embed,
        head=model.has_head,
    )
    if weight_filter is not None:
        weights = weight_filter(weights)
    show = sys.stderr.isatty()
    model.load_weights(
        tqdm(
            weights,
            desc=f"load layers {layers.start}-{layers.stop - 1}",
            disable=not show,
            unit="tensor",
            leave=False,
        ),
        device,
        dtype,
    )
    model.finalize(dtype)
    model.eval()
    return model


class StageWorker:
    """Runs layers [a, b) of the model over batch plans, against its own KV pool."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        device: torch.device,
        use_triton: bool,
        prefill_form: str = "auto",
        page_size: int = 64,
    ) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.use_triton, self.prefill_form, self.page_size = use_triton, prefill_form, page_size
        self.is_first, self.is_last = model.has_embed, model.has_head
        self.last_topk: torch.Tensor | None = None
        self._page_rows = PageRows()
        self.token_wait_s = 0.0  # host seconds waiting for sampled tokens (`resolve`)
        self.penalties = Penalties()  # (the last stage's: penalised requests' sampled tokens)
        model.set_backend(use_triton)

    def release(self, rids: list[str]) -> None:
        """Requests finished or aborted: their penalty state, and the KV cache's per-request device
        state where it has any."""
        self.penalties.release(rids)
        release = getattr(self.kv, "release", None)
        if release is not None:
            release(rids)

    def context(self, plan: BatchPlan) -> ForwardContext:
        dev = self.device
        ps = self.page_size
        q_start = [0]
        for r in plan.rows:
            q_start.append(q_start[-1] + len(r.token_ids))
        max_pages = max(len(r.pages) for r in plan.rows)
        table = torch.full((len(plan.rows), max_pages), -1, dtype=torch.int32)
        for b, r in enumerate(plan.rows):
            pages = self._page_rows.get(r)  # int32 [len(r.pages)], kept between steps
            table[b, : pages.numel()] = pages
        # every row's positions and slots at once: row b holds tokens [start_b, start_b + n_b)
        n_tok = torch.tensor([len(r.token_ids) for r in plan.rows], dtype=torch.int64)
        q_seq = torch.repeat_interleave(torch.arange(len(plan.rows), dtype=torch.int32), n_tok)
        first = torch.tensor([r.start for r in plan.rows], dtype=torch.int64) - torch.tensor(q_start[:-1])
        positions = torch.arange(q_start[-1], dtype=torch.int64) + first[q_seq.long()]
        slots = table[q_seq.long(), positions // ps].long() * ps + positions % ps
        seq_lens = [r.end for r in plan.rows]
        return ForwardContext(
            positions=positions.to(dev, non_blocking=True),
            q_seq=q_seq.to(dev, non_blocking=True),
            q_start=q_start,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens_cpu=seq_lens,
            page_table=table.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True),
            kv=self.kv,
            use_triton=self.use_triton,
            prefill_form=self.prefill_form,
            page_size=ps,
            # request ids: KV caches that keep per-request state (HiSparse) key it by these
            extras={"rids": tuple(r.rid for r in plan.rows)},
        )

    @torch.inference_mode()
    def forward(
        self,
        plan: BatchPlan,
        hidden: torch.Tensor | None = None,
        prev_topk: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Stage 0 takes the plan's token ids (or `tokens`, the same on the device, for a continuation
        launched before they reached the host); later stages take the previous stage's hidden states.

        A stage whose first layer shares its top-k (IndexShare) takes the previous stage's last
        top-k as `prev_topk` [T, index_topk]; the top-k this stage ends with is `self.last_topk`.
        """
        ctx = self.context(plan)
        ctx.prev_topk = prev_topk
        if self.is_first and tokens is not None:
            x = tokens.to(torch.int64)
        elif self.is_first:
            ids = [t for r in plan.rows for t in r.token_ids]
            x = to_device(torch.tensor(ids, dtype=torch.int64), self.device)
        else:
            assert hidden is not None
            x = hidden
        h = self.model(x, ctx)
        self.last_topk = ctx.prev_topk
        return h

    @torch.inference_mode()
    def finish(
        self, plan: BatchPlan, h: torch.Tensor | None, last_logits: torch.Tensor | None = None
    ) -> list[RowResult]:
        """Last stage: logits for the rows that want them, and sampled tokens.

        `last_logits` [rows, vocab]: already computed logits of each row's last token (a replayed
        decode graph); then `h` is not needed.
        """
        return self.resolve(self.finish_async(plan, h, last_logits))

    @torch.inference_mode()
    def finish_async(
        self,
        plan: BatchPlan,
        h: torch.Tensor | None,
        last_logits: torch.Tensor | None = None,
        sample: bool = True,
    ) -> PendingRows:
        """`finish` up to the sampled tokens, which stay on the device (nothing waits for the GPU
        unless a row asked for all its logits); `resolve` reads them back.

        `sample=False` runs the lm_head over the same rows and stops there (no host copies, no
        sampling): a tensor-parallel rank that does not report takes part in the vocab-parallel
        lm_head's all-gather this way (`longctx.stages.tp`), and an overlapped continuation whose rows
        are shaped late draws later, with `sample_async`."""
        out: list[RowResult] = [RowResult(r.rid) for r in plan.rows]
        last: list[int] = []  # rows that sample
        ends: list[int] = []  # their last token's index in h
        prompt_lps: dict[int, tuple] = {}  # row -> its prompt logprobs, still on the device
        off = 0
        for i, r in enumerate(plan.rows):
            n = len(r.token_ids)
            if r.logits == "all":
                assert h is not None
                logits = self.model.logits(h[off : off + n])
                if sample:
                    out[i].logits = logits.cpu()
            elif r.logits == "last":
                last.append(i)
                ends.append(off + n - 1)
            if r.prompt_lp_targets:
                assert h is not None
                rows_h = h[off : off + len(r.prompt_lp_targets)]
                prompt_lps[i] = prompt_logprobs_device(
                    self.model.logits, rows_h, r.prompt_lp_targets, r.prompt_logprobs
                )
            off += n
        if last:
            if last_logits is None:
                assert h is not None
                last_logits = self.model.logits(take_rows(h, ends))  # one lm_head GEMM for every sampling row
            else:
                last_logits = take_rows(last_logits, last)
        pending = PendingRows(plan, out, last, None, last_logits, prompt_lps=prompt_lps)
        if last and sample:
            self.sample_async(pending)
        return pending

    @torch.inference_mode()
    def sample_async(self, p: PendingRows, plan: BatchPlan | None = None) -> None:
        """Draw the tokens of a step whose logits are queued on the device (`finish_async`); they stay
        there, on their way to the host, until `resolve`.

        `plan`: the same rows as `p.plan`, shaped after the logits were launched: an overlapped
        continuation launched with `sample=False` because what its guided rows (or rows with bad words
        of several tokens) may draw depended on the previous step's tokens, still unread then."""
        if plan is not None:
            assert [r.rid for r in plan.rows] == [r.rid for r in p.plan.rows], "not the launched rows"
            p.plan = plan
        assert p.toks is None and p.last_logits is not None, "nothing to sample, or sampled already"
        toks = sample_rows_device(
            p.last_logits,
            [p.plan.rows[i] for i in p.last],
            self.penalties,
            "triton" if self.use_triton else "torch",
        )
        p.toks = toks
        if toks.is_cuda:
            # Start the tokens' way to the host now, behind this step's work only: a continuation
            # launched before `resolve` queues its graph behind this copy, and `resolve` waits for
            # this event, not for the stream (a `.tolist()` there would wait for the continuation
            # too, and the GPU would idle while the host prepares the step after it).
            p.toks_host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
            p.toks_host.copy_(toks, non_blocking=True)
            p.ready = torch.cuda.Event()
            p.ready.record()

    @torch.inference_mode()
    def resolve(self, p: PendingRows) -> list[RowResult]:
        """Read the sampled tokens back (the step's one host synchronisation) and fill the results.
        A replayed graph's logits buffer is overwritten by the next replay: resolve before it."""
        for i, lps in p.prompt_lps.items():
            p.out[i].prompt_logprobs = prompt_logprobs_host(*lps)
        if p.toks is None:
            return p.out
        assert p.last_logits is not None
        if p.ready is not None and p.toks_host is not None:
            t0 = time.perf_counter()
            p.ready.synchronize()
            self.token_wait_s += time.perf_counter() - t0
            toks = p.toks_host.tolist()
        else:
            toks = p.toks.tolist()
        want: list[int] = []  # positions in p.last of the rows that asked for logprobs
        for j, (i, tok) in enumerate(zip(p.last, toks)):
            p.out[i].token_id = tok
            if p.plan.rows[i].logprobs is not None:
                want.append(j)
        if want:
            ns = [p.plan.rows[p.last[j]].logprobs or 0 for j in want]
            got = logprobs_rows(p.last_logits, want, [toks[j] for j in want], ns)
            for j, (lp, top) in zip(want, got):
                p.out[p.last[j]].logprob, p.out[p.last[j]].top_logprobs = lp, top
        return p.out


class PageRows:
    """CPU int32 copies of plan rows' page lists, extended in place while a row's (rid, pages_epoch)
    holds (pages only grow at their end within an epoch), so building a step's page table costs
    O(new pages) instead of O(context) per row. Rows with epoch 0 are always rebuilt."""

    def __init__(self, limit: int = 4096) -> None:
        self._rows: dict[str, tuple[int, torch.Tensor, int]] = {}  # rid -> (epoch, buffer, used)
        self.limit = limit

    def get(self, r: RowPlan) -> torch.Tensor:
        n = len(r.pages)
        hit = self._rows.get(r.rid)
        if hit is None or not r.pages_extend(hit[0], hit[2]):
            if hit is None and len(self._rows) >= self.limit:
                self._rows.clear()  # finished requests' rows; live ones are rebuilt on their next step
            buf, have = torch.tensor(r.pages, dtype=torch.int32), n
        else:
            _, buf, have = hit
            if n > buf.numel():
                grown = torch.empty(max(n, 2 * buf.numel()), dtype=torch.int32)
                grown[:have] = buf[:have]
                buf = grown
            if n > have:
                buf[have:n] = torch.tensor(r.pages[have:n], dtype=torch.int32)
        self._rows[r.rid] = (r.pages_epoch, buf, n)
        return buf[:n]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor made in this step, copied without waiting for the stream: a blocking copy (what
    `torch.tensor(..., device=cuda)` and list indexing of a device tensor do) synchronises the stream,
    so the host would wait for every step already queued, an overlapped continuation included."""
    return t.to(device, non_blocking=True)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for a host list of row indices, without a stream synchronisation; t itself when the
    list is every row in order (a decode batch where every row samples)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), t.device))


@dataclass
class PendingRows:
    """A last stage's step whose sampled tokens are still on the device (`StageWorker.finish_async`)."""

    plan: BatchPlan
    out: list[RowResult]
    last: list[int]  # rows that sample, in plan order
    toks: torch.Tensor | None  # [len(last)] on the device
    last_logits: torch.Tensor | None  # [len(last), vocab]
    toks_host: torch.Tensor | None = None  # pinned host copy of `toks`, valid once `ready` has fired
    ready: torch.cuda.Event | None = None  # recorded after that copy (None on the CPU)
    prompt_lps: dict[int, tuple] = field(default_factory=dict)  # row -> prompt_logprobs_device(...)
