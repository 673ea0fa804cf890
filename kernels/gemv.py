"""Small-M linear layers (decode): y [M, N] = x [M, K] @ W [N, K]^T for M up to ~16 rows.

At decode a linear layer reads its whole weight to produce a handful of rows, so it is a weight
stream: the time is the weight's bytes over the HBM read rate, and the kernel's only job is to keep
enough wide loads in flight on every SM. The GEMM tilings (cuBLAS, `fp8_gemm.fp8_block_linear`) spend
their tiles on M instead; measured on the H200 they reach 0.3-0.7 of the read rate at M=1.

Weights (nothing repacked):
  plain  w [N, K] bf16 / fp16 / fp32, unit column stride; x must have the same dtype (as F.linear).
  fp8    w [N, K] float8_e4m3fn, unit column stride, with scale_inv [ceil(N/128), ceil(K/128)] fp32
         (the checkpoint's `weight_scale_inv`, layout as in `fp8_gemm`): dequant(w)[n, k] =
         float(w[n, k]) * scale_inv[n // 128, k // 128]; x is bf16 / fp16 / fp32 and stays unquantised
         (the weight-only contract of `fp8_block_linear_ref` without `quantize_act`, which the model
         never asks for).

One program owns BN output rows (all M of them) over a K range. Each K step loads a [BN, BK] tile of
W, K the unit-stride dimension, so a thread issues 16-byte loads along one row (8 bf16 or 16 e4m3);
the x tile [BM, BK] is tiny and stays in L1/L2. The product goes one of two ways (`dot`):
  * FMA: the tile in fp32 times x broadcast, summed over K in registers (no padding of M to the
    tensor cores' 16 rows, but Triton does not pipeline loads that feed no dot).
  * dot: swap-AB, W as the MMA's M side (acc [BN, BM] = W_tile @ x_tile^T, BM = 16), so N fills the
    128-row hardware tile and M only pads the narrow side.
With e4m3 W and bf16 x the tensor-core form runs in fp16 (`fp8_gemm.fp16_rows`: x rows scaled by powers of
two per K step; e4m3 -> fp16 is one conversion per two elements, -> bf16 three; the result is the same).
fp32 accumulation either way; an fp8 block's scale multiplies the [BN, BM] partial of its 128 columns
(BK divides 128, so a K step never straddles a scale block).

When N has too few BN-row slabs to give every SM several programs (weights_proj N=32, a small shared
expert, o_proj's N=2048 over K=16384), the K range is split: each program writes an fp32 partial
[S, M, N] and `_splitk_sum_kernel` adds them in split order (deterministic, no atomics). No
host sync and no host->device copy: safe inside CUDA graph capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .common import (
    check,
    jit,
    lse_weights,
    next_pow2,
    num_sms,
    pdl,
    pdl_wait,
    round_as,
    tl,
    triton_interpret,
    use_triton,
)
from .fp8_gemm import FP8_BLOCK, cdiv, fp8_block_linear_ref, fp16_rows, mma

# Up to this many rows the FMA form, above it the tensor cores (swap-AB `tl.dot`). 0: the tensor-core
# form always (its loads are cp.async-pipelined; the FMA form's are not). bench/gemm_shapes sweeps both.
FMA_MAX_M = 0
MAX_SPLITS = 16
# Programs to aim for per SM: a weight stream needs ~40 KB of loads in flight per SM to cover the
# HBM latency, more than one program's tile.
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class GemvConfig:
    """Tile choice: BN output rows x BK columns per K step, warps, pipeline stages, the FMA or the
    tensor-core form, and the split-K factor (None: enough programs for the SMs)."""

    bn: int
    bk: int
    warps: int = 4
    stages: int = 3
    dot: bool = False
    splits: int | None = None


def gemv_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference: x [M, K] @ W.T in fp32 -> [M, N] in out_dtype (default x's); W dequantised if fp8."""
    if scale_inv is not None:
        return fp8_block_linear_ref(x, w, scale_inv, out_dtype)
    _check(x, w, None)
    return (x.float() @ w.float().T).to(out_dtype or x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None) -> tuple[int, int, int]:
    check(
        x.dim() == 2 and w.dim() == 2, f"gemv: x [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}"
    )
    m, k = x.shape
    n = w.shape[0]
    check(w.shape[1] == k, f"gemv: x has K={k}, w has K={w.shape[1]}")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"gemv: x dtype {x.dtype}")
    if scale_inv is None:
        check(w.dtype == x.dtype, f"gemv: plain weights must have x's dtype ({x.dtype}), got {w.dtype}")
    else:
        check(w.dtype == torch.float8_e4m3fn, f"gemv: a weight with scale_inv must be e4m3, got {w.dtype}")
        want = (cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))
        check(
            tuple(scale_inv.shape) == want and scale_inv.dtype == torch.float32,
            f"gemv: scale_inv must be fp32 {want}, got {scale_inv.dtype} {tuple(scale_inv.shape)}",
        )
    return m, n, k


