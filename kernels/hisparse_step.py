"""The small per-step and per-layer index arithmetic of `HiSparseKVCache` (longctx.hisparse.cache),
one launch each on the Triton path instead of a dozen tiny torch ops (each node of a replayed CUDA
graph costs ~1-1.4 us even when it does nothing).

- `step_rows`: at the start of a step, from each batch row's block id and KV length, the row's
  offsets into the flat bookkeeping tables of every stage layer, its first slot-buffer row, the
  first position pinned as newest, and the newest positions to place this step; it also ticks the
  device step clock. Triton only for pure decode batches (one new token per row).
- `slot_lookup`: top-k positions [T, K] -> slot-buffer rows of one layer (-1 where none or not
  resident), reading `p2s` directly.

Each has its torch reference next to it (`*_ref`, the CPU path and the specification; exact, so
the Triton versions match it bit for bit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .common import check, jit, next_pow2, tl, use_triton


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
    with torch.cuda.device(dev) if dev.type == "cuda" else _nullctx():
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
    with torch.cuda.device(q.device) if q.device.type == "cuda" else _nullctx():
        _slot_lookup_kernel[(T, (K + block_k - 1) // block_k)](
            q, q.stride(0), p2s, p_at, p_at.stride(0), base, base.stride(0), out, K,
            BLOCK_K=block_k, num_warps=4,
        )  # fmt: skip
    return out


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


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
