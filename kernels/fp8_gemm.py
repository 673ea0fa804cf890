"""FP8 block-scaled linear layers (DeepSeek-V3 / GLM-5 checkpoints with `weight_scale_inv`).

Weight layout (as stored in the checkpoint, nothing repacked):
  w_fp8      [N, K] float8_e4m3fn, row-major (stride (K, 1)): 1 byte per element.
  scale_inv  [ceil(N/128), ceil(K/128)] float32: block (i, j) covers rows 128i..128i+127 and columns
             128j..128j+127 (edge blocks are partial); dequant(w)[n, k] = float(w[n, k]) * scale_inv[n//128, k//128].
Activation quantisation (`act_quant`, DeepSeek's "1x128 token group"):
  x_fp8      [T, K] float8_e4m3fn, x_scale [T, ceil(K/128)] float32 with x ~= x_fp8 * x_scale per group of 128
             columns; x_scale = max(amax, 1e-4) / 448 (448 = e4m3 max), as DeepSeek's `act_quant`.

Two Triton GEMMs compute x @ dequant(w).T with fp32 accumulation:
  * weight-only ("w8a16", default): e4m3 values are exact in bf16/fp32, so the kernel feeds the raw fp8 tile
    (converted to x's dtype) to `tl.dot` and applies the block scale to the [BM, BN] partial product of each
    128-wide K block. Numerically this equals the reference up to accumulation order. bf16 x at decode-sized
    tiles goes to an fp16 MMA instead, each x row scaled by a power of two per K step (`fp16_rows`): e4m3 ->
    fp16 is one conversion per two elements, e4m3 -> bf16 three, and the result is the same.
  * `quantize_act=True` ("w8a8"): x is quantised with `act_quant` and both operands go to `tl.dot` as fp8
    (Hopper fp8 tensor cores, 2x the bf16 rate); partial products are scaled by x_scale[m, kb] * scale_inv[nb, kb].
    This is the prefill-sized fast path; its reference quantises x the same way.
Small T (decode) is a weight stream with few output tiles (q_a_proj at T=1: 32 tiles of 64 rows for 132
SMs), so the same kernel runs split-K: each program covers whole 128-column scale blocks of K and writes an
fp32 partial, and `_splitk_sum_kernel` adds the partials in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import torch

from .common import check, jit, num_sms, tl, triton_interpret, use_triton

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Weight-only tiles up to this many rows run bf16 activations as fp16 (`fp16_rows`): there the weight's
# conversion is the work per byte streamed. Wider (prefill) tiles keep the bf16 MMA, whose x operand
# goes from shared memory to the tensor cores without the register pass the row scaling needs.
FP16_MMA_MAX_BM = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequant_block_fp8_ref(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK
) -> torch.Tensor:
    """fp32 dequantisation of a block-scaled fp8 matrix [..., N, K] with scales [..., ceil(N/b), ceil(K/b)]."""
    n, k = w_fp8.shape[-2:]
    s = scale_inv.float().repeat_interleave(block, dim=-2)[..., :n, :]
    s = s.repeat_interleave(block, dim=-1)[..., :k]
    return w_fp8.float() * s


def quant_block_fp8_ref(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [..., N, K] to e4m3 with per-128x128-block scales (how FP8 checkpoints are made; for tests)."""
    n, k = w.shape[-2:]
    nb, kb = cdiv(n, block), cdiv(k, block)
    pad = torch.zeros(*w.shape[:-2], nb * block, kb * block, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w.float()
    blocks = pad.unflatten(-1, (kb, block)).unflatten(-3, (nb, block))  # [..., nb, b, kb, b]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., nb, kb]
    scale = amax / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-2, -1).flatten(-3, -2)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def act_quant_ref(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column e4m3 quantisation: x [T, K] -> (x_fp8 [T, K], x_scale [T, ceil(K/128)] fp32)."""
    check(x.dim() == 2, f"act_quant: x must be [T, K], got {tuple(x.shape)}")
    t, k = x.shape
    kb = cdiv(k, block)
    pad = torch.zeros(t, kb * block, dtype=torch.float32, device=x.device)
    pad[:, :k] = x.float()
    g = pad.view(t, kb, block)
    scale = g.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX  # [T, kb]
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, kb * block)[:, :k].contiguous(), scale


def _check_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> tuple[int, int, int]:
    check(x.dim() == 2, f"fp8_block_linear: x must be [T, K], got {tuple(x.shape)}")
    check(w_fp8.dim() == 2 and w_fp8.dtype == torch.float8_e4m3fn, "fp8_block_linear: w must be [N, K] e4m3")
    t, k = x.shape
    n = w_fp8.shape[0]
    check(w_fp8.shape[1] == k, f"fp8_block_linear: x has K={k}, w has K={w_fp8.shape[1]}")
    want = (cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))
    check(
        tuple(scale_inv.shape) == want and scale_inv.dtype == torch.float32,
        f"fp8_block_linear: scale_inv must be fp32 {want}, got {scale_inv.dtype} {tuple(scale_inv.shape)}",
    )
    return t, n, k


def fp8_block_linear_ref(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    quantize_act: bool = False,
) -> torch.Tensor:
    """Reference: x [T, K] @ dequant(w_fp8 [N, K], scale_inv).T in fp32 -> [T, N] in out_dtype (default x's)."""
    _check_linear(x, w_fp8, scale_inv)
    out_dtype = out_dtype or x.dtype
    xf = x.float()
    if quantize_act:
        xq, xs = act_quant_ref(x)
        xf = xq.float() * xs.repeat_interleave(FP8_BLOCK, dim=-1)[:, : x.shape[1]]
    return (xf @ dequant_block_fp8_ref(w_fp8, scale_inv).T).to(out_dtype)


@jit
def mma(a, b, F32: tl.constexpr):
    """tl.dot with fp32 accumulation. F32 upcasts both operands and asks for exact fp32 ("ieee"): needed for
    fp32 models (Hopper would otherwise use tf32) and under the triton 3.9 interpreter, whose bf16 x bf16 dot
    returns garbage. On the GPU bf16/fp16/fp8 operands go to the tensor cores as they are."""
    if F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@jit
def pow2(e):
    """2^e as fp32 for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@jit
def fp16_rows(a):
    """A bf16 tile [R, C] as fp16 scaled per row by a power of two, and the inverse powers [R] fp32.

    Lets an e4m3 weight meet bf16 activations in an fp16 MMA: e4m3 -> fp16 is exact and one instruction
    per two elements, e4m3 -> bf16 is that plus an fp16 -> bf16 conversion per element. Row r is scaled by
    2^(14 - e), e = floor(log2 max|a_r|), so its max lies in [2^14, 2^15): every element at least 2^-28 of
    the row max keeps all of bf16's 8 significant bits as an fp16 normal, down to 2^-31 as a subnormal.
    Products and sums stay fp32 in the MMA, so mma(fp16 rows, w) * inverse equals the bf16 MMA up to the
    fp32 rounding (both are exact power-of-two rescalings): callers multiply by the block scale first and
    the inverse last, so an output in fp32's subnormal range is rounded once, as the bf16 path rounds it.
    Zero rows and rows under 2^-110 clamp e to -110 (the inverse must stay an fp32 normal)."""
    af = a.to(tl.float32)
    amax = tl.max(tl.abs(af), axis=1)  # [R]
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 amax), amax >= 0
    e = tl.minimum(tl.maximum(e, -110), 127)
    return (af * pow2(14 - e)[:, None]).to(tl.float16), pow2(e - 14)


@jit
def _fp8_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr,
    T, N, K, K_SPLIT,
    stride_xt, stride_xst, stride_wn, stride_wsn, stride_ot, stride_os,
    A8: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # One program = one [BM, BN] output tile over the K range [pid_k*K_SPLIT, +K_SPLIT) (split-K; K_SPLIT is a
    # multiple of 128 so a K tile never straddles a scale block, and BK divides 128). With one split it
    # writes the output; with several it writes an fp32 partial o_ptr[pid_k] that `_splitk_sum_kernel` adds.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < T
    mask_n = offs_n < N
    ws_row = ws_ptr + (offs_n // 128) * stride_wsn  # [BN] scale rows of this tile's weight rows
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < k_hi
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BN, BK] e4m3: each thread loads 16 contiguous bytes of a row (K is the unit-stride dim)
        wsc = tl.load(ws_row + k0 // 128, mask=mask_n, other=0.0)  # [BN]
        if A8:
            asc = tl.load(xs_ptr + offs_m * stride_xst + k0 // 128, mask=mask_m, other=0.0)
            acc += mma(a, tl.trans(w), F32) * asc[:, None] * wsc[None, :]
        elif X16:  # bf16 x: an fp16 MMA on power-of-two-scaled rows (`fp16_rows`)
            a16, inv = fp16_rows(a)
            acc += mma(a16, tl.trans(w.to(tl.float16)), F32) * wsc[None, :] * inv[:, None]
        else:
            # e4m3 is exact in bf16/fp16/fp32, so the block scale can wait for the [BM, BN] partial.
            acc += mma(a, tl.trans(w.to(a.dtype)), F32) * wsc[None, :]
    tl.store(
        o_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@jit
def _splitk_sum_kernel(p_ptr, o_ptr, S, TN, stride_ps, BLOCK: tl.constexpr):
    # out.flat[i] = sum_s partial[s].flat[i] in fixed split order (deterministic, no atomics).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < TN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(p_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    tl.store(o_ptr + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


@jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xt, stride_qt, stride_st, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (Triton's `/` is approximate on the GPU) keep the bytes equal to act_quant_ref's.
    s = tl.fdiv(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4), 448.0, ieee_rounding=True)
    q = tl.minimum(tl.maximum(tl.fdiv(x, s, ieee_rounding=True), -448.0), 448.0)
    # q_ptr is fp32 under the interpreter: its fp32->e4m3 cast rounds wrongly when the mantissa carries.
    tl.store(q_ptr + t.to(tl.int64) * stride_qt + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t * stride_st + g, s)


def act_quant(
    x: torch.Tensor, block: int = FP8_BLOCK, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`act_quant_ref` (x [T, K] -> (x_fp8 [T, K], x_scale [T, ceil(K/128)])), in Triton when `backend` says so.

    x: float, any row stride, unit column stride. Byte-identical to the reference."""
    check(block == FP8_BLOCK, "act_quant: only 128-column groups are supported")
    check(x.dim() == 2, f"act_quant: x must be [T, K], got {tuple(x.shape)}")
    if not use_triton(backend, x.device):
        return act_quant_ref(x, block)
    check(x.stride(1) == 1, "act_quant: x must have unit column stride")
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.float32 if triton_interpret() else torch.float8_e4m3fn, device=x.device)
    s = torch.empty(t, cdiv(k, block), dtype=torch.float32, device=x.device)
    if t and k:
        _act_quant_kernel[(t, cdiv(k, block))](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), BLOCK=block)
    return q.to(torch.float8_e4m3fn), s