@jit
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, o_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_wsn, stride_om, stride_os,
    stride_xb, stride_wb, stride_ob,
    FP8: tl.constexpr, X16: tl.constexpr, DOT: tl.constexpr, F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # Program (pid_n, pid_k, pid_b): rows [pid_n*BN, +BN) over K in [pid_k*K_SPLIT, +K_SPLIT) (K_SPLIT a
    # multiple of 128) of batch entry pid_b (`head_gemv`'s head; one entry for `gemv`). Whole BK steps run
    # without a K mask, so the loads keep their 16-byte vectors (a mask that varies along K would split
    # them); the partial last step, if any, runs once with the mask.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    x_ptr += pid_b * stride_xb
    w_ptr += pid_b * stride_wb
    o_ptr += pid_b * stride_ob
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    ws_rows = ws_ptr + (offs_n // 128) * stride_wsn  # [BN] scale rows (unused unless FP8)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    k_full = k_lo + (k_hi - k_lo) // BK * BK
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_lo, k_full, BK):
        offs_k = k0 + tl.arange(0, BK)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)  # [BN, BK]
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)  # [BM, BK]
        acc += _partial(w, x, ws_rows, k0, mask_n, FP8, X16, DOT, F32)
    if k_full < k_hi:
        offs_k = k_full + tl.arange(0, BK)
        mask_k = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += _partial(w, x, ws_rows, k_full, mask_n, FP8, X16, DOT, F32)
    out = round_as(acc, tl.zeros([1], dtype=o_ptr.dtype.element_ty))  # the interpreter truncates in .to
    tl.store(
        o_ptr + pid_k.to(tl.int64) * stride_os + offs_m[None, :] * stride_om + offs_n[:, None],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_n[:, None] & mask_m[None, :],
    )


