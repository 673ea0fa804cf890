"""Absorbed-form sparse MLA: attention of each query over its own selected KV rows (DSA).

Math, per query t and head h, over the valid entries k of indices[t] (index >= 0):
    s_k    = sm_scale * (q_latent[t, h] . c_k + q_rope[t, h] . r_k)        c = latent row (L), r = rope row (R)
    o[t,h] = sum_k softmax(s)_k * c_k                                       (fp32 accumulation)
    lse    = log(sum_k exp(s_k))                                            (natural log; -inf when nothing valid)
q_latent is q_nope already multiplied by W_UK (in latent space); the caller multiplies o by W_UV and o_proj.
A query with no valid index yields o = 0 and lse = -inf. Indices are PHYSICAL slot rows of `kv_pool`; a
valid index >= num_slots is undefined behaviour (the Triton kernel does not bounds-check it).

KV pool layouts (one row per token slot), chosen by `kind`:
  "fp8_e4m3" / "fp8" (kernels.kv_layout's writer): uint8 [num_slots, row_bytes], G = min(128, L),
    row_bytes = L + 4*(L/G) + 2*R:
      bytes [0, L)                  L x float8_e4m3fn latent, in groups of G columns
      bytes [L, L + 4*L/G)          L/G fp32 scales; latent[j] = fp8[j] * scale[j // G]
      bytes [L + 4*L/G, row_bytes)  R x bf16 rope key
    For L=512, R=64 this is the 656-byte token of DESIGN.md. Rows must be 4-byte aligned (row stride and
    row_bytes multiples of 4), which L % 4 == 0 and R % 2 == 0 guarantee.
  "auto" / "model" / "bf16" / "fp16" / "fp32": [num_slots, >= L+R] in a float dtype, latent in columns
    [0, L), rope in [L, L+R); unit column stride, any row stride.

Triton kernel `_sparse_mla_kernel`, one program per (query, head block of BLOCK_H heads, K split); grid
(Tq * H/BLOCK_H, num_splits), head block fastest so one query's programs share its rows in L2:
  * decode form (num_splits > 1, "flash-decoding"): split s handles indices[t, s*chunk : (s+1)*chunk] and
    writes a normalised partial output and its lse to fp32 scratch; `_combine_kernel` (one program per
    (query, head, 128 latent columns)) merges the splits. This is what fills 132 SMs at batch 1 (64 heads, top-2048).
  * prefill form (num_splits == 1): the same kernel, grid (Tq * H/BLOCK_H, 1), writes o/lse directly.
fp8 rows are dequantised in the load (the [BLOCK_N, L/G] scales are broadcast over a [BLOCK_N, L/G, G] view of
the tile, which is then cast to the query dtype for the tensor cores). L and R are padded to powers of two (>= 16) with masks, so tiny test
dims (32/8, 64/16) and 512/64 share one kernel.

`impl="heads"` (the default through impl="auto"; kernels.sparse_mla_heads): one program per (query, K split) with all heads in the M
dimension of the dots (64 heads -> M = 64, wgmma-sized) and the latent cut into <= 4 value blocks of 128; each
key tile is gathered once per query instead of once per head block. Same splits/combine and semantics.
"""

from __future__ import annotations

import math
import os

import torch

from .common import (
    check,
    jit,
    lse_weights,
    next_pow2,
    num_sms,
    pdl,
    pdl_wait,
    tl,
    triton_interpret,
    use_triton,
)
from .fp8_gemm import cdiv, mma
from .gemv import head_gemv, head_gemv_ref, merge_head_gemv
from .kv_layout import is_fp8, mla_group_size, mla_row_bytes, read_mla_kv_ref
from .rope import apply_rope, apply_rope_ref
from .sparse_mla_heads import (
    HEADS_KNOBS,
    HEADS_KNOBS_ONE_QUERY,
    HeadsKnobs,
    heads_blocks,
    pick_splits_heads,
    sparse_mla_heads_kernel,
)

_LOG2E = 1.4426950408889634
IMPLS = ("split", "heads")
# impl="auto": "heads" from this many queries up, "split" below. H200, GLM-5.3 shapes (64 heads, fp8,
# top-2048; bench/results/kernels-h200.md): heads is as fast at batch 1 inside a graph (22.3 vs 22.8 us)
# and faster from batch 8 (35 vs 132 us), 64 (195 vs 608 us) and an 8192-query prefill chunk (13.7 vs
# 63.7 ms), so it is used everywhere. LONGCTX_SPARSE_MLA_IMPL (split | heads | auto) overrides for benches.
HEADS_MIN_QUERIES = 1