def _pick_tiles(t: int, quantize_act: bool) -> tuple[int, int, int, int, int]:
    # Decode (small T) is a weight stream: narrow M (16 is the smallest tensor-core M), BN=64 rows of 128
    # bytes per K tile (each of the 128 threads issues 4 x 16-byte loads), 4 stages of loads in flight;
    # split-K (`_pick_splits`) then provides the CTAs. ~90 registers/thread, 4 * (4 KB + 8 KB) = 48 KB of
    # shared memory: 4 CTAs per SM.
    if t <= 16:
        return 16, 64, 128, 4, 4
    if t <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 128 if quantize_act else 64, 8, 3


def _pick_splits(tiles_mn: int, k: int, num_sms: int) -> int:
    """Split-K factor: enough CTAs for ~4 per SM (a weight stream needs many loads in flight per SM, and
    at T=1 q_a_proj has only 32 output tiles for 132 SMs), but at least 2 scale blocks (256 of K) per
    split so the fp32 partials ([S, T, N], L2-resident) stay small next to the weights."""
    target = 4 * num_sms
    if tiles_mn >= 2 * num_sms:  # prefill-sized grids: partials would cost more than they recover
        return 1
    kb = cdiv(k, FP8_BLOCK)
    return max(1, min(cdiv(target, tiles_mn), kb // 2))


def fp8_block_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    quantize_act: bool = False,
    *,
    backend: str = "auto",
    tiles: tuple[int, int, int, int, int] | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [T, K] (bf16/fp16/fp32, unit column stride) @ dequant(w_fp8 [N, K] e4m3 contiguous, scale_inv).T.

    Returns [T, N] in `out_dtype` (default x's). `quantize_act` quantises x per 1x128 group and runs an fp8 x fp8
    GEMM (see module docstring). `backend` as `common.use_triton` ("auto": Triton on CUDA, else the reference).
    `tiles` = (BM, BN, BK, num_warps, num_stages) overrides the tile heuristic (bench); `split_k` the split-K
    factor (None: enough CTAs for the SMs at small T; the split count is rounded to whole 128-column blocks).
    No host sync and no host->device copy: safe inside CUDA graph capture.
    """
    if not use_triton(backend, x.device):
        return fp8_block_linear_ref(x, w_fp8, scale_inv, out_dtype, quantize_act)
    t, n, k = _check_linear(x, w_fp8, scale_inv)
    check(x.stride(1) == 1, "fp8_block_linear: x needs unit column stride")
    check(
        w_fp8.is_contiguous() and scale_inv.is_contiguous(),
        "fp8_block_linear: w and scale_inv must be contiguous",
    )
    check(x.device == w_fp8.device == scale_inv.device, "fp8_block_linear: tensors on different devices")
    out_dtype = out_dtype or x.dtype
    out = torch.empty(t, n, dtype=out_dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk, warps, stages = tiles or _pick_tiles(t, quantize_act)
    check(bk <= 128 and 128 % bk == 0, "fp8_block_linear: BK must divide 128")
    if quantize_act:
        xq, xs = act_quant(x, backend=backend)
    else:
        xq, xs = x, scale_inv  # xs unused by the kernel
    tiles_mn = cdiv(t, bm) * cdiv(n, bn)
    splits = split_k if split_k is not None else _pick_splits(tiles_mn, k, num_sms(x.device))
    kb = cdiv(k, FP8_BLOCK)
    k_split = cdiv(kb, max(1, min(splits, kb))) * FP8_BLOCK  # whole scale blocks per split
    splits = cdiv(k, k_split)
    dst = out if splits == 1 else torch.empty(splits, t, n, dtype=torch.float32, device=x.device)
    _fp8_linear_kernel[(cdiv(t, bm), cdiv(n, bn), splits)](
        xq, xs, w_fp8, scale_inv, dst, t, n, k, k_split,
        xq.stride(0), xs.stride(0), w_fp8.stride(0), scale_inv.stride(0), n, t * n if splits > 1 else 0,
        A8=quantize_act, X16=not quantize_act and x.dtype == torch.bfloat16 and bm <= FP16_MMA_MAX_BM, F32=x.dtype == torch.float32 or triton_interpret(),
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        blk = 1024
        _splitk_sum_kernel[(cdiv(t * n, blk),)](dst, out, splits, t * n, t * n, BLOCK=blk, num_warps=4)
    return out
