"""Seeded Gumbel-max draws for a batch of rows: one pass over the (temperature-scaled, masked) logits.

A draw from softmax(x) is the argmax of x + g with g_i ~ Gumbel(0, 1) independent. The noise here
comes from a counter-based hash of (row key, token id), not from a generator's stream, so

- every row of a batch draws in the same launch (the per-row path made a generator and a dozen
  kernels per row: ~15 launches a sampled row, hundreds a step at batch 32);
- a row's draw depends on its key and its own logits only, not on what it is batched with;
- a row restricted to candidates (top-k's sorted prefix) draws the token it would draw over the
  whole vocabulary, since the noise belongs to the token id, not to its column.

The hash is a 32-bit integer mixer (two rounds over the id, keyed by the key's halves); g is built
from 23 of a second mix's bits, in float32. Ties of x + g (the 23-bit grid makes them possible on
flat rows) go to the larger first hash, which is distinct per id, so the winner is one token
whichever columns hold the candidates and in whatever order.

    gumbel_argmax(x [D, W] float32, keys [D] int64, ids [D, W] int64 | None,
                  temperature [D] float32 | None) -> [D] int64 columns

`ids` None: column c is token c. Keys are non-negative below 2**63 (`longctx.seeds.MASK63`).
`temperature`: x is the raw logits (float32, bfloat16 or float16) and the kernel scales them itself
(`scale_logits_ref`'s rules), so a temperature-only draw is this one launch instead of a handful of
elementwise passes over the rows first. In the kernel a NaN token has level 0 and score g, any other
level 1 and score x / t + g (the quotient correctly rounded, +-inf held at the largest finite floats);
the highest level a row holds wins, then the score: the draw over the scaled row, without writing it.
"""

from __future__ import annotations

import torch

from .common import check, jit, next_pow2, row_split, tl, use_triton

M32 = 0xFFFFFFFF
MIX_A, MIX_B = 0x21F0AAAD, 0x735A2D97  # the mixer's multipliers (shifts 16, 15, 15)
SECOND = 0x9E3779B9  # xor before the second mix (the noise's bits)
UNIT = 2.0**-23
REF_BLOCK_ELEMS = 1 << 18  # the CPU reference's rows per pass: about this many elements
# The row's winner over its programs' bests picked by `_gumbel_pick_kernel` (one launch) on CUDA, else by
# five torch ops there; the interpreter runs the kernel in CI. On: checked on an H100 in the fifty-fifth
# session (bench.gpu_kernel_check --only gumbel, every case err 0), and a temperature-alone draw took
# 0.20-0.42 ms against 0.32-0.63 with the torch ops, the same tokens (bench/results/sampling-s55-h100.md).
PICK_KERNEL_CUDA = True