# (cos [Tq, R/2], sin [Tq, R/2], interleaved) of a q_rope passed unrotated (`kernels.rope`'s arguments)
QueryRope = tuple[torch.Tensor, torch.Tensor, bool]


# `sparse_mla(out_proj=)` with one query over K splits: merge the splits inside the projection's GEMV
# (`gemv.merge_head_gemv`); LONGCTX_SPARSE_MLA_MERGE=0: the combine kernel, then `gemv.head_gemv` (A/B benches).
MERGE_IN_PROJ = os.environ.get("LONGCTX_SPARSE_MLA_MERGE", "1").strip() != "0"


def resolve_impl(impl: str, tq: int) -> str:
    """The kernel variant `impl` means for `tq` queries ("auto" -> HEADS_MIN_QUERIES, or the env override)."""
    if impl == "auto":
        impl = os.environ.get("LONGCTX_SPARSE_MLA_IMPL", "auto")
        check(
            impl in IMPLS + ("auto",), f"LONGCTX_SPARSE_MLA_IMPL must be split, heads or auto, got {impl!r}"
        )
    if impl == "auto":
        impl = "heads" if tq >= HEADS_MIN_QUERIES else "split"
    return impl


def _check(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv_pool: torch.Tensor, indices: torch.Tensor, kind: str
) -> tuple[int, int, int, int, int]:
    check(
        q_latent.dim() == 3 and q_rope.dim() == 3, "sparse_mla: q_latent/q_rope must be [Tq, H, L]/[Tq, H, R]"
    )
    tq, h, L = q_latent.shape
    R = q_rope.shape[2]
    check(tuple(q_rope.shape[:2]) == (tq, h), "sparse_mla: q_latent and q_rope disagree on [Tq, H]")
    check(q_latent.dtype == q_rope.dtype and q_latent.is_floating_point(), "sparse_mla: q dtypes must match")
    check(indices.dim() == 2 and indices.shape[0] == tq, f"sparse_mla: indices must be [Tq={tq}, K]")
    check(indices.dtype in (torch.int32, torch.int64), "sparse_mla: indices must be int32 or int64")
    check(kv_pool.dim() == 2, "sparse_mla: kv_pool must be [num_slots, row]")
    if is_fp8(kind):
        check(kv_pool.dtype == torch.uint8, "sparse_mla: fp8 kv_pool must be uint8 rows")
        rb = mla_row_bytes(L, R, kind)
        check(
            kv_pool.shape[1] == rb,
            f"sparse_mla: fp8 rows of L={L}, R={R} are {rb} bytes, got {kv_pool.shape[1]}",
        )
    else:
        check(kv_pool.is_floating_point(), f"sparse_mla: kind {kind!r} needs a float kv_pool")
        check(kv_pool.shape[1] >= L + R, f"sparse_mla: kv_pool rows shorter than L+R={L + R}")
    check(
        q_latent.device == q_rope.device == kv_pool.device == indices.device,
        "sparse_mla: tensors on different devices",
    )
    return tq, h, L, R, indices.shape[1]


