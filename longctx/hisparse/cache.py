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
  (request, layer) holds at most N device tokens. Blocks are handed out on a request's first
  step, returned by `release(rids)`, and the buffers grow by doubling when more are needed.

Per (request, layer) the bookkeeping is device tensors: `pos2slot` [layers, ctx + 1] int32
(logical position -> slot, -1 absent, last column a sink for masked writes), `slot2pos`
[layers, N + 1] and `stamp` [layers, N + 1] (last step the slot was used; column N a sink). The
policy is `longctx.hisparse.lru.SlotLRU`'s, done with sort / cumsum / scatter so nothing waits
for the GPU: residency lookup is one gather, victims are the lowest stamps among slots that are
neither requested this step nor holding one of the `recent` newest tokens, misses get victims
by rank, and `swap_in_counted` copies exactly the misses (count stays on the device).

Per step (`_begin`, at the first layer): the newest `recent` tokens of each request get their
slots in every layer of the stage at once (one placement over all layers; each layer keeps its
own LRU), so the newest tokens are always resident. Then per layer:
1. `after_write(layer)`: the new rows are in the host pool; they are copied into the slots chosen
   at the start of the step.
2. full layers: the indexer's top-k -> `resolve(layer)` places this layer's misses and returns
   slot rows; it then PREFETCHES the following shared layers' misses with the same top-k (on a
   side CUDA stream that the shared layers' `after_write` / `resolve` wait for; synchronously
   on CPU), all the shared layers in one placement. Only tokens from before this step are
   prefetched: this step's rows of a later layer are not written yet (that layer's
   `after_write` copies them into their slots).
3. shared layers: `resolve` finds everything resident (prefetched) and only maps rows.

Prefill chunks (several queries per request) may need more distinct tokens than N at once. The
choice here is "raise N for the step": the LRU places as many misses as it has evictable slots,
the rest (overflow) are copied into a per-step pool `[slot buffer | overflow rows]` that
`attend_pool(layer)` returns for that layer until the next step. Overflow rows never become
resident, so `device_tokens_max` <= N always; the per-step extra is reported as
`overflow_rows_max`. Only rows where overflow is possible (n_q * K + recent > N) read a count on
the host; decode rows never do. Results are exact: every attended row is a byte copy of the host
row the paged pool would hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from longctx.config import ModelConfig
from longctx.errors import ConfigError
from longctx.hisparse.gather import swap_in_counted
from longctx.kernels.kv_layout import alloc_index_pool, alloc_mla_pool, mla_row_bytes
from longctx.kernels.swap import swap_in_gather
from longctx.kvstore.host_pool import HostKVLayout, HostKVSpec, HostPool
from longctx.model.context import ForwardContext

_BIG = 1 << 62  # LRU key of slots that may not be evicted this step


@dataclass
class _Req:
    """Device bookkeeping of one request across the stage's layers."""

    block: int
    base: int  # first slot-buffer row of the block
    pos2slot: torch.Tensor  # [layers, cap + 1] int32, -1 = not resident; column cap is a sink
    slot2pos: torch.Tensor  # [layers, N + 1] int64, -1 = free; column N is a sink
    stamp: torch.Tensor  # [layers, N + 1] int64, step of last use (-1 = never)
    seen: int = 0  # KV length after the last step (a restart from below it resets the state)
    newest_from: int = 0  # positions >= this are pinned this step

    def reset(self) -> None:
        self.pos2slot.fill_(-1)
        self.slot2pos.fill_(-1)
        self.stamp.fill_(-1)

    def ensure_capacity(self, n: int) -> None:
        cap = self.pos2slot.shape[1] - 1
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        grown = torch.full(
            (self.pos2slot.shape[0], new_cap + 1), -1, dtype=torch.int32, device=self.pos2slot.device
        )
        grown[:, :cap] = self.pos2slot[:, :cap]
        self.pos2slot = grown


class _Placed(NamedTuple):
    """What `HiSparseKVCache._place` decided for positions `u` in each of its layers."""

    u: torch.Tensor  # [M] the positions, sorted (-1 = none)
    overflow: torch.Tensor | None  # [L', M] found no slot; None where that cannot happen (decode)
    src: torch.Tensor  # [M] their rows in the host pool
    dst: torch.Tensor  # [L', M] their slot-buffer rows
    copy: torch.Tensor  # [L', M] whether the host row must be copied there


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


