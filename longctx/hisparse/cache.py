"""`HiSparseKVCache`: a stage's `KVCache` with every MLA row in the host pool and a hot LRU subset
of each request's rows on the device.

Where each thing lives (one stage, layers [a, b)):
- host pool (`HostKVLayout`, /dev/shm, registered with CUDA): the FULL MLA row of every token of
  every layer, indexed like the paged pool (row = page * 64 + offset), so pages, page tables and
  the prefix cache stay the engine's. Prefix-cached pages are therefore already in the host pool.
- `mla_pool(layer)` IS the host layer region: the layer's `write_mla_kv` writes this step's new
  rows straight into host memory at `ctx.slot_mapping` (on CUDA through a device alias of the
  registered mapping: the write kernel stores over PCIe, no device staging and no extra copy).
- `index_pool(layer)`: indexer keys, fully on the device (small: 132 B per token per full layer).
- `attend_pool(layer)`: a device slot buffer [1 + blocks * N, row] per layer. Row 0 is a trash
  row; each live request owns one block of N slots (the same block in every layer), so
  (request, layer) holds at most N device tokens.

Bookkeeping is batched device tensors addressed by block id, allocated at construction for
`max_requests` blocks: `pos2slot` [1 + blocks, layers, P] int32 (logical position -> slot, -1
absent; P = max context + 1, column P - 1 a sink for masked writes), `slot2pos` and `stamp`
[1 + blocks, layers, N + 1] int64 (last step the slot was used; column N a sink). Block 0 is the
padding block of a captured decode batch's padding rows (nothing is ever placed in it). Blocks
are handed out on a request's first step (`bind_rows`, on the host) and returned by
`release(rids)`; only when more requests run at once than `max_requests` do the tables and slot
buffers grow (doubling), which bumps `layout_version` so captured graphs are dropped.

The policy is `longctx.hisparse.lru.SlotLRU`'s, done for every batch row (and every layer of a
placement) at once so nothing waits for the GPU, by `longctx.kernels.lru_place` (one Triton launch
on the Triton path, its sort / cumsum / scatter torch reference otherwise): residency lookup is
one gather, victims are the lowest stamps among slots that are neither requested this step nor
holding one of the `recent` newest tokens, misses get victims by rank, and the swap-in copies
exactly the misses (`swap_in_rows_counted` over the kernel's compacted lists, or `swap_in_counted`
over the mask; counts stay on the device). The step clock is a device scalar incremented at the
start of each step, and each row's block, newest position (`seq_lens`) and page table are read
from the step's device tensors,
so a decode step has no host state baked into its ops: `DecodeGraphs` binds the rows
(`bind_rows`) and fills `extras["kv_blocks"]` next to the page table, then replays.

On a Triton decode step the index arithmetic is one launch per step (`step_rows`: the rows' table
offsets, the newest positions, the clock tick) and one per layer (`resolve_tail`: the layer's
newest-row copy and miss copies, deferred from `after_write` / the placement / a prefetch without
a side stream, together with the top-k -> slot-row lookup); `_flush` makes deferred copies that
no `resolve` took (`attend_pool`, the next `_begin`). The torch path keeps them apart.

Per step (`_begin`, at the first layer): the newest `recent` tokens of each request get their
slots in every layer of the stage at once (one placement over all layers; each layer keeps its
own LRU), so the newest tokens are always resident (with FORK_DEFAULT, inside a decode graph
capture, that placement and the step's victim candidates run on the side stream until the first
top-k placement joins it). Then per layer:
1. `after_write(layer)`: the new rows are in the host pool; they are copied into the slots chosen
   at the start of the step.
2. full layers: the indexer's top-k -> `resolve(layer)` places this layer's misses and returns
   slot rows; it then PREFETCHES the following shared layers' misses with the same top-k (on a
   side CUDA stream that the shared layers' `after_write` / `resolve` wait for; on the capturing
   stream inside a graph capture; synchronously on CPU), all the shared layers in one placement.
   Only tokens from before this step are prefetched: this step's rows of a later layer are not
   written yet (that layer's `after_write` copies them into their slots).
3. shared layers: `resolve` finds everything resident (prefetched) and only maps rows.

Prefill chunks (several queries per request) may need more distinct tokens than N at once. The
choice here is "raise N for the step": the LRU places as many misses as it has evictable slots,
the rest (overflow) are copied into a per-step pool `[slot buffer | overflow rows]` that
`attend_pool(layer)` returns for that layer until the next step. Overflow rows never become
resident, so `device_tokens_max` <= N always; the per-step extra is reported as
`overflow_rows_max`. Prefill rows are placed one row at a time and only they read an overflow
count on the host; decode rows are placed together and never do. A prefill placement's width comes
from the data (a chunk's queries x top-k, or what its last queries selected), so it runs the torch
placement on every device: on the Triton path each new width would compile a kernel variant (10-45 s
for the sm_90 placement kernels at 1,024-4,096 positions), which made the H200's 128K capped prefill
244 s instead of 9 s in the thirteenth session. A chunk that may overflow first
places what its last `tail_queries` queries selected (`_place_tail`), so that is what stays
resident for the first decode steps, which select much of it again. Results are exact: every
attended row is a byte copy of the host row the paged pool would hold.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from longctx.config import ModelConfig, check_device_tokens
from longctx.errors import ConfigError
from longctx.hisparse.gather import swap_in_counted, swap_in_rows_counted
from longctx.kernels.hisparse_step import CopyList, resolve_tail, slot_lookup, step_rows
from longctx.kernels.kv_layout import alloc_index_pool, alloc_mla_pool
from longctx.kernels.lru_place import (
    CandKeep,
    cand_keep_buffers,
    cand_keep_width,
    candidates_parallel,
    lru_candidates,
    lru_place,
)
from longctx.kernels.swap import swap_in_gather
from longctx.kv_kinds import KVKinds
from longctx.kvstore.host_pool import HostKVLayout, HostPool
from longctx.kvstore.pool import HasKVKinds, host_kv_spec
from longctx.model.context import ForwardContext

log = logging.getLogger("longctx.hisparse")

# A prefill chunk's last queries are placed before the rest of the chunk, so what the prompt's last
# queries selected is resident when decode starts: the decode steps select much of it again
# (`bench.hit_rate --policies --tail 32`, run 14 on a RULER prompt at 8K: an unbounded cache from
# empty holds 0.823 of the decode selections, one holding the last 32 queries' selections 0.931).
# The engine's decode hit rate at a 10% cap (bench/results/hit-rate-cpu.md): 8K 0.766 without,
# 0.792 / 0.796 / 0.804 / 0.804 with 8 / 32 / 128 / 2048 queries; 32K 0.779, 0.821 (32), 0.832 (128).
TAIL_QUERIES = 128
# A Triton decode step finds every (row, layer)'s victim candidates in one launch after the clock's
# tick (`lru_candidates`), and its newest-token placement and each layer's top-k placement take their
# victims from them instead of walking the N slots themselves (kernels/lru_place.py: the same
# victims). LONGCTX_PLACE_CANDIDATES=0 keeps each placement's own select (A/B benches).
PLACE_CANDIDATES = os.environ.get("LONGCTX_PLACE_CANDIDATES", "1").strip() != "0"
# The candidates' select is a ~48 us latency-bound loop over the N slots (13,106 at a 128K RULER decode's
# 10% cap) whose answer moves little between steps: each (block, layer) keeps 4x the candidates a step
# asks for and reuses them while they are provably still the smallest (kernels/lru_place.py, "Kept
# candidates"), selecting again only when they run short. LONGCTX_CAND_KEEP=0 selects every step (A/B).
CAND_KEEP = os.environ.get("LONGCTX_CAND_KEEP", "1").strip() != "0"
# In a captured decode step the candidates and the newest-token placement (~80 us at a 128K RULER
# decode's 10% cap, one latency-bound program per (row, layer)) depend only on the LRU state after
# the clock's tick, and nothing reads what they write before the first layer's top-k placement: they
# run on a side stream forked inside the graph at `_begin` and joined at that placement (`_join`),
# beside the first layer's indexer and top-k. On the H200 (twenty-fourth session, 128K RULER decode,
# run 23, 10% cap) that took the capped step from 1.25x to 1.16x of uncapped in the engine's loop
# (0.580 -> 0.544 ms), with the uncapped greedy tokens. LONGCTX_HISPARSE_FORK=0 keeps them on the
# main stream (A/B benches).
FORK_DEFAULT = os.environ.get("LONGCTX_HISPARSE_FORK", "1").strip() != "0"


@dataclass
class _Req:
    """Host bookkeeping of one request: its block of slots and how far its KV reached."""

    block: int
    seen: int = 0  # KV length after the last step (a restart from below it resets the block)


class _Rows(NamedTuple):
    """Device state of (some of) a step's batch rows."""

    blk: torch.Tensor  # [B] int64 block id (0 = the padding block)
    newest_from: torch.Tensor  # [B] int64: positions >= this are pinned this step
    base: torch.Tensor  # [B] int64 first slot-buffer row of the block
    table: torch.Tensor  # [B, pages] int32 page table rows
    valid: torch.Tensor | None  # [B] bool, False = a padding row of a captured batch (None: all real)
    trow: torch.Tensor  # [B, layers] int64 (block, layer) row of the flattened tables
    p_at: torch.Tensor  # [B, layers] its offset in flat pos2slot
    s_at: torch.Tensor  # [B, layers] its offset in flat slot2pos / stamp

    def take(self, i: torch.Tensor | slice) -> _Rows:
        v = None if self.valid is None else self.valid[i]
        return _Rows(
            self.blk[i], self.newest_from[i], self.base[i], self.table[i], v, self.trow[i],
            self.p_at[i], self.s_at[i],
        )  # fmt: skip

    def row(self, b: int) -> _Rows:
        return self.take(slice(b, b + 1))


