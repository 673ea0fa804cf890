"""Sparse MLA, `impl="heads"`: every head of a query in the M dimension of the tensor-core dots.

Same math, layouts and contract as `sparse_mla.sparse_mla_ref` (see that module's docstring); this module
only holds the Triton kernel and its tile choices, and `sparse_mla.sparse_mla(..., impl="heads")` launches it.

Why a second kernel. `impl="split"` puts BLOCK_H (16-32) heads of ONE query in M, so at 64 heads each query's
rows are gathered by 4 programs and every dot is an M=16 dot, which Hopper runs as the old mma.sync path
(wgmma needs M = 64 per warpgroup). Here one program per (query, K split) holds all heads (64 -> M = 64):
  * each gathered key tile [BLOCK_N, L + R] is loaded ONCE per query and feeds one [64, L+R] x [L+R, BN]
    score dot (chained over the V blocks and the rope part) and the [64, BN] x [BN, L] value dot;
  * the 512-wide latent (value/output) dimension is cut into NV <= 4 column blocks of BLOCK_V (128 for
    L = 512, FlashMLA-style). A block never straddles an fp8 scale group (BLOCK_V divides the group), so
    the dequant of a block is one fp32 scale per row broadcast over [BLOCK_N, BLOCK_V], fused into the load.
    The rope part stays bf16 (no scale).

Scores are computed once per key tile and P is reused for all NV value blocks (not recomputed per block):
  * recomputing S per value block (one program per (query, value block)) would cost NV x the QK^T work,
    (4 * 576 + 512) / (576 + 512) = 2.6x the FLOPs at L=512, and 4x the gathers; prefill is compute-bound,
    so that loses;
  * keeping all NV accumulators in one program costs registers: [64, 512] fp32 = 128 KB, i.e. 128
    registers/thread at 8 warps (num_warps=8 default; 4 warps would need 256). P stays in registers as the
    wgmma A operand (bf16); S/P add ~8 registers at BN=32.
  * shared memory: Q [64, 576] bf16 = 72 KB (loop-invariant wgmma A operand, loaded once), the gathered
    fp8 tile + rope + scales per cp.async stage, and the dequantised bf16 copy as the wgmma B operand.
Static check (triton 3.9 AOT for sm_90a, runtime-like divisibility, ptxas 13): BN=32 / 8 warps / 2 stages
-> 255 registers, 36 B spill, 124 KB smem (one CTA per SM); BN=16 -> 0 spill, 99 KB; BN=64 -> 152 B spill,
173 KB; 16 warps -> capped at 128 registers, 480 B spill. Known cost: Triton lays a dot whose result feeds
another dot out as warpsPerCTA [num_warps, 1], so at M = 64 and 8 warps both warpgroups compute the same
S tile (QK^T runs twice, ~1.5x the tensor-core work of the ideal); the P.V dots split N across the two
warpgroups. Removing that needs warp specialisation (FlashMLA's producer/consumer split), not a Triton tile.
Decode (Tq < #SMs) splits K so Tq x splits fills one wave of 132 SMs at one CTA each (`pick_splits_heads`);
the fp32 partials are merged by `sparse_mla._combine_kernel`. Prefill (Tq >= #SMs) runs one split.

Launch knobs (`HeadsKnobs`, env LONGCTX_SPARSE_MLA_HEADS; defaults = the launch above): tile sizes, warps,
stages, K splits, heads per program, and `vsplit`, which cuts the NV value blocks over that many programs
per (query, head block, split). Such a program still scores against the whole latent (QK^T over L+R) but
accumulates and stores only its NV/vsplit blocks, so it holds a [64, 512/vsplit] accumulator: one
warpgroup (4 warps) is enough, S is computed once per warpgroup instead of twice, and at small block_n the
CTA fits twice per SM (sm_90a AOT: vsplit=4, block_n=16, 4 warps -> 95 KB smem, 188 registers, no spill)
so one CTA's gathers overlap the other's dots; the price is vsplit x the QK^T work and L2 gathers.
`python -m bench.smla_sweep` checks and times the settings on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .common import check, jit, knobs_spec, next_pow2, parse_knobs, pdl_wait, tl
from .fp8_gemm import cdiv
from .rope import _rotate

MAX_NV = 4  # value blocks held per program (acc0..acc3)


@dataclass(frozen=True)
class HeadsKnobs:
    """How impl="heads" tiles a launch (never what it computes); 0 means the shape's default. The defaults
    are the launch before the knobs existed; `python -m bench.smla_sweep` times the alternatives.

    `vsplit` cuts the NV value blocks (4 x 128 latent columns at L=512) over that many programs per
    (query, head block, K split): each recomputes the whole S tile (QK^T over L+R) but holds only
    NV/vsplit accumulators, e.g. [64, 256] fp32 = 128 registers/thread at 4 warps for vsplit=2, so one
    warpgroup computes S once (8 warps compute it twice, see the module docstring) and the grid has
    vsplit x the programs (batch 64 fills 132 SMs without split-K and its fp32 partials + combine).
    `block_h` < 64 splits the heads instead (M = 16/32 dots: mma.sync, not wgmma, but no recompute)."""

    block_n: int = 0  # keys per tile; 0: 64 from 8 queries up, 32 below (H200 sweep)
    warps: int = 8  # 4 warps hold [64, 512] fp32 only with vsplit >= 2 (256 registers otherwise)
    stages: int = 2
    block_h: int = 0  # heads per program; 0: min(64, next_pow2(H))
    vsplit: int = 1  # value programs; the env's value falls back to gcd(vsplit, NV) for other shapes
    splits: int = 0  # K splits; 0: pick_splits_heads over all Tq x head-block x value programs

    def __post_init__(self) -> None:
        for name in ("block_n", "block_h"):
            v = getattr(self, name)
            check(
                v == 0 or (v >= 16 and v & (v - 1) == 0),
                f"heads knob {name}: 0 or a power of two >= 16 ({self})",
            )
        check(self.warps in (1, 2, 4, 8, 16, 32) and self.stages >= 1, f"bad heads knobs ({self})")
        check(self.vsplit in (1, 2, 3, 4) and self.splits >= 0, f"bad heads knobs ({self})")

    def spec(self) -> str:
        """The LONGCTX_SPARSE_MLA_HEADS string of these knobs."""
        return knobs_spec(self)

    @classmethod
    def parse(cls, spec: str, base: HeadsKnobs | None = None) -> HeadsKnobs:
        """`base` (default: the defaults) with the fields named in "name=int,..." replaced."""
        return parse_knobs(cls, spec, base, "sparse MLA heads knob")  # type: ignore[no-any-return]


# LONGCTX_SPARSE_MLA_HEADS ("block_n=64,warps=4,vsplit=2", any subset) overrides the defaults for a process.
HEADS_KNOBS = HeadsKnobs.parse(os.environ.get("LONGCTX_SPARSE_MLA_HEADS", ""))
# A single query (batch-1 decode) splits the value columns over 4 programs of 4 warps, 32 keys a tile:
# 15.7 vs 19.9 us kernel-only and 11.4 vs 15.4 us a layer inside the 128K decode graph on the H200
# (bench/results/smla-sweep-h200.md); from 8 queries up the defaults above win. The env var overrides
# this too.
HEADS_KNOBS_ONE_QUERY = HeadsKnobs.parse(
    os.environ.get("LONGCTX_SPARSE_MLA_HEADS", ""), base=HeadsKnobs(block_n=32, warps=4, vsplit=4)
)


@jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b with fp32 accumulation (F32: exact fp32 operands, for fp32 models and the interpreter,
    whose bf16 dot is broken; see fp8_gemm.mma)."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@jit
def _load_q(base, offs_h, mask_h, s_h, J, L: tl.constexpr, BLOCK_V: tl.constexpr):
    offs_v = J * BLOCK_V + tl.arange(0, BLOCK_V)
    return tl.load(
        base + offs_h[:, None] * s_h + offs_v[None, :],
        mask=mask_h[:, None] & (offs_v < L)[None, :],
        other=0.0,
    )


@jit
def _load_kv(
    lat_ptr, scl_ptr, row, valid, s_lat, s_scl, scl_off,
    J, L: tl.constexpr, BLOCK_V: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """Value block J of the gathered rows, [BLOCK_N, BLOCK_V], dequantised (fp32 for fp8 pools). The block
    lies inside scale group (J * BLOCK_V) // GROUP, so its scale is one [BLOCK_N] vector."""
    offs_v = J * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.load(
        lat_ptr + row[:, None] * s_lat + offs_v[None, :],
        mask=valid[:, None] & (offs_v < L)[None, :],
        other=0.0,
    )
    if FP8:
        sc = tl.load(scl_ptr + row * s_scl + scl_off + (J * BLOCK_V) // GROUP, mask=valid, other=0.0)
        c = c.to(tl.float32) * sc[:, None]
    return c


@jit
def _store_o(obase, o, mask_h, J, L: tl.constexpr, BLOCK_V: tl.constexpr):
    offs_v = J * BLOCK_V + tl.arange(0, BLOCK_V)
    tl.store(
        obase + offs_v[None, :], o.to(obase.dtype.element_ty), mask=mask_h[:, None] & (offs_v < L)[None, :]
    )


@jit
def _rotated_q(qbase, s_h, cos_row, sin_row, offs_h, mask_h, BLOCK_H: tl.constexpr, R2: tl.constexpr,
               INTERLEAVED: tl.constexpr):  # fmt: skip
    """[BLOCK_H, 2 * R2] rope part of the query rows, rotated as `kernels.rope` rotates it: the pairs
    (2j, 2j+1) (INTERLEAVED) or (j, R2 + j) in, cat(rotated firsts, rotated seconds) out, each product and
    sum rounded to the query dtype."""
    j = tl.arange(0, R2)
    c = tl.load(cos_row + j).to(tl.float32)
    s = tl.load(sin_row + j).to(tl.float32)
    rows = qbase + offs_h[:, None] * s_h
    if INTERLEAVED:
        a = tl.load(rows + 2 * j[None, :], mask=mask_h[:, None], other=0.0)
        b = tl.load(rows + 2 * j[None, :] + 1, mask=mask_h[:, None], other=0.0)
    else:
        a = tl.load(rows + j[None, :], mask=mask_h[:, None], other=0.0)
        b = tl.load(rows + R2 + j[None, :], mask=mask_h[:, None], other=0.0)
    ra, rb = _rotate(a, b, c[None, :], s[None, :])
    both = tl.join(ra.to(a.dtype), rb.to(a.dtype))  # [BH, R2, 2]
    return tl.reshape(tl.permute(both, (0, 2, 1)), (BLOCK_H, 2 * R2))


@jit
def sparse_mla_heads_kernel(
    ql_ptr, qr_ptr, idx_ptr, lat_ptr, rope_ptr, scl_ptr, o_ptr, lse_ptr,
    qk_scale, H, K, CHUNK, N_HB, N_VP,
    s_qlt, s_qlh, s_qrt, s_qrh, s_it,
    s_lat, s_rope, s_scl, rope_off, scl_off,
    s_ot, s_oh, s_os, s_lt, s_lh, s_ls,
    L: tl.constexpr, R: tl.constexpr, BLOCK_V: tl.constexpr, NV: tl.constexpr, NV_OWN: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, F32: tl.constexpr,
    cos_ptr=None, sin_ptr=None, s_cos=0, s_sin=0,
    ROPE: tl.constexpr = False, INTERLEAVED: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # grid (Tq * N_HB * N_VP, splits), value program fastest, then head block: the programs gathering one
    # query's rows run side by side and share them through L2. N_HB = 1 whenever H <= BLOCK_H (64) and
    # N_VP = NV / NV_OWN = 1 by default, i.e. one program per (query, split).
    # A program scores against all NV value blocks (S needs the whole latent) but accumulates only its
    # own NV_OWN of them: blocks are visited from its first own block on, b_j = (vb + j) % NV, so the
    # tiles c_0 .. c_{NV_OWN-1} loaded for S are the ones it multiplies by P.
    pid = tl.program_id(0)
    if NV_OWN < NV:
        vb = (pid % N_VP) * NV_OWN
        pid = pid // N_VP
    else:
        vb = 0
    t = (pid // N_HB).to(tl.int64)  # int64: Tq * H * L passes 2**31 in long prefill chunks
    pid_h = pid % N_HB
    sp = tl.program_id(1)
    b1 = (vb + 1) % NV
    b2 = (vb + 2) % NV
    b3 = (vb + 3) % NV
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    qbase = ql_ptr + t * s_qlt
    # Query blocks, loop-invariant (the compiler keeps them in shared memory as wgmma A operands).
    q0 = _load_q(qbase, offs_h, mask_h, s_qlh, vb, L, BLOCK_V)
    q1 = q0
    q2 = q0
    q3 = q0
    if NV > 1:
        q1 = _load_q(qbase, offs_h, mask_h, s_qlh, b1, L, BLOCK_V)
    if NV > 2:
        q2 = _load_q(qbase, offs_h, mask_h, s_qlh, b2, L, BLOCK_V)
    if NV > 3:
        q3 = _load_q(qbase, offs_h, mask_h, s_qlh, b3, L, BLOCK_V)
    if ROPE:
        # q_rope arrives unrotated: rotate it here (kernels.rope's numerics, bit for bit), once per program
        # and off the key loop, instead of a rope launch before this kernel (R == BLOCK_R, the wrapper checks)
        qr = _rotated_q(qr_ptr + t * s_qrt, s_qrh, cos_ptr + t * s_cos, sin_ptr + t * s_sin, offs_h, mask_h,
                        BLOCK_H, BLOCK_R // 2, INTERLEAVED)  # fmt: skip
    else:
        qr = tl.load(
            qr_ptr + t * s_qrt + offs_h[:, None] * s_qrh + offs_r[None, :],
            mask=mask_h[:, None] & mask_r[None, :],
            other=0.0,
        )  # [BH, BR]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Unused accumulators (NV_OWN < 4) are carried unchanged and folded away by the compiler.
    acc0 = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    k_lo = sp * CHUNK
    k_hi = tl.minimum(k_lo + CHUNK, K)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * s_it + offs_n, mask=offs_n < k_hi, other=-1)
        valid = idx >= 0
        row = tl.where(valid, idx, 0).to(tl.int64)
        r = tl.load(
            rope_ptr + row[:, None] * s_rope + rope_off + offs_r[None, :],
            mask=valid[:, None] & mask_r[None, :],
            other=0.0,
        ).to(qr.dtype)  # [BN, BR]
        # S = Q_rope R^T + sum_j Q_j C_j^T, one accumulator chained through the wgmmas: [BH, BN]
        s = _dot(qr, tl.trans(r), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), F32)
        c0 = _load_kv(lat_ptr, scl_ptr, row, valid, s_lat, s_scl, scl_off, vb, L, BLOCK_V, FP8, GROUP)
        c0 = c0.to(q0.dtype)
        s = _dot(q0, tl.trans(c0), s, F32)
        c1 = c0
        c2 = c0
        c3 = c0
        if NV > 1:
            c1 = _load_kv(lat_ptr, scl_ptr, row, valid, s_lat, s_scl, scl_off, b1, L, BLOCK_V, FP8, GROUP)
            c1 = c1.to(q0.dtype)
            s = _dot(q1, tl.trans(c1), s, F32)
        if NV > 2:
            c2 = _load_kv(lat_ptr, scl_ptr, row, valid, s_lat, s_scl, scl_off, b2, L, BLOCK_V, FP8, GROUP)
            c2 = c2.to(q0.dtype)
            s = _dot(q2, tl.trans(c2), s, F32)
        if NV > 3:
            c3 = _load_kv(lat_ptr, scl_ptr, row, valid, s_lat, s_scl, scl_off, b3, L, BLOCK_V, FP8, GROUP)
            c3 = c3.to(q0.dtype)
            s = _dot(q3, tl.trans(c3), s, F32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-padding so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        pb = p.to(q0.dtype)  # one P for every value block
        acc0 = _dot(pb, c0, acc0 * alpha[:, None], F32)
        if NV_OWN > 1:
            acc1 = _dot(pb, c1, acc1 * alpha[:, None], F32)
        if NV_OWN > 2:
            acc2 = _dot(pb, c2, acc2 * alpha[:, None], F32)
        if NV_OWN > 3:
            acc3 = _dot(pb, c3, acc3 * alpha[:, None], F32)
    has = l_i > 0.0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    obase = o_ptr + t * s_ot + sp * s_os + offs_h[:, None] * s_oh
    _store_o(obase, acc0 * inv[:, None], mask_h, vb, L, BLOCK_V)
    if NV_OWN > 1:
        _store_o(obase, acc1 * inv[:, None], mask_h, b1, L, BLOCK_V)
    if NV_OWN > 2:
        _store_o(obase, acc2 * inv[:, None], mask_h, b2, L, BLOCK_V)
    if NV_OWN > 3:
        _store_o(obase, acc3 * inv[:, None], mask_h, b3, L, BLOCK_V)
    lse_mask = mask_h
    if NV_OWN < NV:
        lse_mask = mask_h & ((offs_h * 0 + vb) == 0)  # every value program has the same lse; one writes it
    tl.store(lse_ptr + t * s_lt + offs_h * s_lh + sp * s_ls, lse, mask=lse_mask)


def heads_blocks(L: int, group: int, fp8: bool) -> tuple[int, int]:
    """(BLOCK_V, NV): power-of-two value blocks (>= 16, <= 128), at most MAX_NV of them covering L; for fp8
    pools BLOCK_V divides the scale group so a block has one scale per row."""
    bv = min(128, max(16, next_pow2(cdiv(L, MAX_NV))))
    if fp8:
        while bv > 16 and group % bv:
            bv //= 2
        check(group % bv == 0, f"sparse_mla impl='heads': fp8 group {group} is not a multiple of 16")
    nv = cdiv(L, bv)
    check(nv <= MAX_NV, f"sparse_mla impl='heads': L={L} needs {nv} > {MAX_NV} value blocks of {bv}")
    return bv, nv


def pick_splits_heads(programs: int, k: int, block_n: int, num_sms: int) -> int:
    """K splits for `programs` (query, head block) programs at one CTA per SM: least wave-time, counted as
    ceil(programs * splits / SMs) waves x key tiles per split (after the wrapper rounds a split to whole
    tiles), fewest splits on ties; each split >= 2 key tiles so the next gather overlaps this tile's dots.
    Top-2048, BLOCK_N=32: batch 64 -> 2 splits (128 CTAs, one wave), batch 8 -> 16, batch 1 -> 32."""
    if programs >= num_sms:
        return 1  # prefill: many waves already
    tiles = cdiv(k, block_n)
    best: tuple[int, int] = (tiles * cdiv(programs, num_sms), 1)
    for s in range(2, max(1, cdiv(k, 2 * block_n)) + 1):
        per = cdiv(tiles, s)
        eff = cdiv(tiles, per)
        best = min(best, (cdiv(programs * eff, num_sms) * per, eff))
    return best[1]