class HiSparseKVCache:
    """Implements `longctx.model.context.KVCache` with host-backed MLA rows (see module doc).

    `device_tokens` (N) is the per (request, layer) cap on device-resident tokens; it must exceed
    the model's `index_topk` so one decode query's selection always fits. `recent` newest tokens
    of each request stay resident (default min(64, (N - index_topk) // 2)). `host_layout` is the
    stage's shared host KV layout (pipeline stages pass theirs); None creates a private pool.
    """

    dense_readable = False

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        num_pages: int,
        kind: str,
        dtype: torch.dtype,
        device: torch.device,
        device_tokens: int,
        page_size: int = 64,
        use_triton: bool = False,
        host_layout: HostKVLayout | None = None,
        recent: int | None = None,
    ) -> None:
        K = cfg.index_topk
        if device_tokens <= K:
            raise ConfigError(
                f"hisparse_device_tokens ({device_tokens}) must be larger than index_topk ({K})"
            )
        self.cfg, self.layers, self.kind = cfg, layers, kind
        self.index_kind = "fp8" if kind == "fp8" else "auto"
        self.dtype, self.device = dtype, torch.device(device)
        self.page_size, self.num_pages = page_size, num_pages
        self.num_slots = num_pages * page_size
        self.N = device_tokens
        self.recent = max(1, min(64 if recent is None else recent, (device_tokens - K) // 2))
        self.use_triton = use_triton
        L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        template = alloc_mla_pool(1, L, R, kind, dtype, "cpu")
        self._row_dtype, self._row_width = template.dtype, template.shape[1]
        self.row_bytes = mla_row_bytes(L, R, kind, dtype)
        self._index_of = {layer: i for i, layer in enumerate(layers)}

        # host pool: every token's full MLA row, indexed like the paged pool
        self._own_pool: HostPool | None = None
        if host_layout is None:
            spec = HostKVSpec(layers.start, layers.stop, self.num_slots, self.row_bytes)
            pool, _ = HostPool.create(spec.nbytes, tag=f"hisparse{layers.start}.{layers.stop}")
            pool.unlink()  # private to this process: nothing to attach, nothing to leak
            if self.device.type == "cuda":
                pool.register_cuda()
            host_layout = HostKVLayout(pool, spec)
            self._own_pool = pool
        spec = host_layout.spec
        if spec.row_bytes != self.row_bytes or spec.num_slots < self.num_slots:
            raise ConfigError(
                f"host KV layout {spec} does not fit {self.num_slots} rows of {self.row_bytes} B"
            )
        if not (spec.layer_start <= layers.start and layers.stop <= spec.layer_end):
            raise ConfigError(
                f"host KV layout covers layers [{spec.layer_start}, {spec.layer_end}), need {layers}"
            )
        self.host_layout = host_layout
        self._host = {i: host_layout.layer_view(i).view(self._row_dtype) for i in layers}  # [slots, W]
        if self.device.type == "cuda":
            self._write_view = {i: _device_alias(t, self.device) for i, t in self._host.items()}
        else:
            self._write_view = self._host

        D = cfg.index_head_dim
        self._index = {
            i: alloc_index_pool(self.num_slots, D, self.index_kind, dtype, self.device).zero_()
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

        self._num_blocks = 0
        self._free_blocks: list[int] = []
        self._slots = {i: self._new_slot_buffer(0) for i in layers}
        self._states: dict[Any, _Req] = {}
        self._rows: list[_Req] = []  # the current step's request states, by batch row
        # per batch row: (host rows, slot rows [layers, M], copy mask [layers, M]) of its newest tokens
        self._newest: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._layer_id_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._ctx: ForwardContext | None = None
        self._now = 0
        self._now_t = torch.zeros((), dtype=torch.int64, device=self.device)  # the clock, on the device
        self._minus1 = torch.full((), -1, dtype=torch.int32, device=self.device)
        self._step_pool: dict[int, torch.Tensor] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # stats: [hits, misses, newest-row copies, max resident, overflow rows max] per stream
        self._acc = {k: torch.zeros(5, dtype=torch.int64, device=self.device) for k in ("main", "side")}
        self._swap_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # ---- KVCache ---------------------------------------------------------------------------------
    def mla_pool(self, layer: int) -> torch.Tensor:
        return self._write_view[layer]

    def index_pool(self, layer: int) -> torch.Tensor:
        return self._index[layer]

    def attend_pool(self, layer: int) -> torch.Tensor:
        pool = self._step_pool.get(layer)
        return pool if pool is not None else self._slots[layer]

    def after_write(self, layer: int, ctx: ForwardContext) -> None:
        """The new rows are in the host pool: copy each request's newest ones into the slots
        `_begin` chose for them in every layer."""
        self._begin(ctx)
        self._wait_side()
        li = self._index_of[layer]
        for src, dst, copy in self._newest:
            self._swap(layer, src, dst[li], copy[li], True)

    def resolve(self, layer: int, topk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Top-k logical positions [T, K] (-1 = none) -> rows of `attend_pool(layer)` (-1 stays)."""
        self._begin(ctx)
        self._wait_side()
        li = self._index_of[layer]
        rows = torch.full(topk.shape, -1, dtype=torch.int64, device=topk.device)
        overflow: list[tuple[int, torch.Tensor]] = []  # (batch row, sorted overflow positions)
        for b, st in enumerate(self._rows):
            s, e = ctx.q_start[b], ctx.q_start[b + 1]
            q = topk[s:e].long()
            if (layer, b) not in self._prefetched:
                p = self._place([li], b, st, q.reshape(-1), ctx, self._acc["main"])
                self._swap(layer, p.src, p.dst[0], p.copy[0], False)
                if p.overflow is not None:
                    n = int(p.overflow[0].sum())  # host read only where overflow is possible (prefill)
                    if n:
                        overflow.append((b, p.u[p.overflow[0]]))
            slot = st.pos2slot[li][q.clamp(min=0)].long()
            rows[s:e] = torch.where((q >= 0) & (slot >= 0), st.base + slot, -1)
        if overflow:
            self._build_step_pool(layer, topk, ctx, rows, overflow)
        if layer in self._shared_after and self._shared_after[layer]:
            self._prefetch(layer, topk, ctx)
        return rows

    # ---- request lifecycle -------------------------------------------------------------------------
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
        self._write_view = {}
        self._host = {}
        if self._own_pool is not None:
            self._own_pool.close()
            self._own_pool = None

    # ---- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        self._wait_side()
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
                "swap_bytes": misses * self.row_bytes,
                "swap_seconds": self._swap_s,
                "device_tokens_max": max(main[3], side[3]),
                "device_tokens_cap": self.N,
                "newest_copy_bytes": (main[2] + side[2]) * self.row_bytes,
                "overflow_rows_max": max(main[4], side[4]),
                "requests": len(self._states),
            },
            "host_pool_bytes": self.host_layout.spec.nbytes,
        }

    def device_kv_bytes(self) -> int:
        """Bytes of the device MLA slot buffers (the capped part of the KV)."""
        return sum(t.numel() * t.element_size() for t in self._slots.values())

    def nbytes(self) -> int:
        """Device bytes held: slot buffers, index keys and bookkeeping."""
        meta = sum(
            t.numel() * t.element_size()
            for st in self._states.values()
            for t in (st.pos2slot, st.slot2pos, st.stamp)
        )
        idx = sum(t.numel() * t.element_size() for t in self._index.values())
        return self.device_kv_bytes() + idx + meta

    # ---- internals -------------------------------------------------------------------------------
    def _new_slot_buffer(self, blocks: int) -> torch.Tensor:
        return torch.zeros(1 + blocks * self.N, self._row_width, dtype=self._row_dtype, device=self.device)

    def _alloc_block(self) -> int:
        if not self._free_blocks:
            old = self._num_blocks
            new = max(1, 2 * old)
            for i, buf in self._slots.items():
                grown = self._new_slot_buffer(new)
                grown[: buf.shape[0]] = buf
                self._slots[i] = grown
            self._free_blocks = list(range(new - 1, old - 1, -1))
            self._num_blocks = new
        return self._free_blocks.pop()

    def _new_state(self) -> _Req:
        block = self._alloc_block()
        n_l, dev = len(self.layers), self.device
        return _Req(
            block=block,
            base=1 + block * self.N,
            pos2slot=torch.full((n_l, 1), -1, dtype=torch.int32, device=dev),
            slot2pos=torch.full((n_l, self.N + 1), -1, dtype=torch.int64, device=dev),
            stamp=torch.full((n_l, self.N + 1), -1, dtype=torch.int64, device=dev),
        )

    def _begin(self, ctx: ForwardContext) -> None:
        """First call of a forward pass: bind batch rows to request states, advance the clock."""
        if ctx is self._ctx:
            return
        self._wait_side()
        self._ctx = ctx
        self._now += 1
        self._now_t.fill_(self._now)
        self._step_pool.clear()
        self._prefetched.clear()
        rids = ctx.extras.get("rids")
        if rids is None:  # contexts built without request ids: key by the first page (no sharing)
            rids = [("page", p) for p in ctx.page_table[:, 0].tolist()]
        self._rows = []
        for b, rid in enumerate(rids):
            end = ctx.seq_lens_cpu[b]
            start = end - (ctx.q_start[b + 1] - ctx.q_start[b])
            st = self._states.get(rid)
            if st is None:
                st = self._states[rid] = self._new_state()
            elif start < st.seen:  # recomputed from scratch (preempted): old residency is void
                st.reset()
            st.ensure_capacity(end)
            st.seen = end
            st.newest_from = max(0, end - self.recent)
            self._rows.append(st)
        # the newest tokens of every request, placed in all layers at once; each layer's
        # `after_write` then only copies its freshly written rows into these slots
        every = list(range(len(self.layers)))
        self._newest = []
        for b, st in enumerate(self._rows):
            end = ctx.seq_lens_cpu[b]
            lo = max(end - (ctx.q_start[b + 1] - ctx.q_start[b]), st.newest_from)
            pos = torch.arange(lo, end, device=self.device)
            p = self._place(every, b, st, pos, ctx, self._acc["main"], force=True)
            self._newest.append((p.src, p.dst, p.copy))

    def _wait_side(self) -> None:
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _phys(self, ctx: ForwardContext, b: int, pos: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return ctx.page_table[b].long()[pos // ps] * ps + pos % ps

    def _place(
        self,
        lis: list[int],
        b: int,
        st: _Req,
        pos: torch.Tensor,
        ctx: ForwardContext,
        acc: torch.Tensor,
        force: bool = False,
    ) -> _Placed:
        """Make `pos` (int64 [M], -1 = none, duplicates allowed) of batch row `b` resident in
        (request, layer) for each of the stage-local layer indices `lis` at once (each layer its
        own LRU). The caller copies (`_swap`) what `copy` marks. The overflow mask is None where
        overflow is impossible, so decode never reads it on the host. `force`: rows were rewritten
        on the host: copy them even if resident (and count them apart from hits / misses).
        """
        N, now = self.N, self._now
        u = torch.sort(pos).values
        first = torch.ones_like(u, dtype=torch.bool)
        first[1:] = u[1:] != u[:-1]
        m = first & (u >= 0)
        uc = u.clamp(min=0)
        P, S = st.pos2slot.shape[1], N + 1  # row lengths; column P - 1 / N is each layer's sink
        li = self._layer_ids(lis)
        bp, bs = li[:, None] * P, li[:, None] * S  # each layer's offset in the flattened tables
        p2s, s2p, stamp = st.pos2slot.view(-1), st.slot2pos.view(-1), st.stamp.view(-1)
        slot = p2s[bp + uc].long()  # [L', M]
        res = m & (slot >= 0)
        # values stored through index_put_ are device scalars: for a CUDA destination PyTorch makes a
        # Python number a CPU scalar tensor (the store that once put a host->device copy in moe_align)
        now_t, minus1 = self._now_t, self._minus1
        stamp[bs + torch.where(res, slot, N)] = now_t  # touch hits; they may not be evicted this step
        need = m & (slot < 0)
        s2p_n, stamp_n = st.slot2pos[li, :N], st.stamp[li, :N]
        key = torch.where((s2p_n >= st.newest_from) | (stamp_n == now), _BIG, stamp_n)
        order = torch.argsort(key, dim=1, stable=True)  # free slots (stamp -1) first, then LRU
        cap = (key < _BIG).sum(1, keepdim=True)
        rank = torch.cumsum(need.long(), 1) - 1
        placed = need & (rank < cap)
        vslot = torch.where(placed, order.gather(1, rank.clamp(0, N - 1)), N)
        sv = bs + vslot
        old = s2p[sv]
        p2s[bp + torch.where(placed & (old >= 0), old, P - 1)] = minus1  # evict
        s2p[sv] = u.expand_as(vslot)
        p2s[bp + torch.where(placed, uc, P - 1)] = vslot.to(torch.int32)
        stamp[sv] = now_t
        copy = placed | (res & force)
        dst = st.base + torch.where(placed, vslot, slot)
        if force:
            acc[2] += copy.sum()
        else:
            acc[0] += res.sum()
            acc[1] += need.sum()
        acc[3] = torch.maximum(acc[3], (st.slot2pos[li, :N] >= 0).sum(1).max())
        possible = int(pos.numel()) + self.recent > N and not force
        return _Placed(u, (need & ~placed) if possible else None, self._phys(ctx, b, uc), dst, copy)

    def _layer_ids(self, lis: list[int]) -> torch.Tensor:
        """`lis` as a device tensor, made once per distinct list: a fresh `torch.tensor(..., device)`
        per step would be a blocking host->device copy."""
        key = tuple(lis)
        t = self._layer_id_cache.get(key)
        if t is None:
            t = self._layer_id_cache[key] = torch.tensor(lis, dtype=torch.int64, device=self.device)
        return t

    def _swap(
        self, layer: int, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor, force: bool
    ) -> None:
        host, slots = self._host[layer], self._slots[layer]
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            idx = mask.nonzero().squeeze(1)
            swap_in_gather(host, src[idx], slots, dst[idx], backend="torch")
            if not force:
                self._swap_s += time.perf_counter() - t0
            return
        if mask.numel() > 1:  # the copies first (a single item already is: a decode step's newest token)
            order = torch.argsort((~mask).to(torch.int8), stable=True)
            src, dst = src[order], dst[order]
        a = torch.cuda.Event(enable_timing=True)
        z = torch.cuda.Event(enable_timing=True)
        a.record()
        swap_in_counted(host, src, slots, dst, mask.sum(), self.use_triton)
        z.record()
        if not force:
            self._events.append((a, z))
            if len(self._events) >= 4096:  # fold now and then so the list stays small
                torch.cuda.synchronize(self.device)
                self._swap_s += sum(x.elapsed_time(y) for x, y in self._events) / 1e3
                self._events.clear()

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
                self._phys(ctx, b, ov),
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

    def _prefetch(self, layer: int, topk: torch.Tensor, ctx: ForwardContext) -> None:
        """Place the following shared layers' misses now (their top-k is this layer's)."""
        K = topk.shape[1]
        todo = [
            b
            for b in range(len(self._rows))
            if ctx.q_start[b + 1] - ctx.q_start[b] == 1 and K + self.recent <= self.N
        ]
        if not todo:
            return
        stream = self._side
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # made on the main stream, read on the side one: keep their memory until it is done
            topk.record_stream(stream)
            ctx.page_table.record_stream(stream)
        with torch.cuda.stream(stream) if stream is not None else _null():
            acc = self._acc["side" if stream is not None else "main"]
            shared = self._shared_after[layer]
            lis = [self._index_of[s] for s in shared]
            for b in todo:
                st = self._rows[b]
                start = ctx.seq_lens_cpu[b] - 1
                q = topk[ctx.q_start[b]].long()
                q = torch.where(q < start, q, -1)  # this step's rows of later layers are not written yet
                # one placement for all the shared layers (each its own LRU), then their copies
                p = self._place(lis, b, st, q, ctx, acc)
                for k, s in enumerate(shared):
                    self._swap(s, p.src, p.dst[k], p.copy[k], False)
                    self._prefetched.add((s, b))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
