"""The small per-step and per-layer index arithmetic of `HiSparseKVCache` (longctx.hisparse.cache),
one launch each on the Triton path instead of a dozen tiny torch ops (each node of a replayed CUDA
graph costs ~1-1.4 us even when it does nothing).

- `step_rows`: at the start of a step, from each batch row's block id and KV length, the row's
  offsets into the flat bookkeeping tables of every stage layer, its first slot-buffer row, the
  first position pinned as newest, and the newest positions to place this step; it also ticks the
  device step clock. Triton only for pure decode batches (one new token per row).
- `slot_lookup`: top-k positions [T, K] -> slot-buffer rows of one layer (-1 where none or not
  resident), reading `p2s` directly.
- `resolve_tail`: the end of a decode layer's `resolve` in one launch: `slot_lookup` and up to two
  counted row-copy lists (the layer's newest rows and its misses, as `lru_place` compacts them)
  from the host pool into the layer's slot buffer; the two jobs touch disjoint memory, so their
  programs share one grid.

Each has its torch reference next to it (`*_ref`, the CPU path and the specification; exact, so
the Triton versions match it bit for bit).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .common import check, jit, next_pow2, tl, triton_interpret, use_triton
from .swap import ROW_KNOBS, copy_geometry, copy_items

CopyList = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # src [B, M], dst [B, M], count [B]


class StepRows(NamedTuple):
    newest_from: torch.Tensor  # [B] int64: positions >= this are pinned this step
    base: torch.Tensor  # [B] int64 first slot-buffer row of the block
    trow: torch.Tensor  # [B, L] int64 (block, layer) row of the flattened tables
    p_at: torch.Tensor  # [B, L] int64 its offset in flat pos2slot
    s_at: torch.Tensor  # [B, L] int64 its offset in flat slot2pos / stamp
    newest: torch.Tensor  # [B, M] int64 newest positions to place (-1 = none)


def step_rows_ref(
    blk: torch.Tensor,
    seq_lens: torch.Tensor,
    valid: torch.Tensor | None,
    now: torch.Tensor,
    start: torch.Tensor | None,
    *,
    n_layers: int,
    n_slots: int,
    pos_len: int,
    recent: int,
    m: int,
) -> StepRows:
    """blk: int64 [B] block ids (0 = padding); seq_lens: int [B] KV length after the step; valid:
    bool [B] or None (False: a padding row, which requests nothing); now: the 0-d int64 step clock
    (incremented in place); start: int64 [B] first position computed this step, None for
    seq_lens - 1 (decode). N = n_slots, P = pos_len; the newest positions are the last `m` before
    seq_lens that are >= max(start, newest_from)."""
    now.add_(1)
    end = seq_lens.long()
    trow = blk[:, None] * n_layers + torch.arange(n_layers, device=blk.device)
    newest_from = (end - recent).clamp(min=0)
    base = 1 + (blk - 1) * n_slots
    lo = torch.maximum(end - 1 if start is None else start, newest_from)
    pos = end[:, None] - m + torch.arange(m, device=blk.device)
    pos = torch.where(pos >= lo[:, None], pos, -1)
    if valid is not None:
        pos = torch.where(valid[:, None], pos, -1)
    return StepRows(newest_from, base, trow, trow * pos_len, trow * (n_slots + 1), pos)


def step_rows(
    blk: torch.Tensor,
    seq_lens: torch.Tensor,
    valid: torch.Tensor | None,
    now: torch.Tensor,
    start: torch.Tensor | None,
    *,
    n_layers: int,
    n_slots: int,
    pos_len: int,
    recent: int,
    m: int,
    backend: str = "auto",
) -> StepRows:
    """`step_rows_ref` in one launch where it can (decode: start None). Asynchronous on CUDA."""
    B = blk.shape[0]
    check(blk.dtype == torch.int64 and blk.dim() == 1 and blk.is_contiguous(), "blk: int64 [B]")
    check(seq_lens.shape == (B,) and seq_lens.is_contiguous(), "seq_lens: [B]")
    check(valid is None or (valid.shape == (B,) and valid.dtype == torch.bool), "valid: bool [B]")
    check(now.dim() == 0 and now.dtype == torch.int64, "now: 0-d int64")
    kw = dict(n_layers=n_layers, n_slots=n_slots, pos_len=pos_len, recent=recent, m=m)
    if not use_triton(backend, blk.device) or start is not None or B == 0 or m == 0:
        return step_rows_ref(blk, seq_lens, valid, now, start, **kw)  # type: ignore[arg-type]
    dev = blk.device
    out = torch.empty((4, B), dtype=torch.int64, device=dev)  # newest_from, base, (spare x2)
    rows = torch.empty((3, B, n_layers), dtype=torch.int64, device=dev)  # trow, p_at, s_at
    pos = torch.empty((B, m), dtype=torch.int64, device=dev)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _step_rows_kernel[(B,)](
            blk, seq_lens, valid if valid is not None else blk, now, out[0], out[1], rows[0], rows[1],
            rows[2], pos, n_layers, n_slots, pos_len, recent, m, HAS_VALID=valid is not None,
            BLOCK_L=next_pow2(n_layers), BLOCK_M=next_pow2(m), num_warps=1,
        )  # fmt: skip
    return StepRows(out[0], out[1], rows[0], rows[1], rows[2], pos)


def slot_lookup_ref(
    q: torch.Tensor, p2s: torch.Tensor, p_at: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """q: int [T, K] positions (-1 = none); p2s: flat int32 table; p_at: int64 [T] each token's
    (row, layer) offset in it; base: int64 [T] its first slot-buffer row. Returns int64 [T, K]:
    base + slot where the position is resident, else -1."""
    q = q.long()
    slot = p2s[p_at[:, None] + q.clamp(min=0)].long()
    return torch.where((q >= 0) & (slot >= 0), base[:, None] + slot, -1)


def slot_lookup(
    q: torch.Tensor, p2s: torch.Tensor, p_at: torch.Tensor, base: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """`slot_lookup_ref` in one launch (p_at / base may be strided views). Asynchronous on CUDA."""
    check(q.dim() == 2 and q.stride(1) == 1, "q: [T, K] contiguous along K")
    check(p2s.dim() == 1 and p2s.dtype == torch.int32, "p2s must be flat int32")
    T, K = q.shape
    check(p_at.shape == (T,) and base.shape == (T,), "p_at / base: [T]")
    check(p_at.dtype == base.dtype == torch.int64, "p_at / base must be int64")
    if not use_triton(backend, q.device) or T * K == 0:
        return slot_lookup_ref(q, p2s, p_at, base)
    out = torch.empty((T, K), dtype=torch.int64, device=q.device)
    block_k = min(1024, next_pow2(K))
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _slot_lookup_kernel[(T, (K + block_k - 1) // block_k)](
            q, q.stride(0), p2s, p_at, p_at.stride(0), base, base.stride(0), out, K,
            BLOCK_K=block_k, num_warps=4,
        )  # fmt: skip
    return out


def resolve_tail_ref(
    q: torch.Tensor,
    p2s: torch.Tensor,
    p_at: torch.Tensor,
    base: torch.Tensor,
    host_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    copies: list[CopyList],
) -> torch.Tensor:
    """Reference: for each (src, dst, count) of `copies`, host_pool[src[b, i]] -> dst_pool[dst[b, i]]
    for i < count[b]; then `slot_lookup_ref(q, p2s, p_at, base)`."""
    for src, dst, cnt in copies:
        m = torch.arange(src.shape[1], device=cnt.device) < cnt[:, None]
        dst_pool[dst[m]] = host_pool[src[m].to(host_pool.device)].to(dst_pool.device)
    return slot_lookup_ref(q, p2s, p_at, base)


def resolve_tail(
    q: torch.Tensor,
    p2s: torch.Tensor,
    p_at: torch.Tensor,
    base: torch.Tensor,
    host_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    copies: list[CopyList],
    backend: str = "auto",
) -> torch.Tensor:
    """`resolve_tail_ref` in one launch (at most two copy lists; src / dst int64 [B, M] contiguous
    along M, count int64 [B], all on dst_pool's device; host_pool as in
    `longctx.hisparse.gather.swap_in_counted`). No host sync; asynchronous on CUDA."""
    check(len(copies) <= 2, "at most two copy lists")
    for src, dst, cnt in copies:
        check(src.dim() == 2 and src.shape == dst.shape, "src / dst: [B, M]")
        check(src.stride(1) == 1 and dst.stride(1) == 1, "copy lists must be contiguous along M")
        check(cnt.shape == (src.shape[0],) and cnt.dtype == torch.int64, "count: int64 [B]")
    T, K = q.shape
    on_dev = dst_pool.device.type == "cuda" or triton_interpret()
    if not (use_triton(backend, q.device) and on_dev) or T * K == 0:
        return resolve_tail_ref(q, p2s, p_at, base, host_pool, dst_pool, copies)
    check(q.dim() == 2 and q.stride(1) == 1, "q: [T, K] contiguous along K")
    check(p2s.dim() == 1 and p2s.dtype == torch.int32, "p2s must be flat int32")
    check(p_at.shape == (T,) and base.shape == (T,), "p_at / base: [T]")
    check(host_pool.shape[1] == dst_pool.shape[1] and host_pool.dtype == dst_pool.dtype, "pools differ")
    g = copy_geometry(host_pool, dst_pool, knobs=ROW_KNOBS.plain())  # this kernel grids its copies
    items = g.items
    block_k = min(1024, next_pow2(K))
    n_look = T * ((K + block_k - 1) // block_k)
    lists = list(copies) + [(q, q, base)] * (2 - len(copies))  # (padding lists get no programs)
    ms = [src.shape[1] if i < len(copies) else 0 for i, (src, _, _) in enumerate(lists)]
    n1 = lists[0][0].shape[0] * ((ms[0] + items - 1) // items)
    n2 = lists[1][0].shape[0] * ((ms[1] + items - 1) // items)
    out = torch.empty((T, K), dtype=torch.int64, device=q.device)
    (s1, d1, c1), (s2, d2, c2) = lists
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _resolve_tail_kernel[(n_look + n1 + n2,)](
            q, q.stride(0), p2s, p_at, p_at.stride(0), base, base.stride(0), out, K, n_look,
            host_pool.view(torch.uint8).view(g.word), dst_pool.view(torch.uint8).view(g.word),
            s1, d1, s1.stride(0), d1.stride(0), c1, c1.stride(0), max(ms[0], 1), n1,
            s2, d2, s2.stride(0), d2.stride(0), c2, c2.stride(0), max(ms[1], 1),
            BLOCK_K=block_k, ROW_W=g.row_w, ITEMS=items, BLOCK_W=g.block_w, num_warps=g.warps,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- Triton


@jit
def _step_rows_kernel(
    blk_ptr, len_ptr, valid_ptr, now_ptr, nf_ptr, base_ptr, trow_ptr, pat_ptr, sat_ptr, pos_ptr,
    L, N, P, RECENT, M,
    HAS_VALID: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    if b == 0:  # the clock ticks once per step; later launches read it
        tl.store(now_ptr, tl.load(now_ptr) + 1)
    blk = tl.load(blk_ptr + b)
    end = tl.load(len_ptr + b).to(tl.int64)
    nf = tl.maximum(end - RECENT, 0)
    tl.store(nf_ptr + b, nf)
    tl.store(base_ptr + b, 1 + (blk - 1) * N)
    li = tl.arange(0, BLOCK_L)
    lm = li < L
    trow = blk * L + li
    o = b.to(tl.int64) * L + li
    tl.store(trow_ptr + o, trow, mask=lm)
    tl.store(pat_ptr + o, trow * P, mask=lm)
    tl.store(sat_ptr + o, trow * (N + 1), mask=lm)
    i = tl.arange(0, BLOCK_M)
    pos = end - M + i
    keep = pos >= tl.maximum(end - 1, nf)
    if HAS_VALID:
        keep = keep & (tl.load(valid_ptr + b) != 0)
    tl.store(pos_ptr + b.to(tl.int64) * M + i, tl.where(keep, pos, -1), mask=i < M)


@jit
def _slot_lookup_kernel(
    q_ptr, stride_q, p2s_ptr, pat_ptr, stride_p, base_ptr, stride_b, out_ptr, K, BLOCK_K: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    km = k < K
    q = tl.load(q_ptr + t * stride_q + k, mask=km, other=-1).to(tl.int64)
    at = tl.load(pat_ptr + t * stride_p)
    slot = tl.load(p2s_ptr + at + tl.maximum(q, 0), mask=km & (q >= 0), other=-1).to(tl.int64)
    base = tl.load(base_ptr + t * stride_b)
    tl.store(out_ptr + t * K + k, tl.where((q >= 0) & (slot >= 0), base + slot, -1), mask=km)


@jit
def _copy_items(src_ptr, dst_ptr, srows_ptr, drows_ptr, cnt_ptr, r, chunk, stride_s, stride_d, stride_c,
                ROW_W: tl.constexpr, ITEMS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    # items [chunk * ITEMS, +ITEMS) of batch row r's list (those below its count)
    r = r.to(tl.int64)
    n = tl.load(cnt_ptr + r * stride_c)
    copy_items(
        src_ptr, srows_ptr + r * stride_s, dst_ptr, drows_ptr + r * stride_d, chunk * ITEMS, n,
        ROW_W, ROW_W, ITEMS, BLOCK_W,
    )  # fmt: skip


@jit
def _resolve_tail_kernel(
    q_ptr, stride_q, p2s_ptr, pat_ptr, stride_p, base_ptr, stride_b, out_ptr, K, n_look,
    src_ptr, dst_ptr,
    s1_ptr, d1_ptr, stride_s1, stride_d1, c1_ptr, stride_c1, M1, n1,
    s2_ptr, d2_ptr, stride_s2, stride_d2, c2_ptr, stride_c2, M2,
    BLOCK_K: tl.constexpr, ROW_W: tl.constexpr, ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # programs [0, n_look): the lookup, one (token, block of K) each; then list 1's, then list 2's
    # (one (batch row, ITEMS items) each; past the row's count they return at once)
    pid = tl.program_id(0)
    if pid < n_look:
        nkb = (K + BLOCK_K - 1) // BLOCK_K
        t = (pid // nkb).to(tl.int64)
        k = (pid % nkb) * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K
        q = tl.load(q_ptr + t * stride_q + k, mask=km, other=-1).to(tl.int64)
        at = tl.load(pat_ptr + t * stride_p)
        slot = tl.load(p2s_ptr + at + tl.maximum(q, 0), mask=km & (q >= 0), other=-1).to(tl.int64)
        base = tl.load(base_ptr + t * stride_b)
        tl.store(out_ptr + t * K + k, tl.where((q >= 0) & (slot >= 0), base + slot, -1), mask=km)
    elif pid < n_look + n1:
        i = pid - n_look
        per = (M1 + ITEMS - 1) // ITEMS
        _copy_items(src_ptr, dst_ptr, s1_ptr, d1_ptr, c1_ptr, i // per, i % per, stride_s1, stride_d1,
                    stride_c1, ROW_W, ITEMS, BLOCK_W)  # fmt: skip
    else:
        i = pid - n_look - n1
        per = (M2 + ITEMS - 1) // ITEMS
        _copy_items(src_ptr, dst_ptr, s2_ptr, d2_ptr, c2_ptr, i // per, i % per, stride_s2, stride_d2,
                    stride_c2, ROW_W, ITEMS, BLOCK_W)  # fmt: skip
