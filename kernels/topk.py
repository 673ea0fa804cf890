"""Exact top-k indices per row (the DSA token selection), by radix select over the float bits.

`topk_indices(logits [Tq, N] fp32, k, valid_len [Tq]) -> int32 [Tq, k]`: row i selects the k
largest of logits[i, :valid_len[i]]; when valid_len[i] <= k it selects all of them and pads with -1.

Contract (identical for the Triton kernel and the torch reference, which tests check bit for bit):
- Order: the value order of IEEE floats, with -0.0 treated as +0.0; +NaN ranks above +inf and
  -NaN below -inf (no caller should produce NaN). -inf entries inside valid_len are ordinary
  values (selected only if fewer than k larger values exist).
- Ties at the boundary: the lowest indices win, so the selected SET equals the first k of a
  stable sort by (value descending, index ascending). Without ties at the boundary it equals
  the set `torch.topk` returns.
- Output order: selected indices ascending, then the -1 padding. Ascending order falls out of
  the deterministic compaction, so it costs nothing.

Triton algorithm (design point: N = 1,048,576 keys, k <= 2048; any N < 2^31 works): map each
float to an int32 key whose signed order is the float order, then find the k-th largest key T with
four histogram passes over 8 bits each (256 bins): pass L counts the digits of the keys that
still match the prefix found so far, and the next pass starts by locating, from that histogram,
the bucket holding the k-th largest. 8-bit digits because `tl.histogram` lowers to one warp
ballot per index bit plus a popcount per bin owned by each lane, so its cost grows with the bin
count: 256 bins cost ~70 integer ops per element, 2048 bins ~800.
A count pass then records, per chunk, how many keys are > T and == T; a write pass turns those
counts into exclusive prefix sums and stores the keys > T plus the lowest-index keys == T at
deterministic ascending positions. Every pass runs one program per (query, chunk of CHUNK keys),
so a single 1M-key query still fills the GPU; every pass re-reads the logits (4 MB at 1M,
L2-resident after the first); per-chunk histograms are merged with one atomic per non-empty bin.
Launches per call: 1 memset + 4 histogram passes + count + write (the write pass pads with -1 itself).

`window` W > 0 (`index_local_window`): the selection of a query at `positions[i]` is the top k of its keys
before the window followed by the window's W positions (`with_local_window`), [Tq, k + W]; the write pass
stores the window too, and a query with at most k + W keys (every key selected) in full, so the decode
step's selection costs no torch ops after the top-k (there were ~6 small launches a full layer).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from .common import check, jit, next_pow2, pdl, pdl_wait, tl, use_triton

# LONGCTX_TOPK_WINDOW=0: the window composed after the kernel's top-k with torch ops, as before the
# twenty-third session (bench/session.sh sets it for a GPU where gpu_kernel_check's topk_window failed)
WINDOW_IN_WRITE = os.environ.get("LONGCTX_TOPK_WINDOW", "1").strip() != "0"
# Rows of at least this many keys go in chunks of 4096 a program, shorter ones in 1024 (more programs a pass
# for fewer keys). LONGCTX_TOPK_BIG_CHUNK_FROM sets it for a process (A/B: 128K decode's six passes of one
# full layer sit on its critical path, bench/results/pdl-s58-h100.md).
BIG_CHUNK_FROM = int(os.environ.get("LONGCTX_TOPK_BIG_CHUNK_FROM", "65536"))
_NB = 256  # bins per radix pass (8-bit digits, 4 passes cover the 32-bit key)
_LEVELS = 4


def _check(logits: torch.Tensor, k: int, valid_len: torch.Tensor) -> None:
    check(
        logits.dim() == 2 and logits.dtype == torch.float32,
        f"logits must be fp32 [Tq, N], got {tuple(logits.shape)} {logits.dtype}",
    )
    check(logits.stride(1) == 1, "logits must have unit stride on N")
    check(isinstance(k, int) and k >= 0, f"k must be a non-negative int, got {k!r}")
    check(
        valid_len.shape == (logits.shape[0],) and valid_len.dtype in (torch.int32, torch.int64),
        "valid_len must be int [Tq]",
    )
    check(valid_len.device == logits.device, "valid_len must be on the logits' device")
    check(logits.shape[1] < 2**31, "N must fit in int32")


def _order_key_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 whose signed order is the float order (-0 folded onto +0)."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    u = x.view(torch.int32)
    return torch.where(u < 0, u ^ 0x7FFFFFFF, u)


def with_local_window(top: torch.Tensor, positions: torch.Tensor, topk: int, window: int) -> torch.Tensor:
    """The selection [T, topk] (ascending, -1 pads) from `top` [T, topk - window], the top of each query's
    keys at positions <= `pos - window` (ascending, -1 pads), and the window: for a query at
    pos >= topk `top` is full (pos + 1 - window > topk - window keys to choose from) and every one of its
    positions is below the window, so the concatenation is ascending; a query at pos < topk selects every
    key 0 .. pos, as the plain top-k does."""
    if not window:
        return top
    T = positions.shape[0]
    assert top.shape == (T, topk - window), (
        f"top {tuple(top.shape)} for {T} queries, top-k {topk} - window {window}"
    )
    pos = positions.to(top.dtype)[:, None]
    ar = torch.arange(topk, device=top.device, dtype=top.dtype)[None]
    row = torch.cat([top, pos - window + 1 + ar[:, :window]], 1)
    return torch.where(pos >= topk, row, torch.where(ar <= pos, ar, -1))


def narrow_selection(sel: torch.Tensor, logits: torch.Tensor, k: int, window: int) -> torch.Tensor:
    """The selection with k in place of K from `sel` [T, K] (this module's selection of `logits` [T, N]
    with a window W: the top K - W of each row's keys before its window, then the window; W = 0: the top
    K), [T, k] int32: the top k - W of each row's selected keys by the same order (value, then the lower
    index), ascending, then its window. Exact for rows with more than K keys before their window: the
    first k - W of a total order lie within its first K - W. Other rows come out undefined (callers keep
    their full selection). A gather and a top-k over K entries, not another pass over the N logits."""
    T, K = sel.shape
    assert logits.shape[0] == T and window < k <= K, (tuple(sel.shape), tuple(logits.shape), k, window)
    far = sel[:, : K - window].long()
    shift = max(logits.shape[1], 1).bit_length()
    vals = logits.gather(1, far.clamp(min=0))
    comp = (_order_key_ref(vals).long() << shift) | ((1 << shift) - 1 - far)
    comp = comp.masked_fill(far < 0, torch.iinfo(torch.int64).min)
    top = far.gather(1, comp.topk(k - window, dim=1, sorted=False).indices).sort(dim=1).values
    return torch.cat([top.to(sel.dtype), sel[:, K - window :]], 1)


def pad_selection(sel: torch.Tensor, width: int) -> torch.Tensor:
    """A selection [..., k] -1 padded to [..., width] (a narrow row in a wider selection's layout)."""
    return torch.cat([sel, sel.new_full((*sel.shape[:-1], width - sel.shape[-1]), -1)], -1)


def with_narrow_rows(
    wide: torch.Tensor, narrow: torch.Tensor, positions: torch.Tensor, start: int
) -> torch.Tensor:
    """`wide` [..., K] with every row whose position (`positions`, broadcast over the rows) is at least
    `start` taken from `narrow` [..., k] instead, -1 padded (`index_topk_long` from
    `index_topk_long_from`: the engine's indexer and the training forward lay rows out alike)."""
    return torch.where((positions >= start)[..., None], pad_selection(narrow, wide.shape[-1]), wide)


def _check_window(logits: torch.Tensor, window: int, positions: torch.Tensor | None) -> None:
    check(isinstance(window, int) and window >= 0, f"window must be a non-negative int, got {window!r}")
    if window:
        check(
            positions is not None and positions.shape == (logits.shape[0],)
            and positions.dtype in (torch.int32, torch.int64) and positions.device == logits.device,
            "positions must be int [Tq] on the logits' device when window > 0",
        )  # fmt: skip


def local_window_bound(positions: torch.Tensor, window: int) -> torch.Tensor:
    """The last key position the index scores choose from, for queries at `positions` (clamped at 0:
    a query that has fewer keys than the top-k keeps all of them, see `with_local_window`)."""
    return (positions - window).clamp(min=0) if window else positions


def _window_composed(
    top: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    k: int,
    valid_len: torch.Tensor | None,
    window: int,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """`with_local_window` of `top`'s (a top-k function of logits, k, valid_len) top k of each query's
    keys before its window (valid_len None) or of valid_len's."""
    assert positions is not None
    lens = local_window_bound(positions, window) + 1 if valid_len is None else valid_len
    return with_local_window(top(logits, k, lens), positions, k + window, window)


def topk_indices_ref(
    logits: torch.Tensor,
    k: int,
    valid_len: torch.Tensor | None,
    window: int = 0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: one torch.topk over an int64 key (value key, then inverted index) per row; with a
    window, `with_local_window` of that (valid_len None: the keys before each window)."""
    _check_window(logits, window, positions)
    if window:
        return _window_composed(_topk_ref, logits, k, valid_len, window, positions)
    check(valid_len is not None, "valid_len is required without a window")
    assert valid_len is not None
    return _topk_ref(logits, k, valid_len)


def _topk_ref(logits: torch.Tensor, k: int, valid_len: torch.Tensor) -> torch.Tensor:
    _check(logits, k, valid_len)
    tq, n = logits.shape
    out = torch.full((tq, k), -1, dtype=torch.int32, device=logits.device)
    kk = min(k, n)
    if tq == 0 or kk == 0:
        return out
    shift = max(n, 1).bit_length()
    idx = torch.arange(n, device=logits.device)
    comp = (_order_key_ref(logits).long() << shift) | ((1 << shift) - 1 - idx)  # ties: lower index wins
    invalid = idx[None, :] >= valid_len[:, None].long()
    comp.masked_fill_(invalid, torch.iinfo(torch.int64).min)
    sel = comp.topk(kk, dim=1, sorted=False).indices
    sel = torch.where(sel >= valid_len[:, None].long(), n, sel)  # picks past valid_len become padding
    sel = sel.sort(dim=1).values
    out[:, :kk] = torch.where(sel == n, -1, sel).int()
    return out


def topk_indices(
    logits: torch.Tensor,
    k: int,
    valid_len: torch.Tensor | None,
    window: int = 0,
    positions: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Indices (int32 [Tq, k], ascending, -1 padded) of the k largest of logits[i, :valid_len[i]]; with
    `window` W > 0, [Tq, k + W]: those followed by the window of each query at `positions` (module doc),
    and `valid_len` None stands for the keys before each window, max(pos - W, 0) + 1 (made in the kernels).

    See the module docstring for the exact tie / NaN / ordering contract.
    """
    _check_window(logits, window, positions)
    check(valid_len is not None or window > 0, "valid_len is required without a window")
    from_pos = window if valid_len is None else 0  # (the kernels make each row's length from its position)
    vlen = positions if valid_len is None else valid_len
    assert vlen is not None
    _check(logits, k, vlen)
    tq, n = logits.shape
    if not use_triton(backend, logits.device) or (window and (tq == 0 or k == 0 or n == 0)):
        return topk_indices_ref(logits, k, valid_len, window, positions)
    if window and not WINDOW_IN_WRITE:
        top = functools.partial(topk_indices, backend=backend)
        return _window_composed(top, logits, k, valid_len, window, positions)
    if tq == 0 or k == 0 or n == 0:
        return torch.full((tq, k), -1, dtype=torch.int32, device=logits.device)
    # No fill of `out`: the write pass stores the -1 padding (and the window) itself (one launch fewer).
    out = torch.empty((tq, k + window), dtype=torch.int32, device=logits.device)
    chunk = 4096 if n >= BIG_CHUNK_FROM else 1024
    nch = (n + chunk - 1) // chunk
    # One zeroed buffer (one memset launch) for the histograms and, per query and level, (prefix of the
    # k-th largest key, how many keys are still needed).
    scratch = torch.zeros(_LEVELS * tq * _NB + tq * _LEVELS * 2, dtype=torch.int32, device=logits.device)
    hist = scratch[: _LEVELS * tq * _NB].view(_LEVELS, tq, _NB)
    state = scratch[_LEVELS * tq * _NB :].view(tq, _LEVELS, 2)
    counts = torch.empty((tq, nch, 2), dtype=torch.int32, device=logits.device)  # (# > T, # == T) per chunk
    grid = (tq, nch)
    common = dict(CHUNK=chunk, NB=_NB, FROM_POS=from_pos, num_warps=8, **pdl(logits.device))
    for level in range(_LEVELS):
        _topk_hist_kernel[grid](logits, logits.stride(0), vlen, hist, state, tq, n, k, LEVEL=level, **common)
    _topk_count_kernel[grid](logits, logits.stride(0), vlen, hist, state, counts, tq, n, k, nch, **common)
    _topk_write_kernel[grid](
        logits, logits.stride(0), vlen, state, counts, out, out.stride(0), n, k, nch,
        positions if window else vlen, CHUNK=chunk, NCHP=next_pow2(nch), WINDOW=window,
        WP=next_pow2(max(window, 1)), FROM_POS=from_pos, num_warps=8, **pdl(logits.device),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- Triton


@jit
def _order_key(x):
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.int32, bitcast=True)
    return tl.where(u < 0, u ^ 0x7FFFFFFF, u)


@jit
def _resolve(hist_row_ptr, krem, NB: tl.constexpr):
    # The bucket holding the krem-th largest key, and how many keys are still needed from it.
    offs = tl.arange(0, NB)
    h = tl.load(hist_row_ptr + offs)
    at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys in buckets >= b
    b = tl.max(tl.where(at_or_above >= krem, offs, -1), axis=0)
    above = tl.sum(tl.where(offs > b, h, 0), axis=0)
    return b, krem - above


@jit
def _level_state(hist_ptr, st_ptr, q, c, Tq, K, LEVEL: tl.constexpr, NB: tl.constexpr):
    # (prefix, k remaining) after resolving radix level LEVEL-1, i.e. the top 8*LEVEL bits of the
    # k-th largest key (signed: key >> (32 - 8*LEVEL)); chunk 0 records it for the later passes.
    if LEVEL == 1:
        prefix = 0
        krem = K
    else:
        prefix = tl.load(st_ptr + (q * 4 + LEVEL - 2) * 2)
        krem = tl.load(st_ptr + (q * 4 + LEVEL - 2) * 2 + 1)
    b, krem = _resolve(hist_ptr + ((LEVEL - 1) * Tq + q) * NB, krem, NB)
    if LEVEL == 1:
        prefix = b - 128
    else:
        prefix = prefix * 256 + b
    if c == 0:
        tl.store(st_ptr + (q * 4 + LEVEL - 1) * 2, prefix)
        tl.store(st_ptr + (q * 4 + LEVEL - 1) * 2 + 1, krem)
    return prefix, krem


@jit
def _row_valid(valid_ptr, q, N, FROM_POS: tl.constexpr):
    # row q's keys to choose from, in [0, N]: valid_len[q], or (FROM_POS > 0, the window W = FROM_POS,
    # valid_ptr the positions) the keys before the window, max(pos - W, 0) + 1
    v = tl.load(valid_ptr + q).to(tl.int32)
    if FROM_POS > 0:
        v = tl.maximum(v - FROM_POS, 0) + 1
    return tl.minimum(tl.maximum(v, 0), N)


@jit
def _topk_hist_kernel(
    x_ptr, stride_x, valid_ptr, hist_ptr, st_ptr, Tq, N, K,
    LEVEL: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr, FROM_POS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    q = tl.program_id(0)
    c = tl.program_id(1)
    valid = _row_valid(valid_ptr, q, N, FROM_POS)
    if valid > K:  # otherwise everything valid is selected and the write pass handles it alone
        offs = c * CHUNK + tl.arange(0, CHUNK)
        inr = offs < valid
        ks = _order_key(tl.load(x_ptr + q.to(tl.int64) * stride_x + offs, mask=inr, other=0.0))
        if LEVEL == 0:
            part = inr
            d = (ks >> 24) + 128
        else:
            prefix, krem = _level_state(hist_ptr, st_ptr, q, c, Tq, K, LEVEL, NB)
            part = inr & ((ks >> (32 - 8 * LEVEL)) == prefix)
            d = (ks >> (24 - 8 * LEVEL)) & 255
        # tl.histogram has no mask on older triton: count outsiders in bin 0, then take them out
        d = tl.where(part, d, 0)
        h = tl.histogram(d, NB)
        nout = CHUNK - tl.sum(part.to(tl.int32), axis=0)
        bins = tl.arange(0, NB)
        h = h - tl.where(bins == 0, nout, 0)
        tl.atomic_add(hist_ptr + (LEVEL * Tq + q) * NB + bins, h, mask=h > 0)


@jit
def _topk_count_kernel(
    x_ptr, stride_x, valid_ptr, hist_ptr, st_ptr, cnt_ptr, Tq, N, K, NCH,
    CHUNK: tl.constexpr, NB: tl.constexpr, FROM_POS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    q = tl.program_id(0)
    c = tl.program_id(1)
    valid = _row_valid(valid_ptr, q, N, FROM_POS)
    if valid > K:
        thr, krem = _level_state(hist_ptr, st_ptr, q, c, Tq, K, 4, NB)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        inr = offs < valid
        ks = _order_key(tl.load(x_ptr + q.to(tl.int64) * stride_x + offs, mask=inr, other=0.0))
        n_gt = tl.sum((inr & (ks > thr)).to(tl.int32), axis=0)
        n_eq = tl.sum((inr & (ks == thr)).to(tl.int32), axis=0)
        tl.store(cnt_ptr + (q * NCH + c) * 2, n_gt)
        tl.store(cnt_ptr + (q * NCH + c) * 2 + 1, n_eq)


@jit
def _topk_write_kernel(
    x_ptr, stride_x, valid_ptr, st_ptr, cnt_ptr, out_ptr, stride_o, N, K, NCH, pos_ptr,
    CHUNK: tl.constexpr, NCHP: tl.constexpr, WINDOW: tl.constexpr, WP: tl.constexpr, FROM_POS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    q = tl.program_id(0)
    c = tl.program_id(1)
    valid = _row_valid(valid_ptr, q, N, FROM_POS)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inr = offs < valid
    orow = out_ptr + q.to(tl.int64) * stride_o
    if WINDOW > 0:
        pos = tl.load(pos_ptr + q).to(tl.int32)
        if pos < K + WINDOW:  # at most k + W keys: every key 0 .. pos, then -1 (`with_local_window`)
            for p0 in range(c * CHUNK, K + WINDOW, NCH * CHUNK):
                pp = p0 + tl.arange(0, CHUNK)
                tl.store(orow + pp, tl.where(pp <= pos, pp, -1), mask=pp < K + WINDOW)
        else:
            _topk_write_top(
                x_ptr, stride_x, st_ptr, cnt_ptr, orow, q, c, valid, offs, inr, K, NCH, CHUNK, NCHP
            )
            if c == 0:  # the window after the top k: pos - W + 1 .. pos
                w = tl.arange(0, WP)
                tl.store(orow + K + w, pos - WINDOW + 1 + w, mask=w < WINDOW)
    else:
        _topk_write_top(x_ptr, stride_x, st_ptr, cnt_ptr, orow, q, c, valid, offs, inr, K, NCH, CHUNK, NCHP)


@jit
def _topk_write_top(
    x_ptr, stride_x, st_ptr, cnt_ptr, orow, q, c, valid, offs, inr, K, NCH,
    CHUNK: tl.constexpr, NCHP: tl.constexpr,
):  # fmt: skip
    # the top k of row q into orow[0, k): this program's chunk c of the selected keys, ascending
    if valid > K:
        thr = tl.load(st_ptr + (q * 4 + 3) * 2)
        r = tl.load(st_ptr + (q * 4 + 3) * 2 + 1)  # how many keys == thr to take, lowest index first
        ch = tl.arange(0, NCHP)
        cm = ch < NCH
        gtc = tl.load(cnt_ptr + (q * NCH + ch) * 2, mask=cm, other=0)
        eqc = tl.load(cnt_ptr + (q * NCH + ch) * 2 + 1, mask=cm, other=0)
        eq_before = tl.cumsum(eqc, axis=0) - eqc
        selc = gtc + tl.minimum(tl.maximum(r - eq_before, 0), eqc)
        base = tl.sum(tl.where(ch < c, selc, 0), axis=0)
        my_eq_before = tl.sum(tl.where(ch < c, eqc, 0), axis=0)
        ks = _order_key(tl.load(x_ptr + q.to(tl.int64) * stride_x + offs, mask=inr, other=0.0))
        eq = (inr & (ks == thr)).to(tl.int32)
        eq_rank = my_eq_before + tl.cumsum(eq, axis=0) - eq
        sel = (inr & (ks > thr)) | ((eq > 0) & (eq_rank < r))
        seli = sel.to(tl.int32)
        pos = base + tl.cumsum(seli, axis=0) - seli
        tl.store(orow + pos, offs, mask=sel)
    else:
        tl.store(orow + offs, offs, mask=inr)
        # Fewer than k valid keys: positions [valid, K) are -1 padding (the wrapper does not pre-fill).
        # Program c pads [c*CHUNK, +CHUNK), then every NCH*CHUNK further (K may exceed N).
        for p0 in range(c * CHUNK, K, NCH * CHUNK):
            pp = p0 + tl.arange(0, CHUNK)
            tl.store(orow + pp, tl.full([CHUNK], -1, tl.int32), mask=(pp >= valid) & (pp < K))
