"""Greedy decoding's argmax over each row of the logits, split over programs so a batch of one fills the GPU.

`argmax_rows(x [D, V] float) -> int64 [D]` has `torch.argmax(x, dim=-1)`'s contract: the first index of the
row's maximum, a NaN counting as larger than any number (the first NaN wins). torch runs a row in one block
(~10 us for a 32K vocabulary on an H100, on the decode step's critical path: the next step's input token);
here each row is cut into S chunks whose programs keep their best (NaN flag, value, first index), and one
program per row picks the winner over them, the lowest index among equals. Two launches of a few us each,
both graph-safe (no host sync).
"""

from __future__ import annotations

import torch

from .common import check, jit, next_pow2, pdl, pdl_wait, row_split, tl, use_triton


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


@jit
def _argmax_chunk_kernel(
    x_ptr, bn_ptr, bv_ptr, bi_ptr, V, CHUNK, sx, S, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    pdl_wait(PDL)
    d = tl.program_id(0).to(tl.int64)
    s_id = tl.program_id(1)
    lo = s_id * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best_n = tl.full([], -1, tl.int32)  # 1: a NaN, 0: a number, -1: nothing yet
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    for c0 in range(lo, hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < hi
        xv = tl.load(x_ptr + d * sx + cols, mask=m, other=float("-inf")).to(tl.float32)
        nan = tl.where(m, (xv != xv).to(tl.int32), -1)
        n_max = tl.max(nan, axis=0)
        v = tl.where(nan == n_max, tl.where(xv != xv, 0.0, xv), float("-inf"))
        v_max = tl.max(v, axis=0)
        hit = (nan == n_max) & (v == v_max)
        i_min = tl.min(tl.where(hit, cols.to(tl.int64), V), axis=0)
        # a later block wins only when strictly better: the first index stays on ties
        take = (n_max > best_n) | ((n_max == best_n) & (v_max > best_v))
        best_n = tl.where(take, n_max, best_n)
        best_v = tl.where(take, v_max, best_v)
        best_i = tl.where(take, i_min, best_i)
    tl.store(bn_ptr + d * S + s_id, best_n)
    tl.store(bv_ptr + d * S + s_id, best_v)
    tl.store(bi_ptr + d * S + s_id, best_i)


@jit
def _argmax_pick_kernel(
    bn_ptr, bv_ptr, bi_ptr, out_ptr, V, S, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    pdl_wait(PDL)
    d = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_S)
    m = i < S
    bn = tl.load(bn_ptr + d * S + i, mask=m, other=-2)
    bv = tl.load(bv_ptr + d * S + i, mask=m, other=float("-inf"))
    bi = tl.load(bi_ptr + d * S + i, mask=m, other=V)
    n_max = tl.max(bn, axis=0)
    v = tl.where(bn == n_max, bv, float("-inf"))
    v_max = tl.max(v, axis=0)
    tl.store(out_ptr + d, tl.min(tl.where((bn == n_max) & (v == v_max), bi, V), axis=0))


def argmax_rows(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """`torch.argmax(x, dim=-1)` of x [D, V] float (V >= 1, unit column stride): int64 [D]."""
    check(x.dim() == 2 and x.dtype.is_floating_point, f"argmax_rows: x must be float [D, V], got {x.dtype}")
    d, v = x.shape
    check(v > 0, "argmax_rows: a row needs at least one column")
    if not use_triton(backend, x.device) or d == 0:
        return argmax_rows_ref(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    block = min(1024, next_pow2(v))
    s, chunk = row_split(v, d, block, x.device, min_blocks=2)
    bn = torch.empty(d, s, dtype=torch.int32, device=x.device)
    bv = torch.empty(d, s, dtype=torch.float32, device=x.device)
    bi = torch.empty(d, s, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(d, s)](x, bn, bv, bi, v, chunk, x.stride(0), s, BLOCK=block, **pdl(x.device))
    out = torch.empty(d, dtype=torch.int64, device=x.device)
    _argmax_pick_kernel[(d,)](
        bn, bv, bi, out, v, s, BLOCK_S=max(2, next_pow2(s)), num_warps=1, **pdl(x.device)
    )
    return out
