"""Decode steps replayed from CUDA graphs, one per (batch bucket, context bucket).

At batch 1 an eager decode step of a many-layer MoE model is bound by kernel launches and Python.
A decode plan (every row one token, pp=1, all KV on the device) is padded to the next batch bucket
and run by replaying a graph captured over static input buffers:

- ids, positions, seq_lens, slot_mapping [B]; page_table [B, ctx_bucket / 64]; valid [B];
- padding rows point at a reserved dummy page, have seq_len 1, and are masked out of the MoE (their
  expert ids become -1), so they cost one key of attention and no expert work;
- the indexer's logits width is the context bucket (a host-known bound, no device sync);
- the graph ends with the lm_head: sampling reads the [B, vocab] logits outside the graph.

A KV cache with per-request device state (HiSparse: `bind_rows`, `layout_version`) is bound on the
host before each replay and its block ids go into one more static buffer, `kv_blocks` [B] (padding
rows: block 0, which nothing is placed in); its step clock ticks inside the graph. When the cache
reallocates its buffers (`layout_version` changes) every captured graph is dropped and recaptured.

Anything else (prefill chunks, pipeline stages, shapes outside the buckets) runs eagerly.
On CPU the same static-buffer path runs without capture (`capture=False`), which is how its
bookkeeping is tested.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from longctx.engine.plan import BatchPlan
from longctx.engine.worker import to_device
from longctx.model.context import ForwardContext
from longctx.model.overlap import side_stream

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_CTX_BUCKET = 4096


class _Inputs:
    """A bucket's per-step row inputs in one byte buffer, so a replay sends them with ONE host->device
    copy from pinned memory (not one pageable copy and a padding fill per input): for B rows, int64
    ids / positions / slots / blocks, then int32 seq_lens, then bool valid, each starting on a 16-byte
    boundary (the alignment Triton specialises pointers on). The attributes of those names are views
    of the device buffer: the graph's static inputs. The host side is two pinned buffers used in
    turn, each reused only after its last copy has run (an event), since a continuation may fill the
    next step's inputs while the copy of this step's still waits in the stream."""

    def __init__(self, b: int, device: torch.device, pad_slot: int) -> None:
        self.b = b
        self.device = device
        self.pad_slot = pad_slot  # the slot padding rows write their (ignored) KV to
        self._s64 = -(-b // 2) * 2  # int64 row stride: 16-byte rows
        self._o32 = 4 * self._s64 * 8
        self._ob = self._o32 + -(-b // 4) * 16
        size = self._ob + b
        self.dev = torch.zeros(size, dtype=torch.uint8, device=device)
        i64, self.seq_lens, self.valid = self._views(self.dev)
        self.ids, self.positions, self.slots, self.blocks = i64  # [B] int64 each
        self.seq_lens.fill_(1)
        self.slots.fill_(pad_slot)
        pin = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # each host buffer's last copy (an event never recorded waits for nothing)
        self._done = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(int64 [4, B]: ids, positions, slots, blocks; int32 [B] seq_lens; bool [B] valid) of buf."""
        b = self.b
        i64 = buf[: self._o32].view(torch.int64).view(4, self._s64)[:, :b]
        return i64, buf[self._o32 : self._o32 + 4 * b].view(torch.int32), buf[self._ob :].view(torch.bool)

    def send(self, ids: list[int], positions: list[int], slots: list[int], blocks: list[int]) -> None:
        """The n <= B rows' inputs (seq_lens position + 1, valid), padding rows after them (id 0,
        position 0, `pad_slot`, block 0, seq_len 1, not valid), into the next host buffer and from it
        to the device buffer."""
        n, pad = len(positions), self.b - len(positions)
        k, self._turn = self._turn, 1 - self._turn
        if self._done is not None:
            self._done[k].synchronize()  # its copy two steps ago (long done unless the host ran far ahead)
        host = self._host[k]
        h64, h32, hb = self._views(host)
        z = [0] * pad
        h64.copy_(
            torch.tensor(
                [ids + z, positions + z, slots + [self.pad_slot] * pad, blocks + z], dtype=torch.int64
            )
        )
        h32.copy_(torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32))
        hb.copy_(torch.tensor([True] * n + [False] * pad, dtype=torch.bool))
        self.dev.copy_(host, non_blocking=True)
        if self._done is not None:  # (the copy's stream: the current one of the buffer's device)
            self._done[k].record(torch.cuda.current_stream(self.device))


