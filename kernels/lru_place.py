"""HiSparse LRU placement: make requested token positions resident in per (row, layer) slot tables.

`lru_place(...)` does one whole placement of `HiSparseKVCache` (`longctx.hisparse.cache`) for B
batch rows x L layers: dedupe the requested positions, look up hits and touch their stamps, pick
LRU victims for the misses, evict and insert, and return what the caller copies. `lru_place_ref`
is the torch reference (the CPU path, and the specification the Triton kernel matches bit for bit).

Tables (flat views of the cache's [blocks, layers, row] tensors; each (row, layer) is addressed by
its offsets `p_at` / `s_at` into them):
- `p2s` int32: position -> slot (-1 absent); row length P, column P - 1 a sink for masked writes.
- `s2p` int64: slot -> position (-1 free); `stamp` int64: the step a slot was last used (-1
  never); row length N + 1, column N a sink.
The reference writes the sinks (masked-off index_put targets); the kernel never touches them, so
the two agree on every column except the sinks (which nothing reads).

Policy (`longctx.hisparse.lru.SlotLRU`): each slot's LRU key is its stamp, except that slots
touched this step (stamp == now, hits included) and slots holding a position >= `newest_from[b]`
may not be evicted. The misses, in ascending position order, take the evictable slots in
ascending (key, slot index) order: free slots (stamp -1) first, then the oldest. Misses beyond
the evictable count overflow (not placed).

All-hit pass (`_place_hits_kernel`, non-forced placements of >= 2 * HIT_CHUNK positions by
default): grid (row, layer, chunk of HIT_CHUNK sorted positions). Every program reads the whole
row and its p2s entries (the pass writes no p2s, so all of a (row, layer)'s programs decide
alike); if nothing misses and the row is ascending apart from -1s, each program touches its
chunk's hit stamps and writes its chunk of the outputs (and of the compacted copies, counters by
atomics), and the full kernel below returns at once for that (row, layer); otherwise the pass
writes only that flag and the full kernel does everything. A decode step's top-k mostly hits, and
one program per (row, layer) spent ~23 us on the H200 even then.

Full kernel: one program per (row, layer), one launch per placement. It never sorts the N
slots: after the requested positions are sorted (free when they come ascending with -1 padding
anywhere, as top-k and the newest tokens do; a bitonic `tl.sort` of the M positions otherwise)
and looked up, the R = min(misses, evictable) victims are found by a radix select over the keys:
one pass over the slots counts the evictable and free ones and the range of the other keys, 8-bit
histogram passes over (key - min key) find the R-th smallest key T (usually one pass: the
evictable stamps of a full buffer span few steps), and a last pass compacts the victims (keys < T
and the lowest-index keys == T) in slot order. That list is already in (key, index) order unless
it mixes several keys; then its <= M entries are sorted by (key + 1) << IB | index (exact while
stamps stay below 2^(63 - IB), i.e. for any realistic step count). It also writes the copies
compacted per (row, layer) (`csrc`, `cdst`, `cnt`), so the swap-in reads no mask and sorts
nothing, and adds the hit / miss / forced-copy counts to `acc` with atomics (with `row_bytes`, also the
misses' and forced copies' bytes, each layer's rows at its own size).

Parallel passes (`parallel`, by default from `PAR_MIN_BLOCKS` slot blocks): those passes are loops
of one program, so at N = 104,857 (the 1M request's 10% cap) a placement took 208 us on the H200
(13,106: 44.5 us in a 128K decode profile, six placements a step). Three launches with one program
per (row, layer, block of BLOCK_N slots) do steps 2-4 instead (a zeroed workspace beside them):
`_par_pass_kernel` phase 0 touches its block's hits, counts the evictable / free keys with atomics
and adds its block to a histogram of the keys' high radix digit
(keys as d = key - (now - 2^(2 DB)), DB = `digit_bits`, so no pass for the key range is needed;
block 0 counts the misses); phase 1 picks that digit's bin (every program alike) and histograms the
low digit inside it, keeping each block's running histogram and its count below the bin; phase 2
picks T and the ties to take, and each block writes its victims where the blocks before it end
(their counts from the per-block figures), so the full kernel reads a list already in slot order. A
key older than 2^(2 DB) steps sends its (row, layer) to the full kernel's own select. Where nothing
misses, phase 0 only touches the hits and every later step finds R = 0.

Candidates (`lru_candidates`, then `lru_place(..., cand=...)`): a decode step places each (row, layer)
twice, its newest tokens and then its top-k. A placement's victims are the R smallest (key, slot) of
the slots evictable then, which are the slots evictable at the step's start less those the step's
placements touched so far (their stamp is the clock). So the C smallest evictable slots of every
(row, layer) of the stage, found in ONE launch at the start of the step (`_lru_candidates_kernel`:
the one-program select for C, then a sort by (key, slot); from PAR_MIN_BLOCKS slot blocks the
parallel passes do the select first, `FIXED`), hold every victim of both placements
whenever C >= their distinct positions together (at most recent + top-k): each placement drops the
candidates already touched and takes the first R of the rest, in order, exactly what the select
would have found. The per-layer placements then make no pass over the N slots at all, and the
passes that remain run for all layers at once, side by side, instead of six times in a row.

Kept candidates (`lru_candidates(..., keep=CandKeep)`, not with the parallel passes): the select is
a latency-bound loop over the N slots (~48 us a step at 13,106 slots on the H200) whose answer
changes little from one step to the next, so each (block, layer) keeps the KC = 4 x C smallest
(key, slot) it found with their keys, the `newest_from` it was made at and its last entry (the
bound). A later step reuses it when it is still exact: the entries whose stamp still equals the kept
key (untouched since: every placement stamps what it touches with the clock, which only grows) are
then the smallest evictable slots in the same order, because every other evictable slot either was
past the bound when the list was made and is untouched, or was touched since (key >= that step's
clock > the bound), or became evictable since by `newest_from` moving on (checked: the slots of the
positions in [kept newest_from, newest_from), at most NF_WINDOW of them, must come after the bound).
It is reused while at least C entries are left and none of that fails; else that (block, layer)
selects again. A list that held every evictable slot (fewer than KC) has no bound: anything newly
evictable makes it select again. The caller invalidates a block's lists when it resets the block.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch

from .common import check, jit, next_pow2, tl, triton, use_triton

_BIG = 1 << 62  # LRU key of slots that may not be evicted this step
MAX_M = 4096  # the kernel's limit on requested positions per row (larger: the reference)
HIT_CHUNK = 256  # positions per program of the all-hit pass
# slot keys per iteration of the full kernel's passes over N (a decode placement has only B x L
# programs, so each pass is a latency-bound loop: wider steps mean fewer of them; was 1024)
BLOCK_N = 2048
# the parallel passes (one program per (row, layer, block of BLOCK_N slots), four launches) from this
# many blocks on. H200, top-256 at hit rate 0.78, kernel time replayed from a graph (bench.place_bench,
# thirteenth session): 13,107 slots (7 blocks) one program 50 us, parallel 59 us; 104,857 slots
# (52 blocks) 208 us against 39 us. The one program grows ~3.5 us a block, so the two cross near
# 9-10 blocks (interpolated from those two sizes, not measured between them)
PAR_MIN_BLOCKS = 12
# the same switch for the candidates (`lru_candidates`), which select for every layer of the step at once:
# its one program per (row, layer) took 47.6 us a step at 13,107 slots (7 blocks) in the fifteenth
# session's 128K profile, a latency-bound loop that the parallel passes' three launches of B x L x blocks
# programs might beat at fewer blocks; they do not (bench.place_bench, sixteenth session, H200, graph
# replay at 13,107 slots: one program 54.0 / 86.8 us for 1 / 6 layers at 0.78 hits, parallel 57.9 /
# 92.6; at 104,857 slots the two tie, 41-171 us), so the threshold stays the placements'
CAND_PAR_MIN_BLOCKS = PAR_MIN_BLOCKS
# LONGCTX_PLACE_PARALLEL=0 keeps the one-program select for a process (A/B benches, or a GPU where the
# parallel passes failed bench.gpu_kernel_check)
PARALLEL_DEFAULT = os.environ.get("LONGCTX_PLACE_PARALLEL", "1").strip() != "0"
DIGIT_BITS = 11  # the parallel select's two radix digits: keys within 2^22 steps of now (else serial)
# kept candidates (module doc): a kept list holds KEEP_FACTOR x the candidates a step asks for, and is
# reused while `newest_from` moved on by at most NF_WINDOW positions since it was made
KEEP_FACTOR = 4
NF_WINDOW = 256


def _select_warps(block_n: int) -> int:
    """Warps of a kernel whose one program walks the slots BLOCK_N at a time: 16 from 4,096 on (sm_90,
    by ptxas: the candidates kernel at 4,096 / 8,192 keys a step takes 148 / 232 registers with 8 warps,
    115 / 128 with 16, never spilling; the full kernel 215 / 248 against 109 / 127)."""
    return 16 if block_n >= 4096 else 8


class Placement(NamedTuple):
    """What one placement decided for positions `u` of rows [B] in each of its layers [L]."""

    u: torch.Tensor  # [B, M] int64 the requested positions, ascending per row (-1 = none)
    src: torch.Tensor  # [B, M] int64 their host-pool rows (position 0's for -1)
    dst: torch.Tensor  # [B, L, M] int64 their slot-buffer rows (meaningful where copy)
    copy: torch.Tensor  # [B, L, M] bool: copy host row src there
    overflow: torch.Tensor  # [B, L, M] bool: a miss that found no evictable slot
    csrc: torch.Tensor | None  # [B, L, M] int64: src of the copies, compacted (first cnt valid)
    cdst: torch.Tensor | None  # [B, L, M] int64: dst of the copies, compacted
    cnt: torch.Tensor | None  # [B, L] int64 copies per (row, layer)


def _check(
    p2s: torch.Tensor, s2p: torch.Tensor, stamp: torch.Tensor, now: torch.Tensor, pos: torch.Tensor,
    p_at: torch.Tensor, s_at: torch.Tensor, base: torch.Tensor, newest_from: torch.Tensor,
    table: torch.Tensor, acc: torch.Tensor, valid: torch.Tensor | None, below: torch.Tensor | None,
) -> None:  # fmt: skip
    check(p2s.dim() == 1 and p2s.dtype == torch.int32, "p2s must be flat int32")
    for name, t in (("s2p", s2p), ("stamp", stamp)):
        check(t.dim() == 1 and t.dtype == torch.int64, f"{name} must be flat int64")
    check(now.dim() == 0 and now.dtype == torch.int64, "now must be a 0-d int64 tensor")
    check(
        pos.dim() == 2 and pos.dtype in (torch.int32, torch.int64) and pos.is_contiguous(),
        "pos must be int32 / int64 [B, M]",
    )
    B = pos.shape[0]
    check(
        p_at.shape == s_at.shape and p_at.dim() == 2 and p_at.shape[0] == B
        and p_at.stride() == s_at.stride() and p_at.dtype == s_at.dtype == torch.int64,
        "p_at / s_at must be int64 [B, L] with equal strides",
    )  # fmt: skip
    for name, t in (("base", base), ("newest_from", newest_from)):
        check(t.shape == (B,) and t.dtype == torch.int64 and t.is_contiguous(), f"{name} must be int64 [B]")
    check(table.dim() == 2 and table.shape[0] == B and table.dtype == torch.int32, "table: int32 [B, pages]")
    check(table.stride(1) == 1, "page table rows must be contiguous")
    check(acc.dtype == torch.int64 and acc.numel() >= 3 and acc.is_contiguous(), "acc: int64 [>= 3]")
    check(valid is None or (valid.shape == (B,) and valid.dtype == torch.bool), "valid: bool [B]")
    check(
        below is None or (below.shape == (B,) and below.dtype == torch.int64 and below.is_contiguous()),
        "below: int64 [B]",
    )
    devs = {t.device for t in (p2s, s2p, stamp, now, pos, p_at, base, newest_from, table, acc)}
    check(len(devs) == 1, "all tensors must be on one device")


def _keys_ref(
    s2p: torch.Tensor, stamp: torch.Tensor, now: torch.Tensor, s_at: torch.Tensor, newest_from: torch.Tensor,
    N: int,
) -> torch.Tensor:  # fmt: skip
    """The LRU keys [B, L, N] of every (row, layer)'s slots: the stamp (free slots -1), or _BIG where
    the slot holds one of the row's newest positions or was touched at `now`."""
    cols = torch.arange(N, device=s_at.device)
    s2p_n, stamp_n = s2p[s_at[:, :, None] + cols], stamp[s_at[:, :, None] + cols]
    return torch.where((s2p_n >= newest_from[:, None, None]) | (stamp_n == now), _BIG, stamp_n)