def _s32(c: int) -> int:
    """A 32-bit constant as the int32 with its bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """A bijective mixer of 32-bit values held in int32 (the bits; products wrap modulo 2**32 on CPU and
    CUDA alike, and the shifts are made logical by masking the sign's copies)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _s32(MIX_A)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _s32(MIX_B)
    return x ^ ((x >> 15) & 0x1FFFF)


def gumbel_noise_ref(keys: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g float32 [D, W], h int32 [D, W]): row d's noise for token ids[d, w] (ids below 2**31), and the
    first hash's bits (the tie-break, distinct per id within a row; compare them as unsigned)."""
    a32 = _as_s32(keys & M32)[:, None]
    b32 = _as_s32((keys >> 32) & M32)[:, None]
    h = mix32_ref(mix32_ref(ids.to(torch.int32) ^ a32) ^ b32)
    v = mix32_ref(h ^ _s32(SECOND))
    u = (((v >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * UNIT  # in (0, 1), exact in float32
    return -torch.log(-torch.log(u)), h


def scale_logits_ref(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [D, V] over temperature [D, 1] in float32, made drawable. +-inf become the largest finite
    floats, whose sums with any noise stay there: a row with +inf logits (a tiny temperature or
    repetition penalty overflows the largest ones) draws among those tokens, their scores tie and the
    larger hash wins, so each equally often over seeds; a row with every token at -inf (min_tokens with
    the whole vocabulary in stop_token_ids) likewise among all. NaN becomes -inf, never drawn, and a row
    all NaN draws uniformly."""
    x = torch.nan_to_num(logits.float() / temperature, nan=float("-inf"))
    return torch.where(torch.isneginf(x).all(dim=1, keepdim=True), torch.zeros_like(x), x)


def _as_s32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def gumbel_argmax_ref(x: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The column of each row's largest x + g (ties: the larger first hash, as unsigned)."""
    if ids is None:
        ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    g, h = gumbel_noise_ref(keys, ids)
    s = x.float() + g
    top = s == s.max(dim=1, keepdim=True).values
    return torch.where(top, h.to(torch.int64) & M32, -1).argmax(dim=1)


@jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@jit
def _gumbel_argmax_kernel(
    x_ptr,
    keys_ptr,
    ids_ptr,
    t_ptr,
    bl_ptr,
    bs_ptr,
    bh_ptr,
    bc_ptr,
    W,
    CHUNK,
    sx,
    si,
    S,
    HAS_IDS: tl.constexpr,
    HAS_T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    d = tl.program_id(0).to(tl.int64)
    s_id = tl.program_id(1)
    key = tl.load(keys_ptr + d)
    a = (key & 0xFFFFFFFF).to(tl.uint32)
    b = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    if HAS_T:
        t = tl.load(t_ptr + d)
    best_l = tl.full([], -1, tl.int32)  # (HAS_T: the level of the best so far)
    best_s = tl.full([], float("-inf"), tl.float32)
    best_h = tl.full([], -1, tl.int64)
    best_c = tl.full([], 0, tl.int64)
    lo = s_id * CHUNK
    hi = tl.minimum(lo + CHUNK, W)
    for c0 in range(lo, hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < hi
        xv = tl.load(x_ptr + d * sx + cols, mask=m, other=float("-inf")).to(tl.float32)
        if HAS_IDS:
            ids = tl.load(ids_ptr + d * si + cols, mask=m, other=0)
        else:
            ids = cols.to(tl.int64)
        h = _mix32(_mix32(ids.to(tl.uint32) ^ a) ^ b)
        v = _mix32(h ^ 0x9E3779B9)
        u = ((v >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        g = -tl.log(-tl.log(u))
        h64 = tl.where(m, h.to(tl.int64), -1)
        if HAS_T:
            xs = tl.math.div_rn(xv, t)  # (torch's division: correctly rounded)
            lvl = tl.where(m, tl.where(xs != xs, 0, 1), -1)  # (before the clamp, which may drop NaN)
            xs = tl.minimum(tl.maximum(xs, -3.4028234663852886e38), 3.4028234663852886e38)
            s = tl.where(lvl == 1, xs + g, g)
            lm = tl.max(lvl, axis=0)
            s = tl.where(lvl == lm, s, float("-inf"))
            h64 = tl.where(lvl == lm, h64, -1)
        else:
            s = xv + g  # (-inf past the row: xv's `other`)
        bm = tl.max(s, axis=0)
        hm = tl.max(tl.where(s == bm, h64, -1), axis=0)
        cm = tl.max(tl.where((s == bm) & (h64 == hm), cols.to(tl.int64), -1), axis=0)
        take = (bm > best_s) | ((bm == best_s) & (hm > best_h))
        if HAS_T:
            take = (lm > best_l) | ((lm == best_l) & take)
            best_l = tl.where(take, lm, best_l)
        best_s = tl.where(take, bm, best_s)
        best_h = tl.where(take, hm, best_h)
        best_c = tl.where(take, cm, best_c)
    if HAS_T:
        tl.store(bl_ptr + d * S + s_id, best_l)
    tl.store(bs_ptr + d * S + s_id, best_s)
    tl.store(bh_ptr + d * S + s_id, best_h)
    tl.store(bc_ptr + d * S + s_id, best_c)


@jit
def _gumbel_pick_kernel(
    bl_ptr, bs_ptr, bh_ptr, bc_ptr, out_ptr, S, HAS_T: tl.constexpr, BLOCK_S: tl.constexpr
):
    """Row d's winner over its S programs' bests: the highest level (HAS_T), then the score, then the hash;
    of programs tied on all three (none: hashes are distinct per token) the first."""
    d = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_S)
    m = i < S
    bs = tl.load(bs_ptr + d * S + i, mask=m, other=float("-inf"))
    bh = tl.load(bh_ptr + d * S + i, mask=m, other=-2)
    if HAS_T:
        bl = tl.load(bl_ptr + d * S + i, mask=m, other=-2)
        bs = tl.where(bl == tl.max(bl, axis=0), bs, float("-inf"))
    best = tl.max(bs, axis=0)
    h = tl.max(tl.where(m & (bs == best), bh, -2), axis=0)
    at = tl.min(tl.where(m & (bs == best) & (bh == h), i, BLOCK_S), axis=0)
    tl.store(out_ptr + d, tl.load(bc_ptr + d * S + at))


def gumbel_argmax(
    x: torch.Tensor,
    keys: torch.Tensor,
    ids: torch.Tensor | None = None,
    *,
    temperature: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`gumbel_argmax_ref` (of `scale_logits_ref(x, temperature)` with a temperature): each row split
    over programs (a batch of one still spreads over the SMs), each keeping its best (level, score,
    hash, column); a second kernel of one program per row picks the row's winner (five torch ops on
    CUDA when PICK_KERNEL_CUDA is off)."""
    floats = (torch.float32, torch.bfloat16, torch.float16) if temperature is not None else (torch.float32,)
    check(
        x.dim() == 2 and x.dtype in floats,
        f"gumbel_argmax: x must be float32 [D, W] (or 16-bit with a temperature), got {x.dtype} {tuple(x.shape)}",
    )
    d, w = x.shape
    if temperature is not None:
        check(
            temperature.shape == (d,)
            and temperature.dtype == torch.float32
            and temperature.device == x.device,
            f"gumbel_argmax: temperature must be float32 [{d}] on x's device, got {temperature.dtype} "
            f"{tuple(temperature.shape)}",
        )
    check(w > 0, "gumbel_argmax: a row needs at least one column")
    check(
        keys.shape == (d,) and keys.dtype == torch.int64 and keys.device == x.device,
        f"gumbel_argmax: keys must be int64 [{d}] on x's device, got {keys.dtype} {tuple(keys.shape)}",
    )
    if ids is not None:
        check(
            ids.shape == x.shape and ids.dtype == torch.int64 and ids.device == x.device,
            f"gumbel_argmax: ids must be int64 {tuple(x.shape)} on x's device, got {ids.dtype} {tuple(ids.shape)}",
        )
    if not d:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if not use_triton(backend, x.device):
        if temperature is not None:
            x = scale_logits_ref(x, temperature[:, None])
        if x.device.type != "cpu":
            return gumbel_argmax_ref(x, keys, ids)
        # on the CPU a few rows at a time: a block's dozen passes then run in cache (2x faster at 32 rows
        # of a GLM vocabulary than all rows at once)
        step = max(1, REF_BLOCK_ELEMS // w)
        blocks = range(0, d, step)
        return torch.cat(
            [
                gumbel_argmax_ref(
                    x[a : a + step], keys[a : a + step], None if ids is None else ids[a : a + step]
                )
                for a in blocks
            ]
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if ids is not None and ids.stride(1) != 1:
        ids = ids.contiguous()
    if temperature is not None:
        temperature = temperature.contiguous()
    block = min(1024, next_pow2(w))
    s, chunk = row_split(w, d, block, x.device, min_blocks=4)
    bl = torch.empty(d, s, dtype=torch.int32, device=x.device) if temperature is not None else keys
    bs = torch.empty(d, s, dtype=torch.float32, device=x.device)
    bh = torch.empty(d, s, dtype=torch.int64, device=x.device)
    bc = torch.empty(d, s, dtype=torch.int64, device=x.device)
    _gumbel_argmax_kernel[(d, s)](
        x, keys, x if ids is None else ids, keys if temperature is None else temperature, bl, bs, bh, bc, w,
        chunk, x.stride(0), 0 if ids is None else ids.stride(0), s, HAS_IDS=ids is not None,
        HAS_T=temperature is not None, BLOCK=block,
    )  # fmt: skip
    if s == 1:
        return bc[:, 0]
    if x.is_cuda and not PICK_KERNEL_CUDA:
        if temperature is not None:  # the programs' bests below the row's highest level: out
            bs = torch.where(bl == bl.max(dim=1, keepdim=True).values, bs, float("-inf"))
        best = bs.max(dim=1, keepdim=True).values
        pick = torch.where(bs == best, bh, -1).argmax(dim=1, keepdim=True)
        return bc.gather(1, pick)[:, 0]
    out = torch.empty(d, dtype=torch.int64, device=x.device)  # (the programs' bests reduced in one launch)
    _gumbel_pick_kernel[(d,)](
        bl, bs, bh, bc, out, s, HAS_T=temperature is not None, BLOCK_S=next_pow2(s), num_warps=1
    )
    return out