class _Placed(NamedTuple):
    """What `HiSparseKVCache._place` decided for positions `u` of rows [B] in each of its layers [L']."""

    u: torch.Tensor  # [B, M] the positions, sorted per row (-1 = none)
    overflow: torch.Tensor | None  # [B, L', M] found no slot; None where that cannot happen (decode)
    src: torch.Tensor  # [B, M] their rows in the host pool
    dst: torch.Tensor  # [B, L', M] their slot-buffer rows
    copy: torch.Tensor  # [B, L', M] whether the host row must be copied there
    # the Triton placement also lists the copies compacted per (row, layer): the first cnt of
    csrc: torch.Tensor | None  # [B, L', M] host rows
    cdst: torch.Tensor | None  # [B, L', M] slot-buffer rows
    cnt: torch.Tensor | None  # [B, L']


def preallocated_requests(
    max_running: int, num_pages: int, page_size: int, device_tokens: int, max_context: int | None
) -> int:
    """How many requests' blocks a cache allocates up front (`max_requests`), so decode graphs never
    see them move: as many as may run at once, but no more than the `num_pages` pages the scheduler
    hands out hold at `max_context` tokens each. Sized by the pool alone (pool / cap), a pool for one
    1M-token request capped at 10% would hold ten requests' slots, the whole KV again on the device.
    More concurrent requests grow the blocks (and the decode graphs are captured again). None: a
    request may take every page (one block)."""
    pool = num_pages * page_size
    return max(1, min(max_running, pool // max(device_tokens, pool if max_context is None else max_context)))


def _device_alias(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over registered host memory `t` (UVA: the device address is the host one)."""

    class _View:
        __cuda_array_interface__ = {
            "shape": (t.numel() * t.element_size(),),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
            "strides": None,
        }

    with torch.cuda.device(device):
        flat = torch.as_tensor(_View(), device=device)
    return flat.view(t.dtype).view(t.shape)


class HiSparseKVCache(HasKVKinds):
    """Implements `longctx.model.context.KVCache` with host-backed MLA rows (see module doc).

    `device_tokens` (N) is the per (request, layer) cap on device-resident tokens; it must exceed
    the model's `index_topk` so one decode query's selection always fits. `recent` newest tokens
    of each request stay resident (default min(64, (N - index_topk) // 2)). `host_layout` is the
    stage's shared host KV layout (pipeline stages pass theirs); None creates a private pool.
    `max_requests`: blocks allocated up front (more concurrent requests grow the buffers);
    `max_context`: the longest request (default: every page). `hit_chunk`: the Triton placement's
    all-hit pass chunk (None: `lru_place`'s default; tests set it small to run the pass on tiny
    top-k sizes). `place_block`: its slot block (None: `lru_place`'s default; from 4 blocks a
    (request, layer) the victims are chosen by the parallel passes, so tests set it small).
    `place_candidates`: a decode step's victim candidates (None: PLACE_CANDIDATES); their fork onto the
    side stream inside a decode graph follows FORK_DEFAULT (CUDA only).
    """

    dense_readable = False

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        num_pages: int,
        kind: str | KVKinds,
        dtype: torch.dtype,
        device: torch.device,
        device_tokens: int,
        page_size: int = 64,
        use_triton: bool = False,
        host_layout: HostKVLayout | None = None,
        recent: int | None = None,
        max_requests: int = 1,
        max_context: int | None = None,
        hit_chunk: int | None = None,
        place_block: int | None = None,
        tail_queries: int = TAIL_QUERIES,
        place_candidates: bool | None = None,
    ) -> None:
        K = cfg.index_topk
        check_device_tokens(cfg, device_tokens)
        self.kinds = KVKinds.of(kind)
        self.cfg, self.layers, self.kind = cfg, layers, self.kinds.base
        self.dtype, self.device = dtype, torch.device(device)
        self.page_size, self.num_pages = page_size, num_pages
        self.num_slots = num_pages * page_size
        self.N = device_tokens
        self.recent = max(1, min(64 if recent is None else recent, (device_tokens - K) // 2))
        self.tail_queries = max(0, tail_queries)
        self._use_cand = PLACE_CANDIDATES if place_candidates is None else place_candidates
        # a decode step's two placements of a (row, layer) ask for <= recent + top-k positions
        self._cand_n = K + self.recent
        self._cand: torch.Tensor | None = None  # this decode step's victim candidates [B, layers, C]
        self.use_triton = use_triton
        self._backend = "triton" if use_triton else "torch"
        self._hit_chunk = hit_chunk
        self._place_kw = {} if place_block is None else {"block_n": place_block}
        # kept candidates (CAND_KEEP): not where the candidates take the parallel passes, nor where a
        # kept list would hold half the slots or more (it would run short or lack a bound every step)
        par = candidates_parallel(device_tokens, **self._place_kw)
        small = 2 * cand_keep_width(self._cand_n) > device_tokens
        self._keep_on = CAND_KEEP and self._use_cand and use_triton and not par and not small
        self._keep: tuple[torch.Tensor, ...] = ()  # slots, keys, meta per (block, layer) plane (`_grow`)
        L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        # per layer: (dtype, width) of a slot-buffer row (layers may differ in kind)
        self._row = {}
        for i in layers:
            t = alloc_mla_pool(1, L, R, self.kinds.mla(i), dtype, "cpu")
            self._row[i] = (t.dtype, t.shape[1])
        want = host_kv_spec(cfg, layers, self.num_slots, self.kinds, dtype)
        # a swapped row's bytes per stage-local layer (layers of other kinds differ): the placements
        # count the misses' and newest copies' bytes with them (acc[5] / acc[6])
        self._row_bytes = torch.tensor(
            [want.rows_of(i) for i in layers], dtype=torch.int64, device=self.device
        )
        self._index_of = {layer: i for i, layer in enumerate(layers)}

        # host pool: every token's full MLA row, indexed like the paged pool
        self._own_pool: HostPool | None = None
        if host_layout is None:
            spec = want
            pool, _ = HostPool.create(spec.nbytes, tag=f"hisparse{layers.start}.{layers.stop}")
            pool.unlink()  # private to this process: nothing to attach, nothing to leak
            if self.device.type == "cuda":
                pool.register_cuda()
            host_layout = HostKVLayout(pool, spec)
            self._own_pool = pool
        spec = host_layout.spec
        if not (spec.layer_start <= layers.start and layers.stop <= spec.layer_end):
            raise ConfigError(
                f"host KV layout covers layers [{spec.layer_start}, {spec.layer_end}), need {layers}"
            )
        if spec.num_slots < self.num_slots or any(spec.rows_of(i) != want.rows_of(i) for i in layers):
            raise ConfigError(f"host KV layout {spec} does not fit {want}")
        self.host_layout = host_layout
        self._host = {i: host_layout.layer_view(i).view(self._row[i][0]) for i in layers}  # [slots, W]
        if self.device.type == "cuda":
            self._write_view = {i: _device_alias(t, self.device) for i, t in self._host.items()}
        else:
            self._write_view = self._host

        D = cfg.index_head_dim
        self._index = {
            i: alloc_index_pool(self.num_slots, D, self.kinds.index(i), dtype, self.device).zero_()
            for i in layers
            if cfg.is_full_indexer(i)
        }
        # shared layers that reuse each full layer's top-k inside this stage (prefetch targets)
        self._shared_after: dict[int, list[int]] = {}
        last_full = None
        for i in layers:
            if cfg.is_full_indexer(i):
                last_full = i
                self._shared_after[i] = []
            elif last_full is not None:
                self._shared_after[last_full].append(i)

        n_l = len(layers)
        ctx_cap = self.num_slots if max_context is None else min(max_context, self.num_slots)
        self._P = ctx_cap + 1  # pos2slot row length; column P - 1 is the sink
        self._blocks = 0
        self._free_blocks: list[int] = []
        self._block_hi: list[int] = [0]  # per block: KV length its tables may hold since its reset
        self._p2s = torch.full((1, n_l, self._P), -1, dtype=torch.int32, device=self.device)
        self._s2p = torch.full((1, n_l, self.N + 1), -1, dtype=torch.int64, device=self.device)
        self._stamp = torch.full((1, n_l, self.N + 1), -1, dtype=torch.int64, device=self.device)
        self._slots = {i: self._new_slot_buffer(i, 0) for i in layers}
        self.layout_version = 0  # bumped whenever the buffers above are reallocated
        self._grow(max(1, max_requests))
        self._states: dict[Any, _Req] = {}
        # the stage layers a placement covers, as slices of [layers] (free views of per-step tensors):
        # a full layer's shared layers follow it, so theirs are consecutive
        self._every = slice(0, n_l)
        self._one = [slice(li, li + 1) for li in range(n_l)]
        self._shared_ids = {
            f: slice(self._index_of[f] + 1, self._index_of[f] + 1 + len(sh))
            for f, sh in self._shared_after.items()
            if sh
        }
        # each full layer with its shared layers (one placement on a fused decode step, see `resolve`)
        self._group = {f: slice(sh.start - 1, sh.stop) for f, sh in self._shared_ids.items()}
        # the current step (set by `_begin`)
        self._ctx: ForwardContext | None = None
        self._all: _Rows | None = None  # every batch row
        self._dec: tuple[torch.Tensor | None, _Rows] | None = None  # decode rows: (token ids, rows)
        self._pure = False  # every row is a decode row
        self._pre: list[int] = []  # prefill rows (placed one at a time)
        self._newest: _Placed | None = None
        self._now_t = torch.zeros((), dtype=torch.int64, device=self.device)  # the clock, on the device
        self._minus1 = torch.full((), -1, dtype=torch.int32, device=self.device)
        self._step_pool: dict[int, torch.Tensor] = {}
        self._prefetched: set[int] = set()  # layers whose decode rows were placed by a prefetch
        # Triton decode steps (`_fuse`): row copies deferred to each layer's `resolve` tail
        self._fuse = False
        self._pending: dict[int, list[CopyList]] = {}
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # a captured decode step's candidates + newest placement on the side stream (FORK_DEFAULT)
        self._fork = self._side is not None and FORK_DEFAULT
        self._forked = False  # they were forked and the main stream has not joined them yet
        self._fork_hold: object = None  # the fork's inputs made on the main stream, kept until `_join`
        # stats: [hits, misses, newest-row copies, max resident, overflow rows max, miss bytes, newest-row
        # copy bytes] per stream
        self._acc = {
            k: torch.zeros(7, dtype=torch.int64, device=self.device) for k in ("main", "side", "tail")
        }
        self._swap_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._timed_before = False  # the first timed swap is not timed: see _timed

    # ---- KVCache ---------------------------------------------------------------------------------
    def mla_pool(self, layer: int) -> torch.Tensor:
        return self._write_view[layer]

    def index_pool(self, layer: int) -> torch.Tensor:
        return self._index[layer]

    def attend_pool(self, layer: int) -> torch.Tensor:
        self._join()
        self._flush(layer)  # (a decode layer's `resolve` made its copies already)
        pool = self._step_pool.get(layer)
        return pool if pool is not None else self._slots[layer]

    def after_write(self, layer: int, ctx: ForwardContext) -> None:
        """The new rows are in the host pool: copy each request's newest ones into the slots
        `_begin` chose for them in every layer."""
        self._begin(ctx)
        p = self._newest
        assert p is not None
        if not self._forked or p.cnt is None:  # (a fork's copies are deferred to the tails, joined)
            self._wait_side()
        self._copy(layer, p, self._index_of[layer], True)

    def resolve(self, layer: int, topk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Top-k logical positions [T, K] (-1 = none) -> rows of `attend_pool(layer)` (-1 stays)."""
        self._begin(ctx)
        self._wait_side()
        assert self._all is not None
        li = self._index_of[layer]
        q = topk if self.use_triton else topk.long()  # the kernels read int32 positions as they come
        acc = self._acc["main"]
        group = self._group.get(layer) if self._fuse and q.shape[1] + self.recent <= self.N else None
        if self._dec is not None and layer not in self._prefetched:  # every decode row at once
            tok, rows = self._dec
            # a fused decode step places the layer's shared layers (the same top-k) in the same launch,
            # their copies deferred to their own tails; else `_prefetch` below places them
            p = self._place(group or self._one[li], rows, q if tok is None else q[tok], acc)
            self._copy(layer, p, 0, False)
            for k, s in enumerate(self._shared_after[layer] if group else [], 1):
                self._copy(s, p, k, False)
                self._prefetched.add(s)
        overflow: list[tuple[int, torch.Tensor]] = []  # (batch row, sorted overflow positions)
        for b in self._pre:
            s, e = ctx.q_start[b], ctx.q_start[b + 1]
            row = self._all.row(b)
            # the chunk's rows ascending as one: the placement kernel's lookup then takes them as they
            # come instead of sorting chunk x top-k positions in one program (the result is the same)
            chunk = q[s:e].reshape(1, -1).sort(dim=1).values
            w = min(self.tail_queries, e - s)
            if w and self._may_overflow(chunk.shape[1]):  # (else the whole chunk fits)
                # what the chunk's last w queries selected first, so that it stays resident
                self._place_tail(layer, li, row, q[e - w : e], acc)
            p = self._place(self._one[li], row, chunk, acc, by_data=True)
            self._swap(layer, p, 0, False)
            if p.overflow is not None:
                n = int(p.overflow.sum())  # host read only where overflow is possible (prefill)
                if n:
                    overflow.append((b, p.u[0][p.overflow[0, 0]]))
        if self._fuse:  # the copies and the lookup in one launch
            rows_out = self._tail(layer, li, q)
        else:
            rows_out = self._lookup(li, q, ctx)
        if overflow:
            self._build_step_pool(layer, topk, ctx, rows_out, overflow)
        if layer in self._shared_ids and group is None:
            self._prefetch(layer, q, ctx)
        return rows_out

    # ---- request lifecycle -------------------------------------------------------------------------
    def bind_rows(self, rids: Sequence[Any], starts: Sequence[int], ends: Sequence[int]) -> list[int]:
        """Host side of a step: the block of each batch row's request (new requests get one; a
        request restarted from below what it had computed gets its block reset). Row b computes
        positions [starts[b], ends[b]). A decode graph calls this before each replay and copies the
        ids into its static `kv_blocks` buffer; an eager step calls it from `_begin`."""
        self._wait_side()
        blocks = []
        for rid, start, end in zip(rids, starts, ends):
            if end > self._P - 1:
                raise ConfigError(f"request {rid!r} reaches {end} tokens, HiSparse holds {self._P - 1}")
            st = self._states.get(rid)
            if st is None:
                st = self._states[rid] = _Req(self._alloc_block())
                self._reset(st.block)
            elif start < st.seen:  # recomputed from scratch (preempted): old residency is void
                self._reset(st.block)
            st.seen = end
            self._block_hi[st.block] = max(self._block_hi[st.block], end)
            blocks.append(st.block)
        return blocks

    def release(self, rids: Iterable[Any]) -> None:
        """Free the device slots of finished / aborted requests."""
        self._wait_side()
        for rid in rids:
            st = self._states.pop(rid, None)
            if st is not None:
                self._free_blocks.append(st.block)

    def close(self) -> None:
        """Drop device buffers and the private host pool (if this cache created it)."""
        self._states.clear()
        self._pending.clear()
        self._write_view = {}
        self._host = {}
        if self._own_pool is not None:
            self._own_pool.close()
            self._own_pool = None

    # ---- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        self._wait_side()
        self._fold_resident(slice(1, None))
        main, side = self._acc["main"].tolist(), self._acc["side"].tolist()
        if self._events:
            torch.cuda.synchronize(self.device)
            self._swap_s += sum(a.elapsed_time(z) for a, z in self._events) / 1e3
            self._events.clear()
        misses = main[1] + side[1]
        return {
            "hisparse": {
                "hits": main[0] + side[0],
                "misses": misses,
                "swap_bytes": main[5] + side[5],
                "swap_seconds": self._swap_s,
                "device_tokens_max": max(main[3], side[3]),
                "device_tokens_cap": self.N,
                "newest_copy_bytes": main[6] + side[6],
                "overflow_rows_max": max(main[4], side[4]),
                "requests": len(self._states),
                "blocks": self._blocks,
            },
            "host_pool_bytes": self.host_layout.spec.nbytes,
        }

    def device_kv_bytes(self) -> int:
        """Bytes of the device MLA slot buffers (the capped part of the KV)."""
        return sum(t.numel() * t.element_size() for t in self._slots.values())

    def nbytes(self) -> int:
        """Device bytes held: slot buffers, index keys and bookkeeping."""
        meta = sum(t.numel() * t.element_size() for t in (self._p2s, self._s2p, self._stamp))
        idx = sum(t.numel() * t.element_size() for t in self._index.values())
        return self.device_kv_bytes() + idx + meta

    # ---- internals -------------------------------------------------------------------------------
    def _new_slot_buffer(self, layer: int, blocks: int) -> torch.Tensor:
        dtype, width = self._row[layer]
        return torch.zeros(1 + blocks * self.N, width, dtype=dtype, device=self.device)

    def _grow(self, n: int) -> None:
        """Room for `n` blocks (ids 1..n; 0 is the padding block). Reallocates: captured graphs that
        hold the old buffers are stale afterwards (`layout_version`)."""
        old = self._blocks
        if old:
            log.info("HiSparse: more than %d concurrent requests, growing to %d blocks", old, n)

        def grown(t: torch.Tensor) -> torch.Tensor:
            g = torch.full((1 + n, *t.shape[1:]), -1, dtype=t.dtype, device=t.device)
            g[: t.shape[0]] = t
            return g

        self._p2s, self._s2p, self._stamp = grown(self._p2s), grown(self._s2p), grown(self._stamp)
        if self._keep_on:  # (kept lists of the old tables are dropped: they select again)
            self._keep = cand_keep_buffers((1 + n) * self._s2p.shape[1], self._cand_n, self.device)
        for i, buf in self._slots.items():
            g = self._new_slot_buffer(i, n)
            g[: buf.shape[0]] = buf
            self._slots[i] = g
        self._free_blocks = list(range(n, old, -1)) + self._free_blocks  # pop() hands out old + 1 first
        self._block_hi += [0] * (n - old)
        self._blocks = n
        self.layout_version += 1

    def _alloc_block(self) -> int:
        if not self._free_blocks:
            self._grow(2 * self._blocks)
        return self._free_blocks.pop()

    def _fold_resident(self, blocks: int | slice) -> None:
        """Fold the most slots ever held per (request, layer) into the stats: a block's count only
        grows until it is reset (an eviction frees the slot it fills), so this is read at reset and
        at `stats` time instead of in every placement of a step."""
        acc = self._acc["main"]
        held = (self._s2p[blocks, :, : self.N] >= 0).sum(-1).max()
        acc[3] = torch.maximum(acc[3], held)

    def _reset(self, block: int) -> None:
        """Forget the block's residency (only the positions its last owner can have placed)."""
        self._fold_resident(block)
        self._p2s[block, :, : self._block_hi[block]].fill_(-1)
        self._s2p[block].fill_(-1)
        self._stamp[block].fill_(-1)
        self._block_hi[block] = 0
        if self._keep:  # its kept candidates no longer hold (free slots again)
            n_l = self._s2p.shape[1]
            self._keep[2][block * n_l : (block + 1) * n_l, 0] = -1

    def _begin(self, ctx: ForwardContext) -> None:
        """First call of a forward pass: the step's rows on the device, the clock, the newest tokens.

        Everything after the binding reads only device tensors (the block ids, `seq_lens`,
        `positions`, the page table and the `valid` mask of a captured batch), so it can run inside
        a captured graph; the Python branches depend only on the batch's shape (q_start)."""
        if ctx is self._ctx:
            return
        self._wait_side()
        self._flush()
        self._ctx = ctx
        self._step_pool.clear()
        self._prefetched.clear()
        dev = self.device
        nq = [ctx.q_start[b + 1] - ctx.q_start[b] for b in range(ctx.num_rows)]
        blk = ctx.extras.get("kv_blocks")
        if blk is None:  # an eager step binds its rows here (a decode graph bound them before replay)
            rids = ctx.extras.get("rids")
            if rids is None:  # contexts built without request ids: key by the first page (no sharing)
                rids = [("page", p) for p in ctx.page_table[:, 0].tolist()]
            ends = list(ctx.seq_lens_cpu)
            ids = self.bind_rows(rids, [e - n for e, n in zip(ends, nq)], ends)
            blk = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        self._pure = all(n == 1 for n in nq)
        self._fuse = self._pure and self.use_triton
        # the step clock ticks on the device (in a replayed graph too); the rows' table offsets and
        # the newest tokens (placed in all layers at once; each layer's `after_write` then only
        # copies its freshly written rows into these slots): one launch for a decode batch
        M = min(self.recent, max(nq))
        start = None if self._pure else ctx.seq_lens.long() - torch.tensor(nq).to(dev, non_blocking=True)
        valid = ctx.extras.get("valid")
        st = step_rows(
            blk, ctx.seq_lens, valid, self._now_t, start, n_layers=len(self.layers), n_slots=self.N,
            pos_len=self._P, recent=self.recent, m=M, backend=self._backend,
        )  # fmt: skip
        rows = _Rows(blk, st.newest_from, st.base, ctx.page_table, valid, st.trow, st.p_at, st.s_at)
        self._all = rows
        self._pre = [b for b, n in enumerate(nq) if n > 1]
        dec = [b for b, n in enumerate(nq) if n == 1]
        if self._pure:
            self._dec = (None, rows)
        elif dec:  # a mixed batch is never captured: host-made index tensors are fine here
            tok = torch.tensor([ctx.q_start[b] for b in dec]).to(dev, non_blocking=True)
            self._dec = (tok, rows.take(torch.tensor(dec).to(dev, non_blocking=True)))
        else:
            self._dec = None
        # a decode step places each (row, layer) twice (the newest tokens, then its own resolve or its
        # full layer's prefetch): the victims of both are among the recent + K oldest evictable slots
        # as they are now, after the clock's tick
        self._cand = None
        fork = self._fork and self._fuse and self._use_cand and self._capturing()
        if fork:  # (a fork inside the graph: the side stream joins the capture here, `_join` ends it)
            assert self._side is not None
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side) if fork else contextlib.nullcontext():
            if self._fuse and self._use_cand:
                keep = CandKeep(*self._keep, self._p2s.view(-1), rows.p_at) if self._keep else None
                self._cand = lru_candidates(
                    self._s2p.view(-1), self._stamp.view(-1), self._now_t, rows.s_at, rows.newest_from,
                    n_slots=self.N, count=self._cand_n, backend=self._backend, keep=keep, **self._place_kw,
                )  # fmt: skip
            self._newest = self._place(self._every, rows, st.newest, self._acc["main"], force=True)
        self._forked = fork
        # the side stream reads memory the main stream made (the newest positions): held until `_join`,
        # else the main stream's next allocation (layer 0's) may reuse it while the fork still reads it
        self._fork_hold = st if fork else None

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _wait_side(self) -> None:
        # outside a capture: the prefetch's side stream; inside one only a fork runs there (`_begin`)
        self._join()
        if self._side is not None and not self._capturing():
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _join(self) -> None:
        """End a fork of `_begin`: the main stream waits for the candidates and the newest placement."""
        if self._forked:
            assert self._side is not None
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._forked = False
            self._fork_hold = None  # (freed after the wait: the main stream reuses it only after the fork)

    def _phys(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Host-pool rows of positions pos [B, M] (>= 0) of the rows whose page tables are `table`."""
        ps = self.page_size
        return table.gather(1, pos // ps).long() * ps + pos % ps

    def _lookup(self, li: int, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Positions q [T, K] (-1 = none) -> their slot-buffer rows in stage layer `li` (-1: not resident)."""
        r = self._all
        assert r is not None
        if self._pure:  # token t is batch row t
            at, base = r.p_at[:, li], r.base
        else:
            qs = ctx.q_seq.long()
            at, base = r.p_at[qs, li], r.base[qs]
        return slot_lookup(q, self._p2s.view(-1), at, base, backend=self._backend)

    def _tail(self, layer: int, li: int, q: torch.Tensor) -> torch.Tensor:
        """A decode layer's deferred copies (newest rows, misses) and its slot lookup, one launch."""
        r = self._all
        assert r is not None
        copies = self._pending.pop(layer, [])
        with self._timed(self.device.type == "cuda" and not self._capturing() and len(copies) > 1):
            return resolve_tail(
                q, self._p2s.view(-1), r.p_at[:, li], r.base, self._write_view[layer], self._slots[layer],
                copies, backend=self._backend,
            )  # fmt: skip

    def _flush(self, layer: int | None = None) -> None:
        """Make the copies deferred to a `resolve` that did not come (one layer, or all)."""
        for i in list(self._pending) if layer is None else [layer]:
            for src, dst, cnt in self._pending.pop(i, []):
                swap_in_rows_counted(self._write_view[i], src, self._slots[i], dst, cnt, self.use_triton)

    def _place(
        self,
        li: slice,
        r: _Rows,
        pos: torch.Tensor,
        acc: torch.Tensor,
        force: bool = False,
        below: torch.Tensor | None = None,
        by_data: bool = False,
    ) -> _Placed:
        """Make `pos` (int [B, M], -1 = none, duplicates allowed; positions >= below[b] and padding
        rows of a captured batch drop out) of rows `r` resident in
        (request, layer) for each of the stage-local layers `li` (L' of them) at once (each layer its
        own LRU). The caller copies (`_swap`) what `copy` marks. The overflow mask is None where
        overflow is impossible, so decode never reads it on the host. `force`: rows were rewritten
        on the host: copy them even if resident (and count them apart from hits / misses).
        `by_data`: M comes from the data (prefill): the torch placement, which compiles nothing.
        A pure decode step's placements take their victims from the step's candidates (`_begin`).
        """
        cand = None  # (the newest tokens are <= recent wide, a top-k <= K: together what C covers)
        if (
            self._cand is not None
            and not by_data
            and pos.shape[1] <= (self.recent if force else self.cfg.index_topk)
        ):
            cand = self._cand[:, li]
        pl = lru_place(
            self._p2s.view(-1), self._s2p.view(-1), self._stamp.view(-1), self._now_t, pos.contiguous(),
            r.p_at[:, li], r.s_at[:, li], r.base, r.newest_from, r.table, acc, n_slots=self.N,
            pos_len=self._P, page_size=self.page_size, force=force, minus1=self._minus1,
            backend="torch" if by_data else self._backend, valid=r.valid, below=below,
            hit_chunk=self._hit_chunk, cand=cand, row_bytes=self._row_bytes[li], **self._place_kw,
        )  # fmt: skip
        possible = self._may_overflow(pos.shape[1]) and not force
        return _Placed(
            pl.u, pl.overflow if possible else None, pl.src, pl.dst, pl.copy, pl.csrc, pl.cdst, pl.cnt
        )

    def _may_overflow(self, m: int) -> bool:
        """Whether a (non-forced) placement of m positions for one row may find no slot for some: more
        than the N - recent slots that the step's newest tokens leave evictable."""
        return m + self.recent > self.N

    def _place_tail(self, layer: int, li: int, row: _Rows, q: torch.Tensor, acc: torch.Tensor) -> None:
        """Make what a prefill row's last queries selected (q [w, K]) resident in stage layer li before
        the chunk's placement, which then finds it as hits and overflows the rest of the chunk. If it
        is more than the N - recent evictable slots hold, the positions selected by the latest queries
        go first. The stats stay those of one placement: what this one swapped in are the chunk's
        misses, not its hits. (Prefill only: the sizes depend on the data.)"""
        w, K = q.shape
        flat = q.reshape(-1).long()
        last_query = torch.arange(w, device=q.device).repeat_interleave(K)
        keep = flat >= 0
        pos, inv = torch.unique(flat[keep], return_inverse=True)  # ascending
        room = self.N - self.recent
        if pos.numel() > room:
            latest = torch.full_like(pos, -1).scatter_reduce(0, inv, last_query[keep], "amax")
            pos = pos[torch.argsort(latest, descending=True, stable=True)[:room]].sort().values
        if pos.numel() == 0:
            return
        tail = self._acc["tail"]
        t = self._place(self._one[li], row, pos[None].to(q.dtype), tail, by_data=True)
        self._swap(layer, t, 0, False)
        acc[0] -= tail[1]  # the chunk's placement will count them as hits
        acc[1] += tail[1]
        acc[5] += tail[5]
        tail.zero_()

    def _copy(self, layer: int, p: _Placed, k: int, force: bool, defer: bool = True) -> None:
        """The copies placement p marked for its k-th layer (stage layer `layer`): on a fused decode
        step deferred to that layer's `resolve` tail (one launch with its lookup), else now."""
        if defer and self._fuse and p.cnt is not None:
            assert p.csrc is not None and p.cdst is not None
            self._pending.setdefault(layer, []).append((p.csrc[:, k], p.cdst[:, k], p.cnt[:, k]))
        else:
            self._swap(layer, p, k, force)

    @contextlib.contextmanager
    def _timed(self, enabled: bool) -> Iterator[None]:
        """Time the swap copies enqueued inside with CUDA events (folded into `swap_seconds` now and
        then, so the list stays small). The first copy of a cache is left out: its events would also
        time the kernels' JIT compile between them (1.6 s for 3.3 MB in the H200 gpu_check)."""
        if not enabled:
            yield
            return
        if not self._timed_before:
            self._timed_before = True
            yield
            return
        a = torch.cuda.Event(enable_timing=True)
        z = torch.cuda.Event(enable_timing=True)
        a.record()
        yield
        z.record()
        self._events.append((a, z))
        if len(self._events) >= 4096:
            torch.cuda.synchronize(self.device)
            self._swap_s += sum(x.elapsed_time(y) for x, y in self._events) / 1e3
            self._events.clear()

    def _swap(self, layer: int, p: _Placed, k: int, force: bool) -> None:
        """Copy what placement p marked for its k-th layer (stage layer `layer`) from the host pool."""
        slots = self._slots[layer]
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        if not (cuda or self.use_triton):  # the torch path (CPU): a host-sized gather
            src, dst = p.src.reshape(-1), p.dst[:, k].reshape(-1)
            idx = p.copy[:, k].reshape(-1).nonzero().squeeze(1)
            swap_in_gather(self._host[layer], src[idx], slots, dst[idx], backend="torch")
        else:  # the copies first, then a kernel that reads their count on the device
            # on CUDA the source is the device alias of the registered host rows (no pinned check)
            view = self._write_view[layer]
            with self._timed(cuda and not force and not self._capturing()):
                if p.cnt is not None:  # the Triton placement compacted them per row
                    assert p.csrc is not None and p.cdst is not None
                    swap_in_rows_counted(
                        view, p.csrc[:, k], slots, p.cdst[:, k], p.cnt[:, k], self.use_triton
                    )
                else:
                    src, dst, mask = p.src.reshape(-1), p.dst[:, k].reshape(-1), p.copy[:, k].reshape(-1)
                    if mask.numel() > 1:  # (a single item already is: a decode step's newest token)
                        order = torch.argsort((~mask).to(torch.int8), stable=True)
                        src, dst = src[order], dst[order]
                    swap_in_counted(view, src, slots, dst, mask.sum(), self.use_triton)
        if not cuda and not force:
            self._swap_s += time.perf_counter() - t0

    def _build_step_pool(
        self,
        layer: int,
        topk: torch.Tensor,
        ctx: ForwardContext,
        rows: torch.Tensor,
        overflow: list[tuple[int, torch.Tensor]],
    ) -> None:
        """Rows no slot could take this step go to [slot buffer | overflow rows] for this layer."""
        slots = self._slots[layer]
        n_ovf = sum(int(p.numel()) for _, p in overflow)
        pool = torch.empty(slots.shape[0] + n_ovf, slots.shape[1], dtype=slots.dtype, device=slots.device)
        pool[: slots.shape[0]] = slots
        off = slots.shape[0]
        for b, ov in overflow:
            dst = torch.arange(off, off + ov.numel(), device=self.device)
            swap_in_gather(
                self._host[layer],
                self._phys(ctx.page_table[b : b + 1], ov[None])[0],
                pool,
                dst,
                backend="triton" if self.use_triton else "torch",
            )
            s, e = ctx.q_start[b], ctx.q_start[b + 1]
            q = topk[s:e].long()
            j = torch.searchsorted(ov, q.clamp(min=0)).clamp(max=ov.numel() - 1)
            hit = (q >= 0) & (rows[s:e] < 0) & (ov[j] == q)
            rows[s:e] = torch.where(hit, off + j, rows[s:e])
            off += ov.numel()
        acc = self._acc["main"]
        acc[4] = torch.maximum(acc[4], torch.tensor(n_ovf, device=self.device))
        self._step_pool[layer] = pool

    def _prefetch(self, layer: int, q: torch.Tensor, ctx: ForwardContext) -> None:
        """Place the following shared layers' misses now (their top-k is this layer's q [T, K])."""
        if self._dec is None or q.shape[1] + self.recent > self.N:
            return
        tok, rows = self._dec
        # a side stream overlaps the copies with this layer's attention; inside a graph capture the
        # prefetch stays on the capturing stream (no cross-stream events or record_stream in a graph)
        stream = None if self._capturing() else self._side
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # made on the main stream, read on the side one: keep their memory until it is done
            q.record_stream(stream)
            ctx.page_table.record_stream(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            acc = self._acc["side" if stream is not None else "main"]
            qd, start = (q, ctx.positions) if tok is None else (q[tok], ctx.positions[tok])
            # one placement for all the shared layers (each its own LRU), then their copies; this
            # step's rows of later layers are not written yet (below: positions before this step)
            p = self._place(self._shared_ids[layer], rows, qd.contiguous(), acc, below=start.contiguous())
            for k, s in enumerate(self._shared_after[layer]):
                # on a side stream the copies overlap this layer's attention; without one there is
                # no overlap to win and the shared layer's own tail copies them
                self._copy(s, p, k, False, defer=stream is None)
                self._prefetched.add(s)