@jit
def _partial(
    w, x, ws_rows, k0, mask_n, FP8: tl.constexpr, X16: tl.constexpr, DOT: tl.constexpr, F32: tl.constexpr
):
    """[BN, BM] fp32 partial product of a W tile [BN, BK] and an x tile [BM, BK], block-scaled if FP8."""
    if DOT and X16:
        # e4m3 W, bf16 x: an fp16 MMA on x rows scaled by powers of two (`fp16_rows`), since e4m3 ->
        # fp16 is one conversion per two elements and e4m3 -> bf16 three; the powers come back exactly.
        x16, inv = fp16_rows(x)
        part = mma(w.to(tl.float16), tl.trans(x16), F32)
        part = part * tl.load(ws_rows + k0 // 128, mask=mask_n, other=0.0)[:, None] * inv[None, :]
    else:
        if DOT:
            # e4m3 values are exact in bf16/fp16/fp32, so the raw tile goes to the MMA in x's dtype
            part = mma(w.to(x.dtype), tl.trans(x), F32)
        else:
            part = tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
        if FP8:
            part = part * tl.load(ws_rows + k0 // 128, mask=mask_n, other=0.0)[:, None]
    return part


@jit
def _splitk_sum_kernel(p_ptr, o_ptr, S, MN, BLOCK: tl.constexpr):
    # out.flat[i] = sum_s partial[s].flat[i], in split order (deterministic, no atomics)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    out = round_as(acc, tl.zeros([1], dtype=o_ptr.dtype.element_ty))
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)


# Default tiles (bench/gemm_shapes.py --sweep times the alternatives; set the winners here).
# Tensor-core form: BN = 64 W rows (one warpgroup's wgmma M) by 128 bytes of K per step (BK 128 e4m3 =
# one scale block, or 64 bf16), 4 stages of cp.async in flight: 8 KB per stage, 40 KB of shared memory
# and 96 (fp8) / 40 (bf16) registers per 4-warp program (ptxas, sm_90a), so 5 programs per SM keep
# ~160 KB of loads in flight. FMA form: its loads are not pipelined by Triton (they feed no dot), so it
# relies on occupancy: 32 rows x 128 columns per step, 80 (fp8) / 64 (bf16) registers at M=1.
TILES_DOT_FP8 = GemvConfig(bn=64, bk=128, warps=4, stages=4, dot=True)
TILES_DOT_PLAIN = GemvConfig(bn=64, bk=64, warps=4, stages=4, dot=True)
TILES_FMA = GemvConfig(bn=32, bk=128, warps=4, stages=1, dot=False)


def pick_config(m: int, fp8: bool) -> GemvConfig:
    """The default tiles for M rows of x and the weight kind (split-K is `pick_splits`'s)."""
    if m <= FMA_MAX_M:
        return TILES_FMA
    return TILES_DOT_FP8 if fp8 else TILES_DOT_PLAIN


def pick_splits(tiles_n: int, k: int, num_sms: int) -> int:
    """Split-K factor: none when the N slabs give every SM a program; else PROGRAMS_PER_SM programs per
    SM, at most one split per 128 columns of K and MAX_SPLITS in all (the fp32 partials stay in L2,
    but every split re-reads x and writes M x N floats, and the sum is a second launch)."""
    if tiles_n >= num_sms:
        return 1
    return max(1, min(cdiv(PROGRAMS_PER_SM * num_sms, tiles_n), cdiv(k, FP8_BLOCK), MAX_SPLITS))


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    backend: str = "auto",
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ W [N, K]^T -> [M, N] in `out_dtype` (default x's), for small M (any M works; the
    tiles assume the few rows of a decode batch; `model.linear.GEMV_MAX_M` sends those here).

    x: bf16/fp16/fp32, unit column stride, any row stride (a column slice of a wider output is fine).
    w: plain (x's dtype) or e4m3 with `scale_inv` [ceil(N/128), ceil(K/128)] fp32 (module docstring);
    unit column stride, any row stride. `backend` as `common.use_triton`; `config` overrides
    `pick_config` (bench sweeps). Graph-safe: no sync, no host->device copy."""
    if not use_triton(backend, x.device):
        return gemv_ref(x, w, scale_inv, out_dtype)
    m, n, k = _check(x, w, scale_inv)
    check(x.stride(1) == 1 and w.stride(1) == 1, "gemv: x and w need unit column stride")
    check(scale_inv is None or scale_inv.is_contiguous(), "gemv: scale_inv must be contiguous")
    check(x.device == w.device, "gemv: x and w on different devices")
    out_dtype = out_dtype or x.dtype
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    fp8 = scale_inv is not None
    sms = num_sms(x.device)
    cfg = config or pick_config(m, fp8)
    check(cfg.bk <= 128 and 128 % cfg.bk == 0, "gemv: BK must divide 128")
    bm = max(16, next_pow2(m)) if cfg.dot else next_pow2(m)
    tiles_n = cdiv(n, cfg.bn)
    splits = cfg.splits if cfg.splits is not None else pick_splits(tiles_n, k, sms)
    kb = cdiv(k, FP8_BLOCK)
    k_split = cdiv(kb, max(1, min(splits, kb))) * FP8_BLOCK  # whole 128-column blocks per split
    splits = cdiv(k, k_split)
    dst = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    ws = scale_inv if scale_inv is not None else w  # not read unless FP8
    _gemv_kernel[(tiles_n, splits)](
        x, w, ws, dst, m, n, k, k_split,
        x.stride(0), w.stride(0), ws.stride(0) if fp8 else 0, n, m * n if splits > 1 else 0, 0, 0, 0,
        FP8=fp8, X16=fp8 and x.dtype == torch.bfloat16, DOT=cfg.dot, F32=x.dtype == torch.float32 or triton_interpret(),
        BM=bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    if splits > 1:
        blk = 1024
        _splitk_sum_kernel[(cdiv(m * n, blk),)](dst, out, splits, m * n, BLOCK=blk, num_warps=4)
    return out


# ------------------------------------------------------------------------------------ per-head GEMV
# Token rows up to which `head_gemv` runs the kernel; above it (prefill chunks) torch's batched GEMM.
# LONGCTX_HEAD_GEMV_MAX_T=0: always torch (A/B benches).
HEAD_GEMV_MAX_T = int(os.environ.get("LONGCTX_HEAD_GEMV_MAX_T", "64"))


def head_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: y[t, h, n] = sum_k x[t, h, k] w[h, n, k] (torch.einsum in x's dtype)."""
    _check_heads(x, w)
    return torch.einsum("thk,hnk->thn", x, w)


def _check_heads(x: torch.Tensor, w: torch.Tensor) -> None:
    check(
        x.dim() == 3 and w.dim() == 3 and x.shape[1] == w.shape[0] and x.shape[2] == w.shape[2],
        f"head_gemv: x [T, H, K] and w [H, N, K], got {tuple(x.shape)}, {tuple(w.shape)}",
    )
    check(x.dtype == w.dtype, f"head_gemv: x and w dtypes differ ({x.dtype}, {w.dtype})")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"head_gemv: x dtype {x.dtype}")


def head_gemv(x: torch.Tensor, w: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Per-head small-M products y [T, H, N] = x[:, h] @ w[h]^T: MLA's absorbed W_UK (w stored [H, L,
    nope]) and W_UV ([H, v, L]) at decode. One launch over (N slabs, heads), each program a weight stream
    of its head's [BN, K] slab (`_gemv_kernel` with a batch stride), where torch's batched GEMM tiles M=1.
    Up to `HEAD_GEMV_MAX_T` rows; more rows (prefill) take the reference. x any strides with a unit last
    one (q_nope is a slice of q_b's output), w unit last stride. Graph-safe: no sync, no host copy."""
    _check_heads(x, w)
    t, h, k = x.shape
    if not use_triton(backend, x.device) or t > HEAD_GEMV_MAX_T:
        return head_gemv_ref(x, w)
    check(x.stride(2) == 1 and w.stride(2) == 1, "head_gemv: x and w need a unit last stride")
    check(x.device == w.device, "head_gemv: x and w on different devices")
    n = w.shape[1]
    out = torch.empty(t, h, n, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = TILES_DOT_PLAIN
    _gemv_kernel[(cdiv(n, cfg.bn), 1, h)](
        x, w, w, out, t, n, k, k, x.stride(0), w.stride(1), 0, h * n, 0, x.stride(1), w.stride(0), n,
        FP8=False, X16=False, DOT=True, F32=x.dtype == torch.float32 or triton_interpret(),
        BM=max(16, next_pow2(t)), BN=cfg.bn, BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    # A plain launch, not PDL: the sparse MLA kernel after W_UK would be scheduled onto the SMs while this
    # grid's 512 programs still run, and on the H200 it then took 18.3 us after it against 13.9 us after
    # cuBLAS (bench/results/s59.md, s59f). Its own predecessor, q_b_proj, is cuBLAS anyway.
    return out


# ------------------------------------------------------- split-K attention merge + per-head GEMV (W_UV)
def merge_head_gemv_ref(parts: torch.Tensor, lse: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: one query's attention over S key splits, merged (`sparse_mla`'s combine: the splits'
    outputs weighted by softmax(lse), empty splits (lse -inf) weigh 0, all empty gives 0), rounded to w's
    dtype, then `head_gemv_ref` by w. parts [H, S, K] fp32, lse [H, S] fp32, w [H, N, K] -> [1, H, N]."""
    _check_merge(parts, lse, w)
    m = lse.max(dim=1, keepdim=True).values
    a = torch.exp(lse - torch.where(torch.isinf(m), 0.0, m))
    tot = a.sum(dim=1, keepdim=True)
    a = a / torch.where(tot > 0, tot, 1.0)
    o = (parts * a[..., None]).sum(dim=1).to(w.dtype)  # [H, K]
    return head_gemv_ref(o[None], w)


def _check_merge(parts: torch.Tensor, lse: torch.Tensor, w: torch.Tensor) -> None:
    check(
        parts.dim() == 3 and lse.shape == parts.shape[:2] and w.dim() == 3,
        f"merge_head_gemv: parts [H, S, K], lse [H, S], w [H, N, K], got {tuple(parts.shape)}, "
        f"{tuple(lse.shape)}, {tuple(w.shape)}",
    )
    check(
        w.shape[0] == parts.shape[0] and w.shape[2] == parts.shape[2],
        f"merge_head_gemv: w {tuple(w.shape)} does not match parts {tuple(parts.shape)}",
    )
    check(parts.dtype == lse.dtype == torch.float32, "merge_head_gemv: parts and lse must be fp32")
    check(w.dtype in (torch.bfloat16, torch.float16, torch.float32), f"merge_head_gemv: w dtype {w.dtype}")


@jit
def _merge_gemv_kernel(
    p_ptr, l_ptr, w_ptr, o_ptr, S, N, K,
    s_ph, s_ps, s_lh, s_wh, s_wn,
    F32: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # Program (pid_n, head h): the split weights from h's lse (as `sparse_mla._combine_kernel`), then per K
    # step the merged row x = sum_s a_s parts[h, s, k-step], rounded to w's dtype, times W[h]'s [BN, BK] tile
    # on the tensor cores (x in row 0 of a 16-row operand, swap-AB as `_gemv_kernel`).
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mn = offs_n < N
    offs_s = tl.arange(0, BS)
    ms = offs_s < S
    a, _, _ = lse_weights(tl.load(l_ptr + h * s_lh + offs_s, mask=ms, other=float("-inf")))
    rows = tl.arange(0, 16)
    like = tl.zeros([1], dtype=w_ptr.dtype.element_ty)
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        part = tl.load(
            p_ptr + h * s_ph + offs_s[:, None] * s_ps + offs_k[None, :],
            mask=ms[:, None] & mk[None, :],
            other=0.0,
        )
        x = round_as(tl.sum(part * a[:, None], axis=0), like).to(w_ptr.dtype.element_ty)  # [BK]
        x16 = tl.where(rows[:, None] == 0, x[None, :], tl.zeros([16, BK], dtype=x.dtype))
        wt = tl.load(
            w_ptr + h * s_wh + offs_n[:, None] * s_wn + offs_k[None, :], mask=mn[:, None] & mk[None, :]
        )
        acc += mma(wt, tl.trans(x16), F32)
    out = tl.sum(tl.where(rows[None, :] == 0, acc, 0.0), axis=1)  # [BN]: the product of row 0
    y = round_as(out, tl.zeros([1], dtype=o_ptr.dtype.element_ty))
    tl.store(o_ptr + h * N + offs_n, y.to(o_ptr.dtype.element_ty), mask=mn)


def merge_head_gemv(
    parts: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """`merge_head_gemv_ref` in one launch: a batch-1 decode step's sparse attention split over the top-k,
    merged straight into W_UV (`sparse_mla(out_proj=)`), in place of the combine kernel and `head_gemv`.
    One program per (N slab, head), each re-reading its head's [S, K] partials (L2) beside its weight slab.
    parts / lse any strides with a unit last one on parts; w unit last stride. Graph-safe."""
    _check_merge(parts, lse, w)
    if not use_triton(backend, parts.device):
        return merge_head_gemv_ref(parts, lse, w)
    check(parts.stride(2) == 1 and w.stride(2) == 1, "merge_head_gemv: parts and w need a unit last stride")
    check(lse.stride(1) == 1, "merge_head_gemv: lse needs a unit last stride")
    h, s, k = parts.shape
    n = w.shape[1]
    out = torch.empty(1, h, n, dtype=w.dtype, device=w.device)
    if out.numel() == 0:
        return out
    cfg = TILES_DOT_PLAIN
    _merge_gemv_kernel[(cdiv(n, cfg.bn), h)](
        parts, lse, w, out, s, n, k, parts.stride(0), parts.stride(1), lse.stride(0), w.stride(0), w.stride(1),
        F32=w.dtype == torch.float32 or triton_interpret(), BS=max(2, next_pow2(s)), BN=cfg.bn, BK=cfg.bk,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl(w.device),
    )  # fmt: skip
    return out