@dataclass
class _Captured:
    # ids, positions, seq_lens, slots, valid and blocks (each request's KV state, caches with
    # `bind_rows`) of every row
    inputs: _Inputs
    table: torch.Tensor
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    ctx: ForwardContext | None = None
    # what each row of `table` holds: (rid, pages_epoch, number of pages), None = dummy
    row_keys: list[tuple[str, int, int] | None] = field(default_factory=list)


class DecodeGraphs:
    """Captures lazily on first use of a bucket; `run(plan)` returns fp32 logits [rows, vocab]."""

    def __init__(
        self,
        worker,
        max_context: int,
        dummy_page: int,
        capture: bool = True,
        batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
    ) -> None:
        self.worker = worker
        self.page_size = worker.page_size
        self.dummy_page = dummy_page
        self.capture = capture
        self.batch_buckets = batch_buckets
        self.ctx_buckets: list[int] = []
        c = MIN_CTX_BUCKET
        while True:  # powers of 4 from 4K until one holds max_context
            self.ctx_buckets.append(c)
            if c >= max_context:
                break
            c *= 4
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool: Any = None
        self._kv_version = getattr(getattr(worker, "kv", None), "layout_version", None)
        # the layers' side stream, used while a graph is captured (longctx/model/overlap.py)
        self.side = side_stream(worker.device) if capture else None
        self.replays = 0
        self.recaptures = 0  # times every graph was dropped because the KV cache reallocated
        # host seconds of the replays: filling the static inputs (KV binding included) and the
        # graph launch call itself (what a profiler inflates; these two perf_counter reads do not)
        self.prep_s = 0.0
        self.launch_s = 0.0

    # ---- eligibility --------------------------------------------------------------------------
    def bucket(self, plan: BatchPlan) -> tuple[int, int] | None:
        w = self.worker
        per_request = hasattr(w.kv, "bind_rows")  # HiSparse: its own state per request, bound per step
        if not (w.is_first and w.is_last) or not (getattr(w.kv, "dense_readable", False) or per_request):
            return None
        rows = plan.rows
        if len(rows) > self.batch_buckets[-1] or any(
            len(r.token_ids) != 1 or r.logits != "last" for r in rows
        ):
            return None
        longest = max(r.end for r in rows)
        i = bisect.bisect_left(self.ctx_buckets, longest)
        if i == len(self.ctx_buckets):
            return None
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, len(rows))]
        return b, self.ctx_buckets[i]

    # ---- capture ---------------------------------------------------------------------------------
    def _buffers(self, b: int, ctx_len: int) -> _Captured:
        dev = self.worker.device
        pages = ctx_len // self.page_size
        return _Captured(
            inputs=_Inputs(b, dev, self.dummy_page * self.page_size),
            table=torch.full((b, pages), self.dummy_page, dtype=torch.int32, device=dev),
            row_keys=[None] * b,
        )

    def _context(self, c: _Captured, ctx_len: int) -> ForwardContext:
        w = self.worker
        inp = c.inputs
        b = inp.b
        return ForwardContext(
            positions=inp.positions,
            q_seq=torch.arange(b, dtype=torch.int32, device=w.device),
            q_start=list(range(b + 1)),
            seq_lens=inp.seq_lens,
            seq_lens_cpu=[ctx_len] * b,
            page_table=c.table,
            slot_mapping=inp.slots,
            kv=w.kv,
            use_triton=w.use_triton,
            prefill_form="absorbed",
            page_size=self.page_size,
            extras={"valid": inp.valid, "rids": (), "kv_blocks": inp.blocks},
            side=self.side,
        )

    def _forward(self, c: _Captured) -> torch.Tensor:
        """The captured region: the layers and the lm_head over the static buffers. A fresh context
        object per call (same tensors): KV caches tell one forward pass from the next by it."""
        assert c.ctx is not None
        ctx = dataclasses.replace(c.ctx, prev_topk=None, cos_sin=None, cos_sin_index=None)
        return self.worker.model.logits(self.worker.model(c.inputs.ids, ctx))

    def _get(self, b: int, ctx_len: int) -> _Captured:
        key = (b, ctx_len)
        c = self._graphs.get(key)
        if c is not None:
            return c
        c = self._buffers(b, ctx_len)
        c.ctx = self._context(c, ctx_len)
        if self.capture:
            s = torch.cuda.Stream(self.worker.device)
            s.wait_stream(torch.cuda.current_stream(self.worker.device))
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up: compile every kernel, settle the allocator
                    self._forward(c)
            torch.cuda.current_stream(self.worker.device).wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                c.logits = self._forward(c)
            c.graph = g
        self._graphs[key] = c
        return c

    def _update_table(self, c: _Captured, plan: BatchPlan) -> None:
        """Bring the device page table of bucket `c` to the plan's rows, writing only what changed."""
        rows: list[int] = []  # entries to write: (row, col) -> value
        cols: list[int] = []
        vals: list[int] = []
        full: list[int] = []  # rows rewritten whole (a new request in the row, or a padding row)
        for i, old in enumerate(c.row_keys):
            if i >= len(plan.rows):
                if old is not None:
                    full.append(i)
                    c.row_keys[i] = None
                continue
            r = plan.rows[i]
            if old is not None and old[0] == r.rid and r.pages_extend(old[1], old[2]):
                rows += [i] * (len(r.pages) - old[2])  # often none: the table is already right
                cols += range(old[2], len(r.pages))
                vals += r.pages[old[2] :]
            else:
                full.append(i)
            c.row_keys[i] = (r.rid, r.pages_epoch, len(r.pages))
        dev = c.table.device
        if full:
            host = torch.full((len(full), c.table.shape[1]), self.dummy_page, dtype=torch.int32)
            for j, i in enumerate(full):
                if i < len(plan.rows):
                    pages = plan.rows[i].pages
                    host[j, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            c.table[to_device(torch.tensor(full), dev)] = to_device(host, dev)
        if rows:
            idx = to_device(torch.tensor([rows, cols], dtype=torch.int64), dev)
            c.table[idx[0], idx[1]] = to_device(torch.tensor(vals, dtype=torch.int32), dev)

    # ---- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: BatchPlan, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the plan's bucket; `tokens` [rows] on the device replaces the plan's token ids (an
        overlapped continuation launched before the previous step's tokens reached the host)."""
        t0 = time.perf_counter()
        key = self.bucket(plan)
        assert key is not None, "not a graph-eligible decode plan"
        b, ctx_len = key
        rows = plan.rows
        n = len(rows)
        starts = [r.start for r in rows]
        ps = self.page_size
        kv = self.worker.kv
        blocks = None
        if hasattr(kv, "bind_rows"):  # before `_get`: binding may grow (reallocate) the cache
            blocks = kv.bind_rows([r.rid for r in rows], starts, [r.end for r in rows])
            if kv.layout_version != self._kv_version:
                if self._graphs:
                    self.recaptures += 1
                self._graphs.clear()  # they hold the old buffers' addresses
                self._kv_version = kv.layout_version
        c = self._get(b, ctx_len)
        # host side: fill the static inputs, padding rows with the dummy page (one pinned copy). The
        # page table is kept on the device between steps and only new entries are written: a row's
        # pages grow at their end while its (rid, pages_epoch) holds, so most steps copy nothing of it.
        c.inputs.send(
            [r.token_ids[0] for r in rows] if tokens is None else [0] * n,
            starts,
            [r.pages[r.start // ps] * ps + r.start % ps for r in rows],
            blocks or [0] * n,
        )
        if tokens is not None:  # behind the copy in the stream: the device-fed tokens win
            c.inputs.ids[:n].copy_(tokens)
        self._update_table(c, plan)
        t1 = time.perf_counter()
        if c.graph is not None:
            c.graph.replay()
            assert c.logits is not None
            logits = c.logits
        else:
            logits = self._forward(c)
        self.replays += 1
        self.prep_s += t1 - t0
        self.launch_s += time.perf_counter() - t1
        return logits[:n]