def sparse_mla_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pool: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kind: str = "auto",
    return_lse: bool = False,
    rotate: QueryRope | None = None,
    out_proj: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: gather rows, dequantise, fp32 softmax. Returns o [Tq, H, L] in q's dtype (+ lse fp32).
    `rotate` = (cos [Tq, R/2], sin [Tq, R/2], interleaved): q_rope is not rotated yet; it is rotated first
    (`kernels.rope.apply_rope_ref`). `out_proj` w [H, V, L] (MLA's W_UV): returns `head_gemv_ref(o, w)`
    [Tq, H, V] instead of o (no lse)."""
    tq, h, L, R, k = _check(q_latent, q_rope, kv_pool, indices, kind)
    _check_out_proj(out_proj, q_latent, return_lse)
    if rotate is not None:
        q_rope = apply_rope_ref(q_rope, rotate[0], rotate[1], R, rotate[2])
    out = torch.zeros(tq, h, L, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((tq, h), -math.inf, dtype=torch.float32, device=q_latent.device)
    # Query chunks bound the gathered [chunk, K, L+R] fp32 copy to ~64M elements.
    step = max(1, (64 << 20) // max(1, k * (L + R)))
    for t0 in range(0, tq, step):
        idx = indices[t0 : t0 + step].long()
        valid = idx >= 0  # [t, K]
        if is_fp8(kind):
            lat, rope = read_mla_kv_ref(kv_pool, idx.clamp(min=0).reshape(-1), kind, torch.float32, L)
            lat, rope = lat.view(*idx.shape, L), rope.view(*idx.shape, R)
        else:
            rows = kv_pool[idx.clamp(min=0)]  # [t, K, row]
            lat, rope = rows[..., :L].float(), rows[..., L : L + R].float()
        s = torch.einsum("thl,tkl->thk", q_latent[t0 : t0 + step].float(), lat)
        s = (s + torch.einsum("thr,tkr->thk", q_rope[t0 : t0 + step].float(), rope)) * sm_scale
        s = s.masked_fill(~valid[:, None, :], -math.inf)
        m = torch.logsumexp(s, dim=-1)  # [t, H], -inf for a query with nothing valid
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])  # exp(-inf) = 0 for padding
        out[t0 : t0 + step] = torch.einsum("thk,tkl->thl", p, lat)
        lse[t0 : t0 + step] = m
    o = out.to(q_latent.dtype)
    if out_proj is not None:
        return head_gemv_ref(o, out_proj)
    return (o, lse) if return_lse else o


def _check_out_proj(w: torch.Tensor | None, q_latent: torch.Tensor, return_lse: bool) -> None:
    if w is None:
        return
    h, L = q_latent.shape[1], q_latent.shape[2]
    check(not return_lse, "sparse_mla: out_proj returns no lse")
    check(
        w.dim() == 3
        and w.shape[0] == h
        and w.shape[2] == L
        and w.dtype == q_latent.dtype
        and w.stride(2) == 1,
        f"sparse_mla: out_proj must be [{h}, V, {L}] in q's dtype with a unit last stride, got "
        f"{tuple(w.shape)} {w.dtype}",
    )


@jit
def _sparse_mla_kernel(
    ql_ptr, qr_ptr, idx_ptr, lat_ptr, rope_ptr, scl_ptr, o_ptr, lse_ptr,
    qk_scale, H, K, CHUNK, N_HB,
    s_qlt, s_qlh, s_qrt, s_qrh, s_it,
    s_lat, s_rope, s_scl, rope_off, scl_off,
    s_ot, s_oh, s_os, s_lt, s_lh, s_ls,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
    NG: tl.constexpr, NG_PAD: tl.constexpr, SCALE_GATHER: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    # Axis 0 = (query, head block) with the head block fastest, so the programs reading one query's rows
    # run side by side and share them through L2; axis 1 = K split.
    pid = tl.program_id(0)
    t = (pid // N_HB).to(tl.int64)  # int64: Tq * H * L passes 2**31 in long prefill chunks
    pid_h = pid % N_HB
    sp = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    mask_l = offs_l < L
    mask_r = offs_r < R
    ql = tl.load(
        ql_ptr + t * s_qlt + offs_h[:, None] * s_qlh + offs_l[None, :],
        mask=mask_h[:, None] & mask_l[None, :],
        other=0.0,
    )  # [BH, BL]
    qr = tl.load(
        qr_ptr + t * s_qrt + offs_h[:, None] * s_qrh + offs_r[None, :],
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    )  # [BH, BR]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    k_lo = sp * CHUNK
    k_hi = tl.minimum(k_lo + CHUNK, K)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * s_it + offs_n, mask=offs_n < k_hi, other=-1)
        valid = idx >= 0
        row = tl.where(valid, idx, 0).to(tl.int64)
        c = tl.load(
            lat_ptr + row[:, None] * s_lat + offs_l[None, :],
            mask=valid[:, None] & mask_l[None, :],
            other=0.0,
        )  # [BN, BL]
        if FP8:
            if NG == 1:  # one scale per row
                sc1 = tl.load(scl_ptr + row * s_scl + scl_off, mask=valid, other=0.0)
                c = (c.to(tl.float32) * sc1[:, None]).to(ql.dtype)
            elif SCALE_GATHER:  # a scale load per element (L1 hits); kept as a bench alternative
                sc = tl.load(
                    scl_ptr + row[:, None] * s_scl + scl_off + offs_l[None, :] // GROUP,
                    mask=valid[:, None] & mask_l[None, :],
                    other=0.0,
                )
                c = (c.to(tl.float32) * sc).to(ql.dtype)
            else:  # [BN, NG] scales broadcast over [BN, NG, GROUP] (BLOCK_L == NG_PAD * GROUP)
                offs_g = tl.arange(0, NG_PAD)
                scg = tl.load(
                    scl_ptr + row[:, None] * s_scl + scl_off + offs_g[None, :],
                    mask=valid[:, None] & (offs_g < NG)[None, :],
                    other=0.0,
                )
                c3 = tl.reshape(c.to(tl.float32), (BLOCK_N, NG_PAD, GROUP)) * scg[:, :, None]
                c = tl.reshape(c3, (BLOCK_N, BLOCK_L)).to(ql.dtype)
        else:
            c = c.to(ql.dtype)
        r = tl.load(
            rope_ptr + row[:, None] * s_rope + rope_off + offs_r[None, :],
            mask=valid[:, None] & mask_r[None, :],
            other=0.0,
        ).to(qr.dtype)  # [BN, BR]
        s = mma(ql, tl.trans(c), F32) + mma(qr, tl.trans(r), F32)  # [BH, BN]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-padding so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(c.dtype), c, F32)
        m_i = m_new
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(
        o_ptr + t * s_ot + offs_h[:, None] * s_oh + sp * s_os + offs_l[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=mask_h[:, None] & mask_l[None, :],
    )
    tl.store(lse_ptr + t * s_lt + offs_h * s_lh + sp * s_ls, lse, mask=mask_h)


@jit
def _combine_kernel(
    op_ptr, lp_ptr, o_ptr, lse_ptr, S, L,
    s_opt, s_oph, s_ops, s_lpt, s_lph, s_ot, s_oh, s_lt,
    BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One program per (query, head, BLOCK_L slice of the latent): at batch 1 the 64 heads alone
    would leave half the SMs idle while each program walked all 512 columns."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    lb = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(lp_ptr + t * s_lpt + h * s_lph + offs_s, mask=offs_s < S, other=float("-inf"))
    w, m, tot = lse_weights(lse_s)  # (0 for empty splits)
    base = op_ptr + t * s_opt + h * s_oph
    offs_l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    part = tl.load(
        base + offs_s[:, None] * s_ops + offs_l[None, :],
        mask=(offs_s[:, None] < S) & (offs_l[None, :] < L),
        other=0.0,
    )
    o = tl.sum(part * w[:, None], axis=0)
    tl.store(o_ptr + t * s_ot + h * s_oh + offs_l, o.to(o_ptr.dtype.element_ty), mask=offs_l < L)
    if lb == 0:
        tl.store(lse_ptr + t * s_lt + h, tl.where(tot > 0.0, m + tl.log(tl.where(tot > 0.0, tot, 1.0)), m))


def _pick_splits(tq: int, n_hb: int, k: int, block_n: int, num_sms: int) -> int:
    """Decode split-K: programs for ~1 wave of 132 SMs (one 8-warp CTA of this kernel per SM: ~200 registers
    per thread), each split at least 64 tokens (2 BLOCK_N=32 tiles, so the gather of the next tile overlaps
    the dots of this one). Batch 1 / 64 heads / top-2048: 4 head blocks x 32 splits = 128 CTAs of 64 rows
    (the old >= 128-token rule gave 64 CTAs, half the SMs idle). The fp32 partials, S x H x L x 4 bytes
    (4 MB at S=32), stay in the 50 MB L2 between the two kernels."""
    base = tq * n_hb
    if base >= num_sms:
        return 1
    return max(1, min(cdiv(k, max(64, 2 * block_n)), cdiv(num_sms, base)))


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_pool: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kind: str = "auto",
    return_lse: bool = False,
    *,
    backend: str = "auto",
    impl: str = "auto",
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    scale_gather: bool = False,
    value_split: int | None = None,
    knobs: HeadsKnobs | None = None,
    rotate: QueryRope | None = None,
    out_proj: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA with the contract of `sparse_mla_ref` (layouts in the module docstring); Triton when
    `common.use_triton(backend, device)` says so, else the reference.

    q_latent [Tq, H, L], q_rope [Tq, H, R]: same float dtype, unit last stride. indices [Tq, K] int32/int64,
    unit last stride. `num_splits=None` picks the decode split-K so the grid covers ~2 waves of SMs; 1 is the
    prefill form. The keyword-only tile knobs are for the bench; None picks defaults for the shape.
    `impl`: "split" (BLOCK_H heads of one query per program), "heads" (all heads of a query per program,
    value dim in 128-column blocks; kernels.sparse_mla_heads) or "auto" (`resolve_impl`). block_h caps the heads per program
    (heads default 64); scale_gather applies to "split" only. impl="heads" takes its defaults from `knobs`
    (default `sparse_mla_heads.HEADS_KNOBS`, or `HEADS_KNOBS_ONE_QUERY` for a single query; env
    LONGCTX_SPARSE_MLA_HEADS overrides both); the keyword knobs override them,
    value_split (value programs per query, dividing the 128-column value blocks) included.
    `rotate` (as `sparse_mla_ref`'s): q_rope is unrotated; impl="heads" rotates it in its prologue when R is
    a power of two >= 16 (a decode step's rope launch fewer), otherwise `kernels.rope` rotates it first.
    """
    check(impl in IMPLS + ("auto",), f"sparse_mla: impl must be one of {IMPLS} or auto, got {impl!r}")
    if not use_triton(backend, q_latent.device):
        return sparse_mla_ref(
            q_latent, q_rope, kv_pool, indices, sm_scale, kind, return_lse, rotate, out_proj
        )
    tq, h, L, R, k = _check(q_latent, q_rope, kv_pool, indices, kind)
    _check_out_proj(out_proj, q_latent, return_lse)
    impl = resolve_impl(impl, tq)
    fuse_rope = False
    if rotate is not None:
        cos, sin, interleaved = rotate
        fuse_rope = impl == "heads" and R >= 16 and next_pow2(R) == R
        if fuse_rope:
            for name, v in (("cos", cos), ("sin", sin)):
                check(
                    v.shape == (tq, R // 2) and v.stride(1) == 1 and v.dtype == q_rope.dtype and v.device == q_rope.device,
                    f"sparse_mla: rope {name} must be [{tq}, {R // 2}] in q's dtype with unit column stride",
                )  # fmt: skip
        else:
            q_rope = apply_rope(q_rope, cos, sin, R, interleaved, backend="triton")
    check(q_latent.stride(2) == 1 and q_rope.stride(2) == 1, "sparse_mla: q needs unit last stride")
    check(indices.stride(1) == 1 or k <= 1, "sparse_mla: indices need unit last stride")
    check(kv_pool.stride(1) == 1, "sparse_mla: kv_pool needs unit column stride")
    dev = q_latent.device
    o = torch.empty(tq, h, L, dtype=q_latent.dtype, device=dev)
    lse = torch.empty(tq, h, dtype=torch.float32, device=dev)
    if tq == 0 or h == 0 or k == 0:
        if k == 0:  # (nothing selected: o 0, lse -inf; torch launches nothing for empty tensors)
            o.zero_()
            lse.fill_(-math.inf)
        if out_proj is not None:
            return head_gemv(o, out_proj, backend="triton")
        return (o, lse) if return_lse else o

    fp8 = is_fp8(kind)
    if fp8:
        check(
            kv_pool.stride(0) % 4 == 0 and kv_pool.shape[1] % 4 == 0 and kv_pool.storage_offset() % 4 == 0,
            "sparse_mla: fp8 rows must be 4-byte aligned (L % 4 == 0, R % 2 == 0)",
        )
        lat = kv_pool.view(torch.float8_e4m3fn)
        scl = kv_pool.view(torch.float32)  # [N, row_bytes/4]
        rope = kv_pool.view(torch.bfloat16)  # [N, row_bytes/2]
        s_lat, s_scl, s_rope = kv_pool.stride(0), kv_pool.stride(0) // 4, kv_pool.stride(0) // 2
        group = mla_group_size(L)
        scl_off, rope_off = L // 4, (L + 4 * (L // group)) // 2
    else:
        lat = scl = rope = kv_pool
        s_lat = s_scl = s_rope = kv_pool.stride(0)
        scl_off, rope_off, group = 0, L, 1
    ng = L // group if fp8 else 1  # scale groups per row

    block_l = max(16, next_pow2(L))
    block_r = max(16, next_pow2(R))
    n_vp = 1
    if impl == "heads":
        kn = knobs or (HEADS_KNOBS_ONE_QUERY if tq == 1 else HEADS_KNOBS)
        block_v, nv = heads_blocks(L, group, fp8)
        if value_split is None:
            n_vp = math.gcd(kn.vsplit, nv)  # a knob set for L=512 still launches at other shapes
        else:
            n_vp = value_split
            check(n_vp >= 1 and nv % n_vp == 0, f"sparse_mla: value_split {n_vp} must divide {nv} blocks")
        bh = block_h or kn.block_h or min(64, max(16, next_pow2(h)))
        bn = block_n or kn.block_n or (64 if tq >= 8 else 32)  # H200: 64 wins from batch 8 up, 32 ~ 16 at 1
        num_splits = num_splits or kn.splits or None
        num_warps = num_warps or kn.warps
        num_stages = num_stages or kn.stages
    else:
        bh = block_h or min(32 if block_l <= 256 else 16, max(16, next_pow2(h)))
        bn = block_n or (32 if block_l >= 512 else 64)
    n_hb = cdiv(h, bh)
    if num_splits is None:
        if impl == "heads":
            num_splits = pick_splits_heads(tq * n_hb * n_vp, k, bn, num_sms(dev))
        else:
            num_splits = _pick_splits(tq, n_hb, k, bn, num_sms(dev))
    num_splits = max(1, min(num_splits, cdiv(k, bn)))
    chunk = cdiv(cdiv(k, num_splits), bn) * bn
    num_splits = cdiv(k, chunk)
    warps = num_warps or (8 if block_l >= 512 else 4)
    stages = num_stages or 2
    f32 = q_latent.dtype == torch.float32 or triton_interpret()
    qk_scale = float(sm_scale) * _LOG2E

    if num_splits == 1:
        o_dst, l_dst = o.unsqueeze(2), lse.unsqueeze(2)  # [Tq, H, 1, L], [Tq, H, 1]
    else:
        o_dst = torch.empty(tq, h, num_splits, L, dtype=torch.float32, device=dev)
        l_dst = torch.empty(tq, h, num_splits, dtype=torch.float32, device=dev)
    if impl == "heads":
        sparse_mla_heads_kernel[(tq * n_hb * n_vp, num_splits)](
            q_latent, q_rope, indices, lat, rope, scl, o_dst, l_dst,
            qk_scale, h, k, chunk, n_hb, n_vp,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), indices.stride(0),
            s_lat, s_rope, s_scl, rope_off, scl_off,
            o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), l_dst.stride(0), l_dst.stride(1), l_dst.stride(2),
            L=L, R=R, BLOCK_V=block_v, NV=nv, NV_OWN=nv // n_vp, BLOCK_R=block_r, BLOCK_H=bh, BLOCK_N=bn,
            FP8=fp8, GROUP=group, F32=f32, num_warps=num_warps, num_stages=num_stages, **pdl(dev),
            **(dict(cos_ptr=cos, sin_ptr=sin, s_cos=cos.stride(0), s_sin=sin.stride(0), ROPE=True,
                    INTERLEAVED=bool(interleaved)) if fuse_rope else {}),
        )  # fmt: skip
    else:
        _sparse_mla_kernel[(tq * n_hb, num_splits)](
            q_latent, q_rope, indices, lat, rope, scl, o_dst, l_dst,
            qk_scale, h, k, chunk, n_hb,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), indices.stride(0),
            s_lat, s_rope, s_scl, rope_off, scl_off,
            o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), l_dst.stride(0), l_dst.stride(1), l_dst.stride(2),
            L=L, R=R, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_H=bh, BLOCK_N=bn, FP8=fp8, GROUP=group,
            NG=ng, NG_PAD=next_pow2(ng), SCALE_GATHER=scale_gather, F32=f32,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    if num_splits > 1 and out_proj is not None and tq == 1 and MERGE_IN_PROJ:
        # one query (batch-1 decode): the splits merge inside W_UV's GEMV, no combine launch
        return merge_head_gemv(o_dst[0], l_dst[0], out_proj, backend="triton")
    if num_splits > 1:
        block_c = min(128, block_l)
        _combine_kernel[(tq, h, cdiv(L, block_c))](
            o_dst, l_dst, o, lse, num_splits, L,
            o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), l_dst.stride(0), l_dst.stride(1),
            o.stride(0), o.stride(1), lse.stride(0),
            BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_L=block_c, **pdl(dev),
        )  # fmt: skip
    if out_proj is not None:
        return head_gemv(o, out_proj, backend="triton")
    return (o, lse) if return_lse else o