def lru_place_ref(
    p2s: torch.Tensor,
    s2p: torch.Tensor,
    stamp: torch.Tensor,
    now: torch.Tensor,
    pos: torch.Tensor,
    p_at: torch.Tensor,
    s_at: torch.Tensor,
    base: torch.Tensor,
    newest_from: torch.Tensor,
    table: torch.Tensor,
    acc: torch.Tensor,
    *,
    n_slots: int,
    pos_len: int,
    page_size: int,
    force: bool,
    minus1: torch.Tensor,
    row_bytes: torch.Tensor | None = None,
) -> Placement:
    """Reference (sort / cumsum / scatter over all rows and layers at once; see module doc).

    p2s / s2p / stamp: the flat tables (updated in place); now: the step clock (0-d int64);
    pos: int64 [B, M] requested positions (-1 = none, duplicates allowed); p_at / s_at: int64
    [B, L] each (row, layer)'s offset in p2s / in s2p and stamp; base: int64 [B] first
    slot-buffer row of each row's block; newest_from: int64 [B]; table: int32 [B, pages] page
    table rows; acc: int64 counters (acc[0] hits, acc[1] misses, or acc[2] forced copies; with
    row_bytes, int64 [L] the bytes of a row of each layer, also acc[5] the misses' bytes or acc[6] the
    forced copies' bytes);
    n_slots: N; pos_len: P (p2s row length); force: copy resident positions too; minus1: an int32
    -1 on the device (index_put_ of a Python number on CUDA would copy it from the host).
    """
    N, P = n_slots, pos_len
    u = torch.sort(pos, dim=1).values
    first = torch.ones_like(u, dtype=torch.bool)
    first[:, 1:] = u[:, 1:] != u[:, :-1]
    m = (first & (u >= 0))[:, None, :]  # [B, 1, M]
    uc = u.clamp(min=0)[:, None, :]
    bp, bs = p_at[:, :, None], s_at[:, :, None]  # [B, L, 1]
    slot = p2s[bp + uc].long()  # [B, L, M]
    res = m & (slot >= 0)
    stamp[bs + torch.where(res, slot, N)] = now  # touch hits; they may not be evicted this step
    need = m & (slot < 0)
    key = _keys_ref(s2p, stamp, now, s_at, newest_from, N)
    order = torch.argsort(key, dim=-1, stable=True)  # free slots (stamp -1) first, then LRU
    cap = (key < _BIG).sum(-1, keepdim=True)
    rank = torch.cumsum(need.long(), -1) - 1
    placed = need & (rank < cap)
    vslot = torch.where(placed, order.gather(-1, rank.clamp(0, N - 1)), N)
    sv = bs + vslot
    old = s2p[sv]
    p2s[bp + torch.where(placed & (old >= 0), old, P - 1)] = minus1  # evict
    s2p[sv] = u[:, None, :].expand_as(vslot)
    p2s[bp + torch.where(placed, uc, P - 1)] = vslot.to(torch.int32)
    stamp[sv] = now
    copy = placed | (res & force)
    dst = base[:, None, None] + torch.where(placed, vslot, slot)
    if force:
        acc[2] += copy.sum()
        if row_bytes is not None:
            acc[6] += (copy.sum((0, 2)) * row_bytes).sum()
    else:
        acc[0] += res.sum()
        acc[1] += need.sum()
        if row_bytes is not None:
            acc[5] += (need.sum((0, 2)) * row_bytes).sum()
    ps = page_size
    uc0 = u.clamp(min=0)
    src = table.gather(1, uc0 // ps).long() * ps + uc0 % ps
    return Placement(u, src, dst, copy, need & ~placed, None, None, None)


class CandKeep(NamedTuple):
    """Kept victim candidates of every (block, layer) plane of the tables (`cand_keep`; module doc)."""

    slots: torch.Tensor  # int64 [planes, KC] the kept (key, slot)-ordered slots (-1 past the end)
    keys: torch.Tensor  # int64 [planes, KC] their keys when kept
    meta: torch.Tensor  # int64 [planes, 3] newest_from when kept (-1: nothing kept), bound key, bound slot
    p2s: torch.Tensor  # the flat pos2slot table (the newly evictable positions' slots)
    p_at: torch.Tensor  # int64 [B, L] each (row, layer)'s offset in it


def cand_keep_width(count: int) -> int:
    """KC, the kept candidates of a (block, layer) whose steps ask for `count`."""
    return min(MAX_M, KEEP_FACTOR * next_pow2(count))


def cand_keep_buffers(planes: int, count: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Kept-candidate buffers (slots, keys, meta with nothing kept) for `planes` (block, layer) planes
    of a cache whose steps ask for `count` candidates (`cand_keep_width`)."""
    kc = cand_keep_width(count)
    slots = torch.full((planes, kc), -1, dtype=torch.int64, device=device)
    meta = torch.full((planes, 3), -1, dtype=torch.int64, device=device)
    return slots, torch.zeros_like(slots), meta


def candidates_parallel(n_slots: int, block_n: int = BLOCK_N) -> bool:
    """Whether `lru_candidates` (parallel=None) selects over `n_slots` slots by the parallel passes
    (from CAND_PAR_MIN_BLOCKS slot blocks on, unless LONGCTX_PLACE_PARALLEL=0), where it keeps nothing."""
    return PARALLEL_DEFAULT and triton.cdiv(n_slots, block_n) >= CAND_PAR_MIN_BLOCKS


def lru_candidates_ref(
    s2p: torch.Tensor, stamp: torch.Tensor, now: torch.Tensor, s_at: torch.Tensor, newest_from: torch.Tensor,
    *, n_slots: int, count: int,
) -> torch.Tensor:  # fmt: skip
    """Reference: int64 [B, L, count], each (row, layer)'s `count` smallest (key, slot) evictable slots
    in that order (keys as the placement's: the stamp, free slots -1; slots holding a position >=
    newest_from[b] or touched at `now` are not evictable), -1 where fewer are evictable."""
    N = n_slots
    key = _keys_ref(s2p, stamp, now, s_at, newest_from, N)
    order = torch.argsort(key, dim=-1, stable=True)[..., :count]
    out = torch.where(key.gather(-1, order) < _BIG, order, -1)
    if count > N:
        out = torch.cat([out, out.new_full((*out.shape[:2], count - N), -1)], dim=-1)
    return out


def lru_candidates(
    s2p: torch.Tensor,
    stamp: torch.Tensor,
    now: torch.Tensor,
    s_at: torch.Tensor,
    newest_from: torch.Tensor,
    *,
    n_slots: int,
    count: int,
    backend: str = "auto",
    block_n: int = BLOCK_N,
    parallel: bool | None = None,
    digit_bits: int = DIGIT_BITS,
    keep: CandKeep | None = None,
) -> torch.Tensor:
    """The victim candidates of a decode step's placements (module doc; `lru_candidates_ref`):
    int64 [B, L, count], one launch for all B x L (row, layer)s (parallel: the select's passes over
    the slots as `lru_place`'s parallel passes, three launches more; None: from CAND_PAR_MIN_BLOCKS
    slot blocks, unless LONGCTX_PLACE_PARALLEL=0). Call it after the step's clock tick and before the step's placements of those
    (row, layer)s, which take them through `lru_place(..., cand=...)`. No host sync, no
    data-dependent shape (CUDA-graph safe). keep: each (block, layer)'s kept candidates (module doc),
    reused where still exact and made again elsewhere (not with the parallel passes; ignored by the
    reference, which gives the same result)."""
    check(s2p.dim() == 1 and stamp.dim() == 1 and s2p.dtype == stamp.dtype == torch.int64, "s2p / stamp")
    check(now.dim() == 0 and now.dtype == torch.int64, "now must be a 0-d int64 tensor")
    check(s_at.dim() == 2 and s_at.dtype == torch.int64, "s_at must be int64 [B, L]")
    B, L = s_at.shape
    check(newest_from.shape == (B,) and newest_from.dtype == torch.int64, "newest_from must be int64 [B]")
    check(count >= 1 and block_n == next_pow2(block_n), "count >= 1; block_n a power of two")
    if not use_triton(backend, s_at.device) or count > MAX_M or B * L == 0:
        return lru_candidates_ref(s2p, stamp, now, s_at, newest_from, n_slots=n_slots, count=count)
    dev = s_at.device
    nf = newest_from.contiguous()
    out = torch.empty((B, L, count), dtype=torch.int64, device=dev)
    n_blk = triton.cdiv(n_slots, block_n)
    if parallel is None:
        parallel = candidates_parallel(n_slots, block_n)
    kept = keep is not None and not parallel
    kc = 1
    if keep is not None:
        kc = keep.slots.shape[1]
        check(
            keep.slots.shape == keep.keys.shape and keep.meta.shape == (keep.slots.shape[0], 3)
            and keep.slots.dtype == keep.keys.dtype == keep.meta.dtype == torch.int64
            and keep.slots.is_contiguous() and keep.keys.is_contiguous() and keep.meta.is_contiguous()
            and count <= kc <= MAX_M,
            "keep: int64 slots / keys [planes, KC >= count], meta [planes, 3]",
        )  # fmt: skip
        check(keep.p_at.shape == (B, L) and keep.p_at.dtype == torch.int64, "keep.p_at: int64 [B, L]")
        check(keep.p2s.dim() == 1 and keep.p2s.dtype == torch.int32, "keep.p2s must be flat int32")
    k = keep if keep is not None and kept else CandKeep(out, out, out, s2p, s_at)  # (unused without keeping)
    block_c = max(16, next_pow2(max(count, kc if kept else 1)))
    scratch = torch.empty((B * L, 3, block_c), dtype=torch.int64, device=dev)
    ws, ws_n = _par_workspace(B * L, digit_bits, parallel, out)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if parallel:  # no requested positions (FIXED): their pointers are placeholders
            lead = (s_at, count, s_at, s_at, s2p, s2p, stamp, now, s_at, s_at, *s_at.stride(), nf)
            _par_passes(
                lead, B, L, n_slots, n_blk, scratch, out, ws, block_m=block_c, block_n=block_n,
                digit_bits=digit_bits, SPLIT=False, HAS_VALID=False, HAS_BELOW=False, FIXED=True,
            )  # fmt: skip
        _lru_candidates_kernel[(B, L)](
            s2p, stamp, now, s_at, s_at.stride(0), s_at.stride(1), nf, n_slots, L, count, out, scratch, ws,
            k.slots, k.keys, k.meta, k.p2s, k.p_at, k.p_at.stride(0), k.p_at.stride(1), kc,
            IB=max(1, (n_slots - 1).bit_length()), BLOCK_C=block_c, BLOCK_N=block_n, NB=256, PAR=parallel,
            WS=ws_n, KEEP=kept, NFW=NF_WINDOW, num_warps=_select_warps(block_n),
        )  # fmt: skip
    return out


def lru_place(
    p2s: torch.Tensor,
    s2p: torch.Tensor,
    stamp: torch.Tensor,
    now: torch.Tensor,
    pos: torch.Tensor,
    p_at: torch.Tensor,
    s_at: torch.Tensor,
    base: torch.Tensor,
    newest_from: torch.Tensor,
    table: torch.Tensor,
    acc: torch.Tensor,
    *,
    n_slots: int,
    pos_len: int,
    page_size: int,
    force: bool,
    minus1: torch.Tensor,
    backend: str = "auto",
    hit_chunk: int | None = None,
    block_n: int = BLOCK_N,
    valid: torch.Tensor | None = None,
    below: torch.Tensor | None = None,
    parallel: bool | None = None,
    digit_bits: int = DIGIT_BITS,
    cand: torch.Tensor | None = None,
    row_bytes: torch.Tensor | None = None,
) -> Placement:
    """One placement (arguments as `lru_place_ref`). The Triton path (M <= MAX_M) gives the same
    u / src / dst / copy / overflow and tables (sinks aside) plus the compacted copies; it makes no
    host sync and has no data-dependent shape (CUDA-graph safe). Asynchronous on CUDA.

    valid (bool [B], False: the row requests nothing) and below (int64 [B]: positions >= below[b]
    are not requested) mask `pos` on the fly; pos may be int32 there.
    hit_chunk: positions per program of the hit pass (a power of two; 0: no hit pass; None:
    `HIT_CHUNK` for non-forced placements of at least 2 * HIT_CHUNK positions, else 0). block_n:
    slot keys per iteration of the full kernel's passes over the N slots (a power of two).
    parallel: the victim selection's passes over the slots in one program per block of block_n
    slots (three launches) instead of the full kernel's loops (None: from `PAR_MIN_BLOCKS` blocks
    unless LONGCTX_PLACE_PARALLEL=0);
    digit_bits: its radix digit (two of them: keys older than 2^(2 digit_bits) steps send a
    (row, layer) back to the full kernel's own select).
    cand: int64 [B, L, C] (a view with unit last stride), `lru_candidates` of these (row, layer)s made
    this step (after the clock's tick) before any placement of them, with C >= the distinct positions
    of all the placements that use it (the step's newest tokens and its top-k): the victims are taken
    from it (no pass over the slots, no parallel passes). Ignored by the reference path, which finds
    the same victims."""
    _check(p2s, s2p, stamp, now, pos, p_at, s_at, base, newest_from, table, acc, valid, below)
    B, M = pos.shape
    L = p_at.shape[1]
    if row_bytes is not None:
        check(
            row_bytes.shape == (L,) and row_bytes.dtype == torch.int64 and row_bytes.is_contiguous()
            and row_bytes.device == pos.device and acc.numel() >= 7,
            "row_bytes: int64 [L] on the device, with acc int64 [>= 7]",
        )  # fmt: skip
    if not use_triton(backend, pos.device) or M > MAX_M or B * L == 0 or M == 0:
        pos = pos.long()
        if below is not None:
            pos = torch.where(pos < below[:, None], pos, -1)
        if valid is not None:
            pos = torch.where(valid[:, None], pos, -1)
        return lru_place_ref(
            p2s, s2p, stamp, now, pos, p_at, s_at, base, newest_from, table, acc,
            n_slots=n_slots, pos_len=pos_len, page_size=page_size, force=force, minus1=minus1,
            row_bytes=row_bytes,
        )  # fmt: skip
    dev = pos.device
    rb = row_bytes if row_bytes is not None else acc  # (an unused pointer without it)
    u = torch.empty((B, M), dtype=torch.int64, device=dev)
    src = torch.empty((B, M), dtype=torch.int64, device=dev)
    # one allocation for the [B, L, M] int64 outputs, one for the bool ones
    i64 = torch.empty((3, B, L, M), dtype=torch.int64, device=dev)
    b8 = torch.empty((2, B, L, M), dtype=torch.bool, device=dev)
    cnt = torch.empty((B, L), dtype=torch.int64, device=dev)
    block_m = max(16, next_pow2(M))
    scratch = torch.empty((B * L, 3, block_m), dtype=torch.int64, device=dev)
    ib = max(1, (n_slots - 1).bit_length())
    if hit_chunk is None:  # the newest tokens (force, few) always miss somewhere: no hit pass
        hit_chunk = HIT_CHUNK if (not force and M >= 2 * HIT_CHUNK) else 0
    split = 0 < hit_chunk < block_m
    # split: the hit pass decides per (row, layer) and the full placement returns where it was done
    slow = torch.empty((B, L), dtype=torch.int32, device=dev) if split else cnt
    vb = valid if valid is not None else pos  # (unused pointers where absent)
    lim = below if below is not None else pos
    n_blk = triton.cdiv(n_slots, block_n)
    if cand is not None:
        check(
            cand.dim() == 3 and cand.shape[:2] == (B, L) and cand.shape[2] >= M
            and cand.dtype == torch.int64 and cand.stride(2) == 1 and cand.device == dev,
            "cand: int64 [B, L, C >= M] victim candidates",
        )  # fmt: skip
        parallel = False
    elif parallel is None:
        parallel = PARALLEL_DEFAULT and n_blk >= PAR_MIN_BLOCKS
    check(
        block_n == next_pow2(block_n) and 1 <= digit_bits <= 15,
        "block_n: a power of two; 1 <= digit_bits <= 15",
    )
    ws, ws_n = _par_workspace(B * L, digit_bits, parallel, cnt)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if split:
            check(hit_chunk == next_pow2(hit_chunk), "hit_chunk must be a power of two")
            n_ch = triton.cdiv(M, hit_chunk)
            hscr = torch.empty((B * L * n_ch, 2 * hit_chunk), dtype=torch.int64, device=dev)
            _place_hits_kernel[(B, L, n_ch)](
                pos, M, vb, lim, p2s, stamp, now, p_at, s_at, p_at.stride(0), p_at.stride(1), base, table,
                table.stride(0), acc, rb, L, u, src, i64[0], b8[0], b8[1], i64[1], i64[2], cnt, slow, hscr,
                PAGE=page_size, FORCE=force, BLOCK_M=block_m, CH=hit_chunk, HAS_VALID=valid is not None,
                HAS_BELOW=below is not None, BYTES=row_bytes is not None, num_warps=8,
            )  # fmt: skip
        if parallel:
            lead = (pos, M, vb, lim, p2s, s2p, stamp, now, p_at, s_at, *p_at.stride(), newest_from)
            _par_passes(
                lead, B, L, n_slots, n_blk, scratch, slow, ws, block_m=block_m, block_n=block_n,
                digit_bits=digit_bits, SPLIT=split, HAS_VALID=valid is not None, HAS_BELOW=below is not None,
            )  # fmt: skip
        cw = cand if cand is not None else s_at  # (an unused pointer without candidates)
        c_n = cand.shape[2] if cand is not None else 1
        _lru_place_kernel[(B, L)](
            pos, M, vb, lim, p2s, s2p, stamp, now, p_at, s_at, p_at.stride(0), p_at.stride(1), base,
            newest_from, table, table.stride(0), acc, rb, n_slots, L,
            u, src, i64[0], b8[0], b8[1], i64[1], i64[2], cnt, scratch, slow, ws,
            cw, cw.stride(0), cw.stride(1), c_n,
            PAGE=page_size, FORCE=force, IB=ib, BLOCK_M=block_m, BLOCK_N=block_n, NB=256, SPLIT=split,
            PAR=parallel, WS=ws_n, HAS_VALID=valid is not None, HAS_BELOW=below is not None,
            CAND=cand is not None, BLOCK_C=max(16, next_pow2(c_n)), BYTES=row_bytes is not None,
            num_warps=_select_warps(block_n),
        )  # fmt: skip
    return Placement(u, src, i64[0], b8[0], b8[1], i64[1], i64[2], cnt)


def _par_workspace(
    rows: int, digit_bits: int, parallel: bool, unused: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The parallel passes' zeroed int32 workspace [rows, WS] and WS (counts, then the two digits'
    histograms); `unused` (a placeholder pointer) where there are no parallel passes."""
    ws_n = _WS_HIST + 2 * (1 << digit_bits)
    ws = torch.zeros((rows, ws_n), dtype=torch.int32, device=unused.device) if parallel else unused
    return ws, ws_n


def _par_passes(
    lead: tuple, B: int, L: int, n_slots: int, n_blk: int, scratch: torch.Tensor, slow: torch.Tensor,
    ws: torch.Tensor, *, block_m: int, block_n: int, digit_bits: int, **flags: bool,
) -> None:  # fmt: skip
    """The parallel passes' three launches (scan, low digit, compaction) over grid (B, L, n_blk):
    `lead` the kernel's arguments up to newest_from, `flags` its SPLIT / HAS_VALID / HAS_BELOW
    (/ FIXED) constexprs."""
    dev, nb = ws.device, 1 << digit_bits
    pc = torch.empty((B * L, n_blk, 2), dtype=torch.int32, device=dev)
    cum = torch.empty((B * L, n_blk, nb), dtype=torch.int32, device=dev)
    for phase in (0, 1, 2):
        _par_pass_kernel[(B, L, n_blk)](
            *lead, n_slots, L, n_blk, scratch, slow, ws, pc, cum, WS=ws.shape[1], BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_C=max(2, next_pow2(n_blk)), NB=nb, DB=digit_bits, PHASE=phase,
            num_warps=8, **flags,
        )  # fmt: skip


# ----------------------------------------------------------------------------------- Triton


@jit
def _max(a, b):
    return tl.maximum(a, b)


@jit
def _req(prow, idx, mask, other, vb, lim):
    # requested positions idx of a row, -1 where masked by valid / below (`other` outside `mask`)
    p = tl.load(prow + idx, mask=mask, other=0).to(tl.int64)
    return tl.where(mask, tl.where((p >= lim) | (vb == 0), -1, p), other)


@jit
def _row_masks(vb_ptr, lim_ptr, b, HAS_VALID: tl.constexpr, HAS_BELOW: tl.constexpr):
    BIG: tl.constexpr = 1 << 62
    vb = 1
    lim = BIG
    if HAS_VALID:
        vb = tl.load(vb_ptr + b).to(tl.int32)
    if HAS_BELOW:
        lim = tl.load(lim_ptr + b)
    return vb, lim


@jit
def _by_key_slot(lk, li, j, R, IB: tl.constexpr):
    # the slots li[:R] ordered by (key lk, slot): sorted as (key + 1) << IB | slot (exact while stamps
    # stay below 2^(63 - IB)); lanes j >= R come last
    BIG: tl.constexpr = 1 << 62
    k = tl.load(lk + j, mask=j < R, other=BIG)
    v = tl.load(li + j, mask=j < R, other=0)
    return tl.sort(tl.where(j < R, ((k + 1) << IB) | v, 0x7FFFFFFFFFFFFFFF)) & ((1 << IB) - 1)


@jit
def _row_request(
    pos_ptr, M, vb_ptr, lim_ptr, pat_ptr, stride_ab, stride_al, b, l, BLOCK_M: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_BELOW: tl.constexpr,
):  # fmt: skip
    # row b's requested positions as they come (-1 where masked) and what reading them takes: the
    # (row, layer)'s p2s offset, the lanes, the row's pointer and masks
    bp = tl.load(pat_ptr + b * stride_ab + l * stride_al)
    j = tl.arange(0, BLOCK_M)
    jm = j < M
    prow = pos_ptr + b.to(tl.int64) * M
    vb, lim = _row_masks(vb_ptr, lim_ptr, b, HAS_VALID, HAS_BELOW)
    return bp, j, jm, prow, vb, lim, _req(prow, j, jm, -1, vb, lim)


@jit
def _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG: tl.constexpr):
    # LRU keys of slots offs of one (row, layer): the stamp, or BIG where not evictable
    inb = offs < N
    sp = tl.load(s2p_ptr + bs + offs, mask=inb, other=0)
    st = tl.load(st_ptr + bs + offs, mask=inb, other=0)
    return tl.where((sp >= nf) | (st == now) | (offs >= N), BIG, st)


@jit
def _hist(dig, part, NB: tl.constexpr):
    # histogram of the digits `dig` where `part`: tl.histogram has no mask, so the outsiders (their
    # digit set to 0) are taken out of bin 0 again
    bins = tl.arange(0, NB)
    return tl.histogram(tl.where(part, dig, 0).to(tl.int32), NB) - tl.where(
        bins == 0, tl.sum((~part).to(tl.int32), 0), 0
    )


@jit
def _pick_bin(hist, rem, NB: tl.constexpr):
    # the bin of a histogram that holds the rem-th smallest element (1-based), and rem within it
    bins = tl.arange(0, NB)
    sel = tl.min(tl.where(tl.cumsum(hist, 0) >= rem, bins, NB), 0)
    return sel, rem - tl.sum(tl.where(bins < sel, hist, 0), 0)


@jit
def _lookup(prow, us, j, jm, M, vb, lim, p2s_ptr, bp, BIG: tl.constexpr):
    # the requested positions of a row in ascending order (into scratch `us`), looked up in the
    # (row, layer)'s p2s. Top-k rows come ascending then -1 padded, the newest tokens -1 padded
    # then ascending: with the -1s taken to the front they are sorted (no tl.sort).
    p = _req(prow, j, jm, BIG, vb, lim)
    seen = tl.associative_scan(_req(prow, j - 1, jm & (j > 0), -1, vb, lim), 0, _max)
    bad = jm & ((p < -1) | ((p >= 0) & (p < seen)))
    if tl.sum(bad.to(tl.int32), 0) == 0:
        ni = (jm & (p < 0)).to(tl.int32)
        vi = (jm & (p >= 0)).to(tl.int32)
        dest = tl.where(p >= 0, tl.sum(ni, 0) + tl.cumsum(vi, 0) - vi, tl.cumsum(ni, 0) - ni)
        tl.store(us + dest, p, mask=jm)
    else:
        tl.store(us + j, tl.sort(p), mask=jm)
    tl.debug_barrier()
    u = tl.load(us + j, mask=jm, other=BIG)
    up = tl.load(us + j - 1, mask=jm & (j > 0), other=-1)
    m = jm & ((j == 0) | (u != up)) & (u >= 0)  # first of each distinct position
    uc = tl.maximum(u, 0)
    slot = tl.load(p2s_ptr + bp + uc, mask=jm, other=-1).to(tl.int64)
    return u, uc, slot, m & (slot >= 0), m & (slot < 0)


@jit
def _select_serial(s2p_ptr, st_ptr, bs, N, nf, now, n_need, lk, li, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    # Steps 2-4 of one (row, layer) in one program: R = min(misses, evictable) victims into lk / li
    # (keys, slots) in slot order; returns R. Passes over the N slots in BLOCK_N steps.
    BIG: tl.constexpr = 1 << 62
    # 2. evictable slots, free ones (key -1) and the range of the other keys
    cap = n_need * 0
    nfree = n_need * 0
    kmin = now * 0 + BIG
    kmax = now * 0 - 1
    if n_need > 0:
        for c0 in range(0, N, BLOCK_N):
            offs = c0 + tl.arange(0, BLOCK_N)
            key = _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG)
            ev = key < BIG
            rest = ev & (key >= 0)
            cap += tl.sum(ev.to(tl.int32), 0)
            nfree += tl.sum((ev & (key == -1)).to(tl.int32), 0)
            kmin = tl.minimum(kmin, tl.min(tl.where(rest, key, BIG), 0))
            kmax = tl.maximum(kmax, tl.max(tl.where(rest, key, -1), 0))
    R = tl.minimum(n_need, cap)

    # 3. the R-th smallest key T, and how many slots with key T to take (lowest index first)
    T = now * 0 - 1
    take = R
    if nfree < R:
        rem = R - nfree
        prefix = now * 0
        dmax = kmax - kmin
        shift = n_need * 0
        t = dmax >> 8
        while t > 0:
            shift += 8
            t = t >> 8
        if (dmax > 0) & (rem > 1):  # (one victim beyond the free slots: the oldest, T = kmin)
            while shift >= 0:
                hist = tl.zeros([NB], tl.int32)
                for c0 in range(0, N, BLOCK_N):
                    offs = c0 + tl.arange(0, BLOCK_N)
                    key = _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG)
                    d = key - kmin
                    part = (key < BIG) & (key >= 0) & (((d >> shift) >> 8) == prefix)
                    hist += _hist((d >> shift) & (NB - 1), part, NB)
                sel, rem = _pick_bin(hist, rem, NB)
                prefix = prefix * NB + sel
                shift -= 8
        T = kmin + prefix
        take = rem

    # 4. the victims in slot order
    if R > 0:
        got = R * 0
        eqn = R * 0
        for c0 in range(0, N, BLOCK_N):
            offs = c0 + tl.arange(0, BLOCK_N)
            key = _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG)
            ev = key < BIG
            eqi = (ev & (key == T)).to(tl.int32)
            sel = (ev & (key < T)) | ((eqi > 0) & (eqn + tl.cumsum(eqi, 0) - eqi < take))
            si = sel.to(tl.int32)
            at = got + tl.cumsum(si, 0) - si
            tl.store(lk + at, key, mask=sel)
            tl.store(li + at, offs.to(tl.int64), mask=sel)
            got += tl.sum(si, 0)
            eqn += tl.sum(eqi, 0)
    return R


@jit
def _lru_place_kernel(
    pos_ptr, M, vb_ptr, lim_ptr, p2s_ptr, s2p_ptr, st_ptr, now_ptr, pat_ptr, sat_ptr, stride_ab, stride_al, base_ptr,
    nf_ptr, table_ptr, stride_t, acc_ptr, rb_ptr, N, L,
    u_ptr, src_ptr, dst_ptr, copy_ptr, ovf_ptr, csrc_ptr, cdst_ptr, cnt_ptr, scr_ptr, slow_ptr, ws_ptr,
    cand_ptr, stride_cb, stride_cl, C,
    PAGE: tl.constexpr, FORCE: tl.constexpr, IB: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, PAR: tl.constexpr, WS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_BELOW: tl.constexpr, CAND: tl.constexpr, BLOCK_C: tl.constexpr,
    BYTES: tl.constexpr,
):  # fmt: skip
    BIG: tl.constexpr = 1 << 62
    b = tl.program_id(0)
    l = tl.program_id(1)
    pl = (b * L + l).to(tl.int64)
    if SPLIT:  # noqa: SIM102 (constexpr, then a device value) the hit pass did this (row, layer)
        if tl.load(slow_ptr + pl) == 0:
            return
    now = tl.load(now_ptr)
    bp = tl.load(pat_ptr + b * stride_ab + l * stride_al)
    bs = tl.load(sat_ptr + b * stride_ab + l * stride_al)
    nf = tl.load(nf_ptr + b)
    base = tl.load(base_ptr + b)
    j = tl.arange(0, BLOCK_M)
    jm = j < M
    us = scr_ptr + pl * (3 * BLOCK_M)  # this program's scratch: sorted positions, victim keys, slots
    lk = us + BLOCK_M
    li = us + 2 * BLOCK_M
    prow = pos_ptr + b.to(tl.int64) * M

    # 1. the requested positions in ascending order, looked up; touch the hits
    vb, lim = _row_masks(vb_ptr, lim_ptr, b, HAS_VALID, HAS_BELOW)
    u, uc, slot, res, need = _lookup(prow, us, j, jm, M, vb, lim, p2s_ptr, bp, BIG)
    tl.store(st_ptr + bs + slot, tl.zeros_like(slot) + now, mask=res)  # touch the hits
    tl.debug_barrier()
    n_need = tl.sum(need.to(tl.int32), 0)

    # 2-4. the R = min(misses, evictable) victims in lk / li: CAND, the candidates this placement
    # did not hit (touched above: their stamp is now), in order; PAR, the parallel passes' lists
    # (_par_pass_kernel wrote them) unless a key was too old for their digits; else in here
    if CAND:
        cc = tl.arange(0, BLOCK_C)
        cs = tl.load(cand_ptr + b * stride_cb + l * stride_cl + cc, mask=cc < C, other=-1)
        cst = tl.load(st_ptr + bs + tl.maximum(cs, 0), mask=cs >= 0, other=0)
        ok = (cs >= 0) & (cst != now)
        oi = ok.to(tl.int32)
        R = tl.minimum(n_need, tl.sum(oi, 0))
        at = tl.cumsum(oi, 0) - oi
        tl.store(li + at, cs, mask=ok & (at < R))
        tl.debug_barrier()
    elif PAR:
        w = ws_ptr + pl * WS
        if tl.load(w + 2) == 0:
            R = tl.minimum(n_need, tl.load(w))
        else:
            R = _select_serial(s2p_ptr, st_ptr, bs, N, nf, now, n_need, lk, li, BLOCK_N, NB)
    else:
        R = _select_serial(s2p_ptr, st_ptr, bs, N, nf, now, n_need, lk, li, BLOCK_N, NB)
    # the victims in (key, slot) order: the list is unless it mixes several keys; then its <= M
    # entries are sorted by (key + 1) << IB | slot (candidates come in that order)
    if not CAND:  # noqa: SIM102 (constexpr, then a device value)
        if R > 0:
            tl.debug_barrier()
            k = tl.load(lk + j, mask=j < R, other=BIG)
            kp = tl.load(lk + j - 1, mask=(j > 0) & (j < R), other=-1)
            if tl.sum(((j < R) & (k < kp)).to(tl.int32), 0) > 0:
                srt = _by_key_slot(lk, li, j, R, IB)
                tl.debug_barrier()
                tl.store(li + j, srt, mask=j < R)
            tl.debug_barrier()

    # 5. evict and insert: the i-th miss (ascending position) takes the i-th victim
    ni = need.to(tl.int32)
    rank = tl.cumsum(ni, 0) - 1
    placed = need & (rank < R)
    vslot = tl.where(placed, tl.load(li + rank, mask=placed, other=0), N)
    old = tl.load(s2p_ptr + bs + vslot, mask=placed, other=-1)
    tl.store(p2s_ptr + bp + old, tl.full([BLOCK_M], -1, tl.int32), mask=placed & (old >= 0))
    tl.store(s2p_ptr + bs + vslot, u, mask=placed)
    tl.store(p2s_ptr + bp + uc, vslot.to(tl.int32), mask=placed)
    tl.store(st_ptr + bs + vslot, tl.zeros_like(vslot) + now, mask=placed)

    # 6. outputs
    copy = placed
    if FORCE:
        copy = placed | res
    dst = base + tl.where(placed, vslot, slot)
    pg = tl.load(table_ptr + b.to(tl.int64) * stride_t + uc // PAGE, mask=jm, other=0).to(tl.int64)
    src = pg * PAGE + uc % PAGE
    o = pl * M + j
    tl.store(dst_ptr + o, dst, mask=jm)
    tl.store(copy_ptr + o, copy, mask=jm)
    tl.store(ovf_ptr + o, need & ~placed, mask=jm)
    if l == 0:
        tl.store(u_ptr + b.to(tl.int64) * M + j, u, mask=jm)
        tl.store(src_ptr + b.to(tl.int64) * M + j, src, mask=jm)
    ci = copy.to(tl.int32)
    at = pl * M + tl.cumsum(ci, 0) - ci
    tl.store(csrc_ptr + at, src, mask=copy)
    tl.store(cdst_ptr + at, dst, mask=copy)
    n_copy = tl.sum(ci, 0).to(tl.int64)
    tl.store(cnt_ptr + pl, n_copy)
    if FORCE:
        tl.atomic_add(acc_ptr + 2, n_copy)
        if BYTES:
            tl.atomic_add(acc_ptr + 6, n_copy * tl.load(rb_ptr + l))
    else:
        tl.atomic_add(acc_ptr + 0, tl.sum(res.to(tl.int32), 0).to(tl.int64))
        tl.atomic_add(acc_ptr + 1, n_need.to(tl.int64))
        if BYTES:
            tl.atomic_add(acc_ptr + 5, n_need.to(tl.int64) * tl.load(rb_ptr + l))


@jit
def _lru_candidates_kernel(
    s2p_ptr, st_ptr, now_ptr, sat_ptr, stride_ab, stride_al, nf_ptr, N, L, C, out_ptr, scr_ptr, ws_ptr,
    ks_ptr, kk_ptr, km_ptr, p2s_ptr, pat_ptr, stride_pb, stride_pl, KC,
    IB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, PAR: tl.constexpr,
    WS: tl.constexpr, KEEP: tl.constexpr, NFW: tl.constexpr,
):  # fmt: skip
    # grid (B, L): the C smallest (key, slot) evictable slots of one (row, layer), in that order: the
    # select for C victims (slot order; PAR: the parallel passes' list, unless a key was too old for
    # their digits), then sorted by (key, slot). KEEP: from the (block, layer)'s kept list where it is
    # still exact, else the select for KC, kept (module doc)
    BIG: tl.constexpr = 1 << 62
    b = tl.program_id(0)
    l = tl.program_id(1)
    pl = (b * L + l).to(tl.int64)
    now = tl.load(now_ptr)
    bs = tl.load(sat_ptr + b * stride_ab + l * stride_al)
    nf = tl.load(nf_ptr + b)
    lk = scr_ptr + pl * (3 * BLOCK_C) + BLOCK_C  # (the parallel passes' layout)
    li = lk + BLOCK_C
    j = tl.arange(0, BLOCK_C)
    if KEEP:
        plane = bs // (N + 1)
        ks = ks_ptr + plane * KC
        kk = kk_ptr + plane * KC
        km = km_ptr + plane * 3
        nf_at = tl.load(km)
        bk = tl.load(km + 1)
        bsl = tl.load(km + 2)
        cs = tl.load(ks + j, mask=j < KC, other=-1)
        ck = tl.load(kk + j, mask=j < KC, other=0)
        cst = tl.load(st_ptr + bs + tl.maximum(cs, 0), mask=cs >= 0, other=0)
        ok = (cs >= 0) & (cst == ck)  # untouched since kept
        oi = ok.to(tl.int32)
        reuse = (nf_at >= 0) & (nf >= nf_at) & (nf - nf_at <= NFW) & (tl.sum(oi, 0) >= C)
        # the positions newly evictable since (newest_from moved on) must come after the bound
        bp = tl.load(pat_ptr + b * stride_pb + l * stride_pl)
        pp = nf_at + tl.arange(0, NFW)
        pm = pp < tl.where(reuse, nf, nf_at)  # (none unless reuse)
        sl = tl.load(p2s_ptr + bp + tl.maximum(pp, 0), mask=pm, other=-1).to(tl.int64)
        sk = tl.load(st_ptr + bs + tl.maximum(sl, 0), mask=pm & (sl >= 0), other=BIG)
        early = pm & (sl >= 0) & ((sk < bk) | ((sk == bk) & (sl < bsl)))
        reuse = reuse & (tl.sum(early.to(tl.int32), 0) == 0)
        if reuse:
            at = tl.cumsum(oi, 0) - oi
            tl.store(out_ptr + pl * C + at, cs, mask=ok & (at < C))
        else:
            R = _select_serial(s2p_ptr, st_ptr, bs, N, nf, now, KC + 0 * N, lk, li, BLOCK_N, NB)
            tl.debug_barrier()
            srt = tl.where(j < R, _by_key_slot(lk, li, j, R, IB), -1)
            key = tl.load(st_ptr + bs + tl.maximum(srt, 0), mask=srt >= 0, other=0)  # (evictable: the stamp)
            tl.store(ks + j, srt, mask=j < KC)
            tl.store(kk + j, key, mask=j < KC)
            tl.store(km, nf)
            tl.store(km + 1, tl.where(R == KC, tl.sum(tl.where(j == R - 1, key, 0), 0), BIG))
            tl.store(km + 2, tl.sum(tl.where(j == R - 1, srt, 0), 0))
            tl.store(out_ptr + pl * C + j, srt, mask=j < C)
    else:
        if PAR:
            w = ws_ptr + pl * WS
            if tl.load(w + 2) == 0:
                R = tl.minimum(C + 0 * N, tl.load(w))
            else:
                R = _select_serial(s2p_ptr, st_ptr, bs, N, nf, now, C + 0 * N, lk, li, BLOCK_N, NB)
        else:
            R = _select_serial(s2p_ptr, st_ptr, bs, N, nf, now, C + 0 * N, lk, li, BLOCK_N, NB)
        tl.debug_barrier()
        tl.store(out_ptr + pl * C + j, tl.where(j < R, _by_key_slot(lk, li, j, R, IB), -1), mask=j < C)


@jit
def _place_hits_kernel(
    pos_ptr, M, vb_ptr, lim_ptr, p2s_ptr, st_ptr, now_ptr, pat_ptr, sat_ptr, stride_ab, stride_al, base_ptr,
    table_ptr, stride_t, acc_ptr, rb_ptr, L,
    u_ptr, src_ptr, dst_ptr, copy_ptr, ovf_ptr, csrc_ptr, cdst_ptr, cnt_ptr, slow_ptr, scr_ptr,
    PAGE: tl.constexpr, FORCE: tl.constexpr, BLOCK_M: tl.constexpr, CH: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_BELOW: tl.constexpr, BYTES: tl.constexpr,
):  # fmt: skip
    # The all-hit pass, grid (B, L, chunks of CH sorted positions). Every program reads the whole
    # row and its p2s entries (nothing here writes p2s, so all programs see the same tables) and
    # decides alike: if a position misses, or the row is not ascending apart from -1s (it would
    # need a sort), program 0 flags the (row, layer) for `_lru_place_kernel` and nothing else is
    # written. Otherwise every program does its chunk of what that kernel would do without misses:
    # touch the stamps, write the outputs and (FORCE) the compacted copies, add the counters.
    b = tl.program_id(0)
    l = tl.program_id(1)
    c = tl.program_id(2)
    pl = (b * L + l).to(tl.int64)
    bp, j, jm, prow, vb, lim, p = _row_request(
        pos_ptr, M, vb_ptr, lim_ptr, pat_ptr, stride_ab, stride_al, b, l, BLOCK_M, HAS_VALID, HAS_BELOW
    )
    seen = tl.associative_scan(_req(prow, j - 1, jm & (j > 0), -1, vb, lim), 0, _max)
    bad = jm & ((p < -1) | ((p >= 0) & (p < seen)))
    slot = tl.load(p2s_ptr + bp + tl.maximum(p, 0), mask=jm & (p >= 0), other=0)
    miss = jm & (p >= 0) & (slot < 0)
    if tl.sum((bad | miss).to(tl.int32), 0) > 0:
        if c == 0:
            tl.store(slow_ptr + pl, 1)
        return
    # ascending apart from -1s: sorted, the -1s come first and the others keep their order; an
    # element is the first of its position where it differs from the last valid one before it
    ni = (jm & (p < 0)).to(tl.int32)
    vi = (jm & (p >= 0)).to(tl.int32)
    dest = tl.where(p >= 0, tl.sum(ni, 0) + tl.cumsum(vi, 0) - vi, tl.cumsum(ni, 0) - ni)
    first = (p >= 0) & (p != seen)
    lo = c * CH
    # this chunk's sorted positions and the one before them, into this program's scratch
    scr = scr_ptr + (pl * tl.num_programs(2) + c) * (2 * CH)
    mine = jm & (dest >= lo - 1) & (dest < lo + CH)
    tl.store(scr + (dest - lo + 1), p, mask=mine)
    tl.debug_barrier()
    k = tl.arange(0, CH)
    jj = lo + k
    km = jj < M
    u = tl.load(scr + 1 + k, mask=km, other=-1)
    up = tl.load(scr + k, mask=km & (jj > 0), other=-1)
    m = km & ((jj == 0) | (u != up)) & (u >= 0)
    uc = tl.maximum(u, 0)
    s = tl.load(p2s_ptr + bp + uc, mask=km, other=-1).to(tl.int64)
    bs = tl.load(sat_ptr + b * stride_ab + l * stride_al)
    now = tl.load(now_ptr)
    tl.store(st_ptr + bs + s, tl.zeros_like(s) + now, mask=m)  # touch the hits
    base = tl.load(base_ptr + b)
    pg = tl.load(table_ptr + b.to(tl.int64) * stride_t + uc // PAGE, mask=km, other=0).to(tl.int64)
    src = pg * PAGE + uc % PAGE
    o = pl * M + jj
    tl.store(dst_ptr + o, base + s, mask=km)
    tl.store(ovf_ptr + o, tl.zeros_like(m), mask=km)
    if l == 0:
        tl.store(u_ptr + b.to(tl.int64) * M + jj, u, mask=km)
        tl.store(src_ptr + b.to(tl.int64) * M + jj, src, mask=km)
    n_mine = tl.sum(m.to(tl.int32), 0).to(tl.int64)
    if FORCE:  # every hit is copied: the compacted list continues the chunks before this one
        tl.store(copy_ptr + o, m, mask=km)
        before = tl.sum((first & (dest < lo)).to(tl.int32), 0)
        ci = m.to(tl.int32)
        at = pl * M + before + tl.cumsum(ci, 0) - ci
        tl.store(csrc_ptr + at, src, mask=m)
        tl.store(cdst_ptr + at, base + s, mask=m)
        tl.atomic_add(acc_ptr + 2, n_mine)
        if BYTES:
            tl.atomic_add(acc_ptr + 6, n_mine * tl.load(rb_ptr + l))
    else:
        tl.store(copy_ptr + o, tl.zeros_like(m), mask=km)
        tl.atomic_add(acc_ptr + 0, n_mine)
    if c == 0:
        tl.store(slow_ptr + pl, 0)
        if FORCE:
            tl.store(cnt_ptr + pl, tl.sum(first.to(tl.int32), 0).to(tl.int64))
        else:
            tl.store(cnt_ptr + pl, n_mine * 0)


# ------------------------------------------------------- the parallel passes over the slots (PAR)
# Workspace `ws` (int32 [B * L, WS], zeroed): [0] evictable slots, [1] free ones, [2] evictable keys
# older than the digits reach (> 0: the full kernel selects alone), [3] misses; [8, 8 + NB) the
# histogram of digit 0, [8 + NB, 8 + 2 NB) that of digit 1. Per block `pc` (int32 [B * L, C, 2]):
# free slots, keys below digit 0's bin; `cum` (int32 [B * L, C, NB]): the running histogram of
# digit 1 in the block. A key k (an evictable stamp, k < now) is the 2 DB-bit number
# d = k - (now - 2^(2 DB)): digit 0 its high DB bits, digit 1 its low ones.
_WS_HIST = 8  # where the histograms start in a workspace row (the kernels' HIST)


@jit
def _pick(h_ptr, rem, NB: tl.constexpr):
    # `_pick_bin` of a histogram in memory (a workspace row's)
    return _pick_bin(tl.load(h_ptr + tl.arange(0, NB)), rem, NB)


@jit
def _par_pass_kernel(
    pos_ptr, M, vb_ptr, lim_ptr, p2s_ptr, s2p_ptr, st_ptr, now_ptr, pat_ptr, sat_ptr, stride_ab, stride_al,
    nf_ptr, N, L, C, scr_ptr, slow_ptr, ws_ptr, pc_ptr, cum_ptr,
    WS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NB: tl.constexpr,
    DB: tl.constexpr, SPLIT: tl.constexpr, HAS_VALID: tl.constexpr, HAS_BELOW: tl.constexpr, PHASE: tl.constexpr,
    FIXED: tl.constexpr = False,
):  # fmt: skip
    # One of the parallel passes, grid (B, L, C blocks of BLOCK_N slots), launched for PHASE 0, 1, 2.
    # FIXED: the victim candidates' select (`lru_candidates`): M victims wanted, nothing requested.
    # 0 (scan): touch the block's hits, then count its evictable / free / too-old keys and histogram
    # digit 0 into the workspace; block 0 also counts the misses. 1: where the victims go beyond the
    # free slots, digit 1's histogram of the keys in digit 0's chosen bin (global, and running per
    # block), and the block's keys below that bin. 2: the R-th smallest key T (from the two
    # histograms) and how many keys == T to take; each block writes its victims (keys < T, then its
    # share of the lowest-index keys == T) to the (row, layer)'s list at the offsets the blocks
    # before it fill, which their counts give.
    BIG: tl.constexpr = 1 << 62
    HIST: tl.constexpr = 8  # (_WS_HIST)
    b = tl.program_id(0)
    l = tl.program_id(1)
    c = tl.program_id(2)
    pl = (b * L + l).to(tl.int64)
    if SPLIT:  # noqa: SIM102 (constexpr, then a device value) the all-hit pass placed this (row, layer)
        if tl.load(slow_ptr + pl) == 0:
            return
    now = tl.load(now_ptr)
    bs = tl.load(sat_ptr + b * stride_ab + l * stride_al)
    nf = tl.load(nf_ptr + b)
    w = ws_ptr + pl * WS
    if PHASE == 0:
        lo = c * BLOCK_N
        if FIXED:
            if c == 0:
                tl.store(w + 3, M + 0 * N)
            go = M + 0 * N
        else:
            bp, j, jm, prow, vb, lim, p = _row_request(
                pos_ptr, M, vb_ptr, lim_ptr, pat_ptr, stride_ab, stride_al, b, l, BLOCK_M,
                HAS_VALID, HAS_BELOW,
            )  # fmt: skip
            # (a position asked for twice touches its slot twice, to the same value)
            slot = tl.load(p2s_ptr + bp + tl.maximum(p, 0), mask=p >= 0, other=-1).to(tl.int64)
            tl.store(st_ptr + bs + slot, tl.zeros_like(slot) + now, mask=(slot >= lo) & (slot < lo + BLOCK_N))
            if c == 0:
                us = scr_ptr + pl * (3 * BLOCK_M)
                _, _, _, _, need = _lookup(prow, us, j, jm, M, vb, lim, p2s_ptr, bp, BIG)
                tl.store(w + 3, tl.sum(need.to(tl.int32), 0))
            tl.debug_barrier()
            # nothing misses (every block sees the same p2s): no victims, so no scan; the workspace
            # stays zero (R = 0), so phases 1 and 2 and the full kernel's victim steps do nothing either
            go = tl.sum(((p >= 0) & (slot < 0)).to(tl.int32), 0)
        if go > 0:
            offs = lo + tl.arange(0, BLOCK_N)
            key = _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG)
            ev = key < BIG
            rest = ev & (key >= 0)
            d = key - (now - (1 << (2 * DB)))
            ok = rest & (d >= 0)
            n_free = tl.sum((ev & (key == -1)).to(tl.int32), 0)
            tl.atomic_add(w, tl.sum(ev.to(tl.int32), 0))
            tl.atomic_add(w + 1, n_free)
            tl.atomic_add(w + 2, tl.sum((rest & (d < 0)).to(tl.int32), 0))
            tl.store(pc_ptr + (pl * C + c) * 2, n_free)
            hist = _hist(d >> DB, ok, NB)
            tl.atomic_add(w + HIST + tl.arange(0, NB), hist, mask=hist > 0)
    else:
        # from the scan: free slots, R = min(misses, evictable), keys too old for the digits
        nfree, R, nold = tl.load(w + 1), tl.minimum(tl.load(w + 3), tl.load(w)), tl.load(w + 2)
        if PHASE == 1:  # noqa: SIM102 (constexpr, then a device value)
            if (nold == 0) & (nfree < R):
                sel0, _ = _pick(w + HIST, R - nfree, NB)
                offs = c * BLOCK_N + tl.arange(0, BLOCK_N)
                key = _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG)
                rest = (key < BIG) & (key >= 0)
                d = key - (now - (1 << (2 * DB)))
                hi = d >> DB
                inb = rest & (hi == sel0)
                tl.store(pc_ptr + (pl * C + c) * 2 + 1, tl.sum((rest & (hi < sel0)).to(tl.int32), 0))
                hist = _hist(d & ((1 << DB) - 1), inb, NB)
                bins = tl.arange(0, NB)
                tl.store(cum_ptr + (pl * C + c) * NB + bins, tl.cumsum(hist, 0))
                tl.atomic_add(w + HIST + NB + bins, hist, mask=hist > 0)
        elif (nold == 0) & (R > 0):
            cc = tl.arange(0, BLOCK_C)
            before = cc < c
            pcb = pc_ptr + pl * C * 2
            free_before = tl.sum(tl.load(pcb + cc * 2, mask=before, other=0), 0)
            T = now * 0 - 1  # R free slots or fewer: the lowest-index free ones
            take = R
            lt_before = free_before * 0
            eq_before = free_before
            if nfree < R:
                sel0, rem = _pick(w + HIST, R - nfree, NB)
                sel1, rem = _pick(w + HIST + NB, rem, NB)
                T = now - (1 << (2 * DB)) + (sel0.to(tl.int64) << DB) + sel1
                take = rem
                cb = cum_ptr + (pl * C + cc) * NB
                upto = tl.load(cb + sel1, mask=before, other=0)  # keys in sel0's bin with digit 1 <= sel1
                under = tl.load(cb + sel1 - 1, mask=before & (cc * 0 + sel1 > 0), other=0)  # ... < sel1
                lt_before = free_before + tl.sum(tl.load(pcb + cc * 2 + 1, mask=before, other=0), 0)
                lt_before += tl.sum(under, 0)
                eq_before = tl.sum(upto - under, 0)
            offs = c * BLOCK_N + tl.arange(0, BLOCK_N)
            key = _keys(s2p_ptr, st_ptr, bs, offs, N, nf, now, BIG)
            ev = key < BIG
            lk = scr_ptr + pl * (3 * BLOCK_M) + BLOCK_M
            li = lk + BLOCK_M
            lt = ev & (key < T)
            si = lt.to(tl.int32)
            at = lt_before + tl.cumsum(si, 0) - si
            tl.store(lk + at, key, mask=lt)
            tl.store(li + at, offs.to(tl.int64), mask=lt)
            ei = (ev & (key == T)).to(tl.int32)
            r = eq_before + tl.cumsum(ei, 0) - ei
            sel = (ei > 0) & (r < take)
            tl.store(lk + (R - take) + r, key, mask=sel)
            tl.store(li + (R - take) + r, offs.to(tl.int64), mask=sel)
