"""Routed experts (grouped GEMMs) and the noaux_tc router of GLM-5 / DeepSeek-V3.

Expert weights, packed as transformers' `GlmMoeDsaExperts`:
  w_gate_up [E, 2I, Hd]: rows [0, I) = gate_proj, rows [I, 2I) = up_proj; row-major per expert.
  w_down    [E, Hd, I].
  Either float (bf16/fp16/fp32) or float8_e4m3fn with 128x128 block scales of the packed matrices:
  w_gate_up_scale [E, ceil(2I/128), ceil(Hd/128)] fp32, w_down_scale [E, ceil(Hd/128), ceil(I/128)] fp32,
  dequant(w)[e, n, k] = w[e, n, k] * scale[e, n//128, k//128]. (When I % 128 == 0, as in GLM-5.3, stacking
  the checkpoint's separate gate/up scales gives exactly this; otherwise the loader must re-block.)
y[t] = sum_j topk_w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j]. Ids outside [0, E)
contribute nothing (lets expert parallelism mark non-local experts with -1).

Router (Triton path, two launches): `router_logits` reads the hidden rows in their own dtype against the
fp32 router weights (fp32 products, no fp32 copy of hidden, no cuBLAS GEMV), then `_router_select_kernel`
does sigmoid, bias, the group-limited top-k, the weights and the padding rows' -1 ids.

Experts, Triton path:
  1. `moe_align` (torch, no host sync): sort the T*k (token, slot) pairs by expert and pad each expert's run to
     a multiple of BLOCK_M; every M block then belongs to one expert (`block_expert`, -1 = unused block).
     The block count is bounded by cdiv(T*k, BLOCK_M) + min(E, T*k), so decode at batch 1 launches
     ~k blocks, not E.
  2. `_gate_up_kernel`: per (M block, N tile of I) both the gate and up tiles are accumulated and
     silu(gate) * up is written to a per-pair intermediate [T*k, I] (x's dtype).
  3. `_down_kernel`: per (M block, N tile of Hd) intermediate @ w_down.T, times the routing weight, written
     to a per-pair buffer [T*k, Hd] (rows of ignored ids are never written).
  4. `_combine_kernel`: y = residual + (sum over the valid k slots + shared) per token, one kernel
     (deterministic, no atomics); torch would spend a zeros, a sum and an add per addend.
With STREAM_MAX_PAIRS > 0 (off by default, unmeasured), fp8 weights on whole 128-blocks take `moe_stream`'s
persistent weight stream for at most that many pairs (no align; split-K partials to the combine kernel).
With DECODE_MAX_PAIRS > 0 (off by default: measured slower than steps 1-3 on the H200), at most that many
(token, slot) pairs take `moe_decode`'s weight stream instead of steps 1-3 (no align; its down
projection's split-K partials go to the same combine kernel).
`shared` (the shared experts' output) and `residual` (the decoder layer's residual stream) are
optional addends of both paths, each added in that order and rounded to x's dtype as torch's
separate adds round.
fp8 weights are dequantised in-kernel: the raw e4m3 tile goes to tl.dot (exact in bf16) and the block scale
multiplies the [BM, BN] partial product of each 128-wide K block. With bf16 x and decode-sized tiles the
MMA runs in fp16 on power-of-two-scaled rows instead (`fp8_gemm.fp16_rows`: same result, a third of the
conversions). Activations are not quantised here: both kernels are weight-only (w8a16).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .common import (
    check,
    jit,
    next_pow2,
    num_sms,
    pdl,
    pdl_wait,
    round_as,
    tl,
    triton_interpret,
    use_triton,
)
from .fp8_gemm import FP16_MMA_MAX_BM, cdiv, dequant_block_fp8_ref, fp16_rows, mma
from .moe_decode import FILL_SMS, DecodeConfig, experts_decode, fill_sms_bn
from .moe_stream import StreamConfig, experts_stream
from .moe_stream import supports as stream_supports
from .norm import rms_norm_ref, rms_scale

# Up to this many (token, slot) pairs the Triton path runs `moe_decode` (a weight stream of the selected
# experts, no align kernel) instead of the grouped GEMMs below. Off (0) by default: on the H200 at
# GLM-5.3 shapes (fp8, top-8 of 256; `python -m bench.kernels_mla_moe --moe-decode`,
# bench/results/moe-decode-h200.md) its best setting took 122 us at batch 1 and 656 us at batch 8
# against 120.5 / 572 us for the grouped GEMMs with the (16, 64, 128, 4, 4) tiles. 64 (batch 8 at top-8)
# turns it on; LONGCTX_MOE_DECODE_MAX_PAIRS sets it for a process (A/B benches).
DECODE_MAX_PAIRS = int(os.environ.get("LONGCTX_MOE_DECODE_MAX_PAIRS", "0"))
# Up to this many pairs, fp8 block weights with Hd and I multiples of 128 take `moe_stream` (persistent
# weight stream, no align). Off (0) until `python -m bench.moe8_sweep` has measured it on the H200;
# LONGCTX_MOE_STREAM_MAX_PAIRS sets it for a process (A/B benches). Checked before DECODE_MAX_PAIRS.
STREAM_MAX_PAIRS = int(os.environ.get("LONGCTX_MOE_STREAM_MAX_PAIRS", "0"))


# ---------------------------------------------------------------------------------------------- router
def _check_router(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    n_group: int,
    topk_group: int,
    valid: torch.Tensor | None = None,
) -> int:
    """Validates the router's inputs; returns E."""
    check(hidden.dim() == 2 and weight.dim() == 2, "moe_router: hidden [T, Hd] and weight [E, Hd] expected")
    check(hidden.shape[1] == weight.shape[1], "moe_router: hidden [T, Hd] and weight [E, Hd] disagree on Hd")
    e = weight.shape[0]
    check(
        e % n_group == 0 and topk_group <= n_group, f"moe_router: E={e} not divisible into {n_group} groups"
    )
    check(
        valid is None or (valid.shape == hidden.shape[:1] and valid.dtype == torch.bool),
        "moe_router: valid must be bool [T]",
    )
    return e


def moe_router_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    *,
    valid: torch.Tensor | None = None,
    done: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing exactly as transformers' `GlmMoeDsaTopkRouter.forward`.

    hidden [T, Hd] (any float dtype), weight [E, Hd], bias [E] -> (topk_ids int64 [T, k], topk_w fp32 [T, k]).
    The k slots are unordered (torch.topk(sorted=False)); ties may break differently on CPU and GPU.
    `valid` [T] bool (optional) marks padding rows: their ids are all -1 and their weights 0. `done` is
    `moe_router`'s counter (unused here).
    """
    e = _check_router(hidden, weight, n_group, topk_group, valid)
    logits = F.linear(hidden.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + e_score_correction_bias.float()
    group_scores = choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    topk_w = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    topk_w = topk_w * routed_scaling_factor
    if valid is not None:
        topk_ids = topk_ids.masked_fill(~valid[:, None], -1)
        topk_w = topk_w.masked_fill(~valid[:, None], 0.0)
    return topk_ids, topk_w


# Above this many tokens the router's logits are one torch GEMM (cuBLAS reads the weights once; the
# kernel below rereads them per token block, which only pays while launches dominate: decode).
ROUTER_LOGITS_MAX_TOKENS = 256
_LOGITS_MIN_PROGRAMS = 128  # batch 1 at GLM-5.3 (E=256): 2 experts a program, 48 KB of weights each
_LOGITS_TILE = 8192  # fp32 products per program per H chunk


@jit
def _router_logits_kernel(
    h_ptr, w_ptr, out_ptr,
    T, E, H, stride_h, stride_w,
    BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    _logits_tile(h_ptr, w_ptr, out_ptr, T, E, H, stride_h, stride_w, BT, BE, BH)


@jit
def _logits_tile(
    h_ptr, w_ptr, out_ptr, T, E, H, stride_h, stride_w, BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr
):
    # out[t, e] = sum_h fp32(hidden[t, h]) * fp32(w[e, h]) for this program's [BT, BE] tile. Elementwise
    # products and tl.sum, not tl.dot: the interpreter and the GPU then both compute true fp32 (tl.dot may
    # take tf32 on the GPU), and at decode sizes the GEMV is bound by reading the weights anyway.
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    re = tl.program_id(1) * BE + tl.arange(0, BE)
    rh = tl.arange(0, BH)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for h0 in range(0, H, BH):
        k = h0 + rh
        x = tl.load(
            h_ptr + rt[:, None].to(tl.int64) * stride_h + k[None, :],
            mask=(rt[:, None] < T) & (k[None, :] < H),
            other=0.0,
        ).to(tl.float32)  # [BT, BH]
        w = tl.load(
            w_ptr + re[:, None].to(tl.int64) * stride_w + k[None, :],
            mask=(re[:, None] < E) & (k[None, :] < H),
            other=0.0,
        ).to(tl.float32)  # [BE, BH]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(
        out_ptr + rt[:, None].to(tl.int64) * E + re[None, :], acc, mask=(rt[:, None] < T) & (re[None, :] < E)
    )


def _logits_tiles(t: int, e: int, h: int) -> tuple[int, int, int]:
    """(BT, BE, BH): up to 16 tokens share a weight tile; experts per program halve until the grid
    has `_LOGITS_MIN_PROGRAMS` programs (or one expert each); H chunks fill `_LOGITS_TILE` products."""
    bt = min(next_pow2(t), 16)
    be = min(next_pow2(e), 32)
    while be > 1 and cdiv(t, bt) * cdiv(e, be) < _LOGITS_MIN_PROGRAMS:
        be //= 2
    bh = max(16, min(next_pow2(h), _LOGITS_TILE // (bt * be)))
    return bt, be, bh


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's logits `F.linear(hidden.float(), weight.float())` [T, E] fp32 in one Triton kernel,
    reading hidden [T, Hd] (bf16/fp16/fp32, rows contiguous) and weight [E, Hd] as they are (fp32
    products and sums; only the summation order differs from torch)."""
    check(
        hidden.dim() == 2 and weight.dim() == 2, "router_logits: hidden [T, Hd] and weight [E, Hd] expected"
    )
    check(hidden.shape[1] == weight.shape[1], "router_logits: hidden and weight disagree on Hd")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    weight = weight.contiguous()
    (t, h), e = hidden.shape, weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=hidden.device)
    if t and e:
        bt, be, bh = _logits_tiles(t, e, h)
        _router_logits_kernel[(cdiv(t, bt), cdiv(e, be))](
            hidden, weight, out, t, e, h, hidden.stride(0), weight.stride(0), BT=bt, BE=be, BH=bh,
            **pdl(hidden.device),
        )  # fmt: skip
    return out


@jit
def _router_select_kernel(
    logits_ptr, bias_ptr, valid_ptr, ids_ptr, w_ptr,
    E, scaling,
    EG: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, EGP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
    HAS_VALID: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # One program per token: everything after the logits GEMM (sigmoid, bias, group-limited top-k,
    # the weights of the chosen experts, the padding rows' -1 ids), which torch spends ~15 kernels on.
    _select_row(
        logits_ptr, bias_ptr, valid_ptr, ids_ptr, w_ptr, tl.program_id(0).to(tl.int64), E, scaling,
        EG, G, GP, EGP, TOPK_GROUP, K, KP, NORM, HAS_VALID,
    )  # fmt: skip


@jit
def _select_row(
    logits_ptr, bias_ptr, valid_ptr, ids_ptr, w_ptr, t, E, scaling,
    EG: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, EGP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, HAS_VALID: tl.constexpr,
):  # fmt: skip
    # token t's k experts and weights from its logits row (read past L1: `_router_fused_kernel`'s last
    # program reads rows the other programs wrote)
    g = tl.arange(0, GP)
    j = tl.arange(0, EGP)
    ok = (g[:, None] < G) & (j[None, :] < EG)
    e = g[:, None] * EG + j[None, :]  # [GP, EGP] expert ids
    NEG = float("-inf")
    lg = tl.load(logits_ptr + t * E + e, mask=ok, other=0.0, cache_modifier=".cg")
    scores = tl.sigmoid(lg)
    choice = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), NEG)
    # group score: the sum of the two best choices in the group (the first best masked by position)
    m1 = tl.max(choice, axis=1)
    a1 = tl.argmax(choice, axis=1)
    m2 = tl.max(tl.where(j[None, :] == a1[:, None], NEG, choice), axis=1)
    gs = tl.where(g < G, m1 + m2, NEG)
    keep = g < 0  # all False
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(gs, axis=0)
        keep = keep | (g == best)
        gs = tl.where(g == best, NEG, gs)
    choice = tl.where(keep[:, None], choice, NEG)
    ks = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    ws = tl.zeros([KP], dtype=tl.float32)
    for i in tl.static_range(K):
        # the best remaining expert; of tied ones the lowest id
        m = tl.max(tl.max(choice, axis=1), axis=0)
        best = tl.min(tl.min(tl.where(choice == m, e, E), axis=1), axis=0)
        sel = e == best
        ids = tl.where(ks == i, best.to(tl.int64), ids)
        ws = tl.where(ks == i, tl.sum(tl.sum(tl.where(sel, scores, 0.0), axis=1), axis=0), ws)
        choice = tl.where(sel, NEG, choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    ws = ws * scaling
    if HAS_VALID:
        ok_row = tl.load(valid_ptr + t) != 0
        ids = tl.where(ok_row, ids, -1)
        ws = tl.where(ok_row, ws, 0.0)
    tl.store(ids_ptr + t * K + ks, ids, mask=ks < K)
    tl.store(w_ptr + t * K + ks, ws, mask=ks < K)


@jit
def _router_fused_kernel(
    h_ptr, w_ptr, logits_ptr, bias_ptr, valid_ptr, ids_ptr, wt_ptr, done_ptr,
    T, E, H, stride_h, stride_w, scaling,
    BT: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr,
    EG: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, EGP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
    HAS_VALID: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # `_router_logits_kernel`'s tile, then the program that finishes last (a device-wide counter,
    # `done`, taken with acquire-release after a CTA barrier, so every tile's stores are visible to it)
    # selects every token's experts, and puts the counter back to 0 for the next call.
    _logits_tile(h_ptr, w_ptr, logits_ptr, T, E, H, stride_h, stride_w, BT, BE, BH)
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(done_ptr, 1, sem="acq_rel") == programs - 1:
        tl.store(done_ptr, 0)
        for t in range(0, T):
            _select_row(
                logits_ptr, bias_ptr, valid_ptr, ids_ptr, wt_ptr, tl.cast(t, tl.int64), E, scaling,
                EG, G, GP, EGP, TOPK_GROUP, K, KP, NORM, HAS_VALID,
            )  # fmt: skip


# Up to this many tokens `moe_router` given a `done` counter runs one kernel (logits, then the last program
# selects every token, one after another); more take the logits and select kernels (a program per token).
# Off (0) by default: on the H200 at small-1m's 16 experts the one launch was no faster than the two under
# PDL (norm to align ~10.9 us against ~10.4 a layer, bench/results/s59.md); LONGCTX_ROUTER_FUSED_MAX_TOKENS
# sets it for a process (4 turns it on for up to 4 rows; GLM-5.3's 256 experts are unmeasured).
ROUTER_FUSED_MAX_TOKENS = int(os.environ.get("LONGCTX_ROUTER_FUSED_MAX_TOKENS", "0"))


def moe_router(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    *,
    valid: torch.Tensor | None = None,
    done: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_router_ref`'s contract in two kernels: the [T, E] fp32 logits (`router_logits`: no copy
    of hidden to fp32; one torch GEMM above `ROUTER_LOGITS_MAX_TOKENS` tokens), then everything after
    them, the padding rows' -1 ids and 0 weights included, in one (a program per token). The k slots
    come out best first; which of two tied experts wins may differ from torch.topk (the reference
    leaves that unspecified too).

    `done`: a zeroed int32 [1] on hidden's device that only this call uses while it runs (the model's
    `Router` owns one): up to `ROUTER_FUSED_MAX_TOKENS` tokens then take one launch, the logits kernel
    whose last program to finish also does the selection (and sets `done` back to 0). Same results."""
    if not use_triton(backend, hidden.device):
        return moe_router_ref(
            hidden, weight, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
            routed_scaling_factor, valid=valid,
        )  # fmt: skip
    t, e = hidden.shape[0], _check_router(hidden, weight, n_group, topk_group, valid)
    check(0 < top_k <= e and e_score_correction_bias.shape == (e,), "moe_router: top_k in (0, E], bias [E]")
    check(
        done is None or (done.shape == (1,) and done.dtype == torch.int32 and done.device == hidden.device),
        "moe_router: done must be an int32 [1] counter on hidden's device",
    )
    if done is not None and 0 < t <= ROUTER_FUSED_MAX_TOKENS:
        return _router_fused(
            hidden, weight, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
            routed_scaling_factor, valid, done,
        )  # fmt: skip
    if t <= ROUTER_LOGITS_MAX_TOKENS:
        logits = router_logits(hidden, weight)
    else:
        logits = F.linear(hidden.float(), weight.float()).contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=hidden.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=hidden.device)
    if t:
        vp = valid.contiguous().view(torch.uint8) if valid is not None else ids  # ids: never read
        _router_select_kernel[(t,)](
            logits, e_score_correction_bias.float().contiguous(), vp, ids, w, e, float(routed_scaling_factor),
            **_select_constexprs(e, n_group, topk_group, top_k, norm_topk_prob, valid), **pdl(hidden.device),
        )  # fmt: skip
    return ids, w


def _select_constexprs(
    e: int, n_group: int, topk_group: int, top_k: int, norm: bool, valid: torch.Tensor | None
) -> dict[str, object]:
    """`_select_row`'s compile-time arguments, for the select kernel and the one-launch router."""
    eg = e // n_group
    return dict(
        EG=eg, G=n_group, GP=next_pow2(n_group), EGP=next_pow2(eg), TOPK_GROUP=topk_group, K=top_k,
        KP=next_pow2(top_k), NORM=bool(norm), HAS_VALID=valid is not None,
    )  # fmt: skip


def _router_fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    valid: torch.Tensor | None,
    done: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_router` for a few tokens in one launch (`_router_fused_kernel`)."""
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    weight = weight.contiguous()
    (t, h), e = hidden.shape, weight.shape[0]
    dev = hidden.device
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    w = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    bt, be, bh = _logits_tiles(t, e, h)
    vp = valid.contiguous().view(torch.uint8) if valid is not None else ids  # ids: never read
    _router_fused_kernel[(cdiv(t, bt), cdiv(e, be))](
        hidden, weight, logits, bias.float().contiguous(), vp, ids, w, done,
        t, e, h, hidden.stride(0), weight.stride(0), float(scaling), BT=bt, BE=be, BH=bh,
        **_select_constexprs(e, n_group, topk_group, top_k, norm_topk_prob, valid), **pdl(dev),
    )  # fmt: skip
    return ids, w


# ---------------------------------------------------------------------------------------------- experts
def _check_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int, bool]:
    check(act == "silu", f"moe_experts: only act='silu' is supported, got {act!r}")
    check(x.dim() == 2 and x.is_floating_point(), "moe_experts: x must be a float [T, Hd]")
    t, hd = x.shape
    for name, a in (("shared", shared), ("residual", residual)):
        check(
            a is None or (a.shape == x.shape and a.dtype == x.dtype and a.device == x.device),
            f"moe_experts: {name} must be {x.dtype} {tuple(x.shape)} on x's device",
        )
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == t, "moe_experts: topk_ids must be [T, k]")
    check(tuple(topk_w.shape) == tuple(topk_ids.shape), "moe_experts: topk_w must match topk_ids")
    check(not topk_ids.is_floating_point(), "moe_experts: topk_ids must be integer")
    check(
        w_gate_up.dim() == 3 and w_down.dim() == 3, "moe_experts: weights must be [E, 2I, Hd] and [E, Hd, I]"
    )
    e, two_i, hd_w = w_gate_up.shape
    inter = two_i // 2
    check(hd_w == hd and two_i % 2 == 0, f"moe_experts: w_gate_up {tuple(w_gate_up.shape)} vs Hd={hd}")
    check(tuple(w_down.shape) == (e, hd, inter), f"moe_experts: w_down must be [{e}, {hd}, {inter}]")
    fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    check(w_down.dtype == w_gate_up.dtype, "moe_experts: w_gate_up and w_down dtypes differ")
    if fp8:
        for name, s, n, k in (
            ("w_gate_up_scale", w_gate_up_scale, two_i, hd),
            ("w_down_scale", w_down_scale, hd, inter),
        ):
            want = (e, cdiv(n, 128), cdiv(k, 128))
            check(
                s is not None and tuple(s.shape) == want and s.dtype == torch.float32,
                f"moe_experts: fp8 weights need {name} fp32 {want}",
            )
    return t, hd, e, inter, topk_ids.shape[1], fp8


def _no_join() -> None:
    pass


def moe_experts_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str = "silu",
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    join: Callable[[], None] | None = None,
    norm_out: NormOut | None = None,
) -> torch.Tensor:
    """Reference: loop over the hit experts like transformers' `GlmMoeDsaExperts` (computes in x's dtype;
    fp8 weights are dequantised to fp32 and then cast to x's dtype). Returns y [T, Hd] in x's dtype,
    `residual + (y + shared)` when those [T, Hd] addends are given (the MoE block's shared experts and
    the decoder layer's residual add, as transformers adds them). `join` is called before `shared` is
    read (the shared experts may still run on a side stream, longctx/model/overlap.py). With `norm_out`
    the RMSNorm of the result goes into its buffer too (`NormOut`)."""
    _, _, e, _, _, fp8 = _check_experts(
        x, topk_ids, topk_w, w_gate_up, w_down, act, w_gate_up_scale, w_down_scale, shared, residual
    )
    y = torch.zeros_like(x)
    ids = topk_ids.long()
    for ex in torch.unique(ids[(ids >= 0) & (ids < e)]).tolist():
        tok, slot = torch.where(ids == ex)
        wg, wd = w_gate_up[ex], w_down[ex]
        if fp8:
            wg = dequant_block_fp8_ref(wg, w_gate_up_scale[ex])  # type: ignore[index]
            wd = dequant_block_fp8_ref(wd, w_down_scale[ex])  # type: ignore[index]
        gate, up = F.linear(x[tok], wg.to(x.dtype)).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, wd.to(x.dtype)) * topk_w[tok, slot, None]
        y.index_add_(0, tok, h.to(x.dtype))
    if join is not None:
        join()
    return _norm_out_ref(_add_ref(y, shared, residual), norm_out)


def _add_ref(y: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    if shared is not None:
        y = y + shared
    if residual is not None:
        y = residual + y
    return y


# (out [T, Hd], weight [Hd], eps): the combine also writes rms_norm(y) * weight into `out` (a decoder layer's
# next input norm, `kernels.norm`'s numerics), so the next layer starts without a norm launch of its own
NormOut = tuple[torch.Tensor, torch.Tensor, float]


def _norm_out_ref(y: torch.Tensor, norm_out: NormOut | None) -> torch.Tensor:
    _check_norm_out(norm_out, (y.shape[0], y.shape[1]), y.dtype)
    if norm_out is not None:
        norm_out[0].copy_(rms_norm_ref(y, norm_out[1], norm_out[2]))
    return y


def _check_norm_out(norm_out: NormOut | None, y_shape: tuple[int, int], dtype: torch.dtype) -> None:
    if norm_out is None:
        return
    out, w, _ = norm_out
    check(
        tuple(out.shape) == y_shape and out.dtype == dtype and out.is_contiguous(),
        f"norm_out: out must be a contiguous {dtype} {list(y_shape)}, got {list(out.shape)} {out.dtype}",
    )
    check(
        tuple(w.shape) == (y_shape[1],) and w.dtype == dtype and w.is_contiguous(),
        f"norm_out: weight must be a contiguous {dtype} [{y_shape[1]}]",
    )


@jit
def _align_kernel(
    ids_ptr, pairs_ptr, bexp_ptr,
    P, E, NB,
    BM: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BNB: tl.constexpr, BS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # One program: `moe_align_ref` for few pairs (decode), by a [pairs, experts] one-hot and cumsums.
    p = tl.arange(0, BP)
    ex = tl.arange(0, BE)
    ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
    oh = ((ids[:, None] == ex[None, :]) & (p[:, None] < P) & (ex[None, :] < E)).to(tl.int32)
    counts = tl.sum(oh, axis=0)  # [BE]
    blocks = (counts + BM - 1) // BM
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    rank = tl.sum((tl.cumsum(oh, axis=0) - oh) * oh, axis=1)  # earlier pairs of the same expert
    start = tl.sum(oh * block_start[None, :], axis=1)
    valid = tl.sum(oh, axis=1) > 0
    # every slot starts as padding (P); then each valid pair lands at its slot
    for s0 in tl.range(0, NB * BM, BS):
        so = s0 + tl.arange(0, BS)
        tl.store(pairs_ptr + so, tl.zeros([BS], dtype=tl.int32) + P, mask=so < NB * BM)
    tl.debug_barrier()
    tl.store(pairs_ptr + start * BM + rank, p.to(tl.int32), mask=valid)
    b = tl.arange(0, BNB)
    owner = tl.sum(((block_end[None, :] <= b[:, None]) & (ex[None, :] < E)).to(tl.int32), axis=1)
    tl.store(bexp_ptr + b, tl.where(owner < E, owner, -1), mask=b < NB)


# One program holds a [pairs, experts] one-hot: above this many elements the torch sort is used.
_ALIGN_ONE_PROGRAM_MAX = 1 << 16


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align_ref`, as one kernel when there are few pairs (decode) on the Triton path."""
    p = topk_ids.numel()
    e = num_experts
    if topk_ids.device.type != "cuda" and not triton_interpret():
        return moe_align_ref(topk_ids, e, block_m)
    bp, be = next_pow2(p), next_pow2(e)
    if p == 0 or bp * be > _ALIGN_ONE_PROGRAM_MAX:
        return moe_align_ref(topk_ids, e, block_m)
    nb = cdiv(p, block_m) + min(e, p)
    pairs = torch.empty(nb * block_m, dtype=torch.int32, device=topk_ids.device)
    bexp = torch.empty(nb, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1).contiguous(), pairs, bexp, p, e, nb,
        BM=block_m, BP=bp, BE=be, BNB=next_pow2(nb), BS=min(1024, next_pow2(nb * block_m)),
        **pdl(topk_ids.device),
    )  # fmt: skip
    return pairs, bexp


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert into BLOCK_M-padded runs, on the device with no host sync.

    topk_ids [T, k] -> (sorted_pairs int32 [NB * block_m], block_expert int32 [NB]) with
    NB = cdiv(T*k, block_m) + min(E, T*k). sorted_pairs holds pair ids p = t*k + j (T*k = padding);
    block b covers sorted_pairs[b*block_m : (b+1)*block_m], all of expert block_expert[b] (-1 = unused).
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    p = flat.numel()
    e = num_experts
    ok = (flat >= 0) & (flat < e)
    bucket = torch.where(ok, flat, e)  # bucket E collects ids to ignore
    counts = torch.zeros(e + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    # Blocks per expert; bucket E (ignored ids) gets none. No `blocks[e] = 0`: a Python scalar stored into a
    # CUDA tensor is a pageable host->device copy (a stream sync, and it breaks CUDA graph capture).
    blocks = torch.cat([(counts[:e] + block_m - 1) // block_m, counts[e:] * 0])
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(bucket, stable=True)  # pair ids grouped by expert
    b_sorted = bucket[order]
    dest = block_start[b_sorted] * block_m + (torch.arange(p, device=dev) - count_start[b_sorted])
    nb = cdiv(p, block_m) + min(e, p)
    dest = torch.where(b_sorted < e, dest, nb * block_m)  # ignored pairs land in a dropped slot
    sorted_pairs = torch.full((nb * block_m + 1,), p, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end[:e], torch.arange(nb, device=dev), right=True)
    block_expert = torch.where(block_expert < e, block_expert, -1).to(torch.int32)
    return sorted_pairs[: nb * block_m], block_expert


@jit
def _gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, pairs_ptr, bexp_ptr, h_ptr,
    P, HD, I, TOPK,
    s_xt, s_we, s_wn, s_wse, s_wsn, s_ht,
    FP8: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m)
    if ex >= 0:
        pair = tl.load(pairs_ptr + pid_m * BM + tl.arange(0, BM))
        mask_m = pair < P
        tok = (pair // TOPK).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < I
        wg_ptr = w_ptr + ex.to(tl.int64) * s_we + offs_n[:, None].to(tl.int64) * s_wn  # gate rows
        wu_ptr = wg_ptr + I * s_wn  # up rows: the second half of the packed matrix
        sg_ptr = ws_ptr + ex.to(tl.int64) * s_wse + (offs_n // 128) * s_wsn
        su_ptr = ws_ptr + ex.to(tl.int64) * s_wse + ((offs_n + I) // 128) * s_wsn
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, HD, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask_k = offs_k < HD
            a = tl.load(
                x_ptr + tok[:, None] * s_xt + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            wmask = mask_n[:, None] & mask_k[None, :]
            wg = tl.load(wg_ptr + offs_k[None, :], mask=wmask, other=0.0)  # [BN, BK]
            wu = tl.load(wu_ptr + offs_k[None, :], mask=wmask, other=0.0)
            if X16:  # e4m3 weights, bf16 x: fp16 MMA on power-of-two-scaled rows (`fp16_rows`)
                a16, inv = fp16_rows(a)
                sg = tl.load(sg_ptr + k0 // 128, mask=mask_n, other=0.0)
                su = tl.load(su_ptr + k0 // 128, mask=mask_n, other=0.0)
                acc_g += mma(a16, tl.trans(wg.to(tl.float16)), F32) * sg[None, :] * inv[:, None]
                acc_u += mma(a16, tl.trans(wu.to(tl.float16)), F32) * su[None, :] * inv[:, None]
            elif FP8:
                wg = wg.to(a.dtype)
                wu = wu.to(a.dtype)
                acc_g += (
                    mma(a, tl.trans(wg), F32) * tl.load(sg_ptr + k0 // 128, mask=mask_n, other=0.0)[None, :]
                )
                acc_u += (
                    mma(a, tl.trans(wu), F32) * tl.load(su_ptr + k0 // 128, mask=mask_n, other=0.0)[None, :]
                )
            else:
                acc_g += mma(a, tl.trans(wg.to(a.dtype)), F32)
                acc_u += mma(a, tl.trans(wu.to(a.dtype)), F32)
        hval = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(
            h_ptr + pair[:, None].to(tl.int64) * s_ht + offs_n[None, :],
            hval.to(h_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


@jit
def _down_kernel(
    h_ptr, w_ptr, ws_ptr, pairs_ptr, bexp_ptr, tw_ptr, o_ptr,
    P, HD, I,
    s_ht, s_we, s_wn, s_wse, s_wsn, s_ot,
    FP8: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m)
    if ex >= 0:
        pair = tl.load(pairs_ptr + pid_m * BM + tl.arange(0, BM))
        mask_m = pair < P
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < HD
        wd_ptr = w_ptr + ex.to(tl.int64) * s_we + offs_n[:, None].to(tl.int64) * s_wn
        sd_ptr = ws_ptr + ex.to(tl.int64) * s_wse + (offs_n // 128) * s_wsn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask_k = offs_k < I
            a = tl.load(
                h_ptr + pair64[:, None] * s_ht + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            w = tl.load(wd_ptr + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if X16:  # as in _gate_up_kernel
                a16, inv = fp16_rows(a)
                sd = tl.load(sd_ptr + k0 // 128, mask=mask_n, other=0.0)
                acc += mma(a16, tl.trans(w.to(tl.float16)), F32) * sd[None, :] * inv[:, None]
            elif FP8:
                acc += (
                    mma(a, tl.trans(w.to(a.dtype)), F32)
                    * tl.load(sd_ptr + k0 // 128, mask=mask_n, other=0.0)[None, :]
                )
            else:
                acc += mma(a, tl.trans(w.to(a.dtype)), F32)
        rw = tl.load(tw_ptr + pair64, mask=mask_m, other=0.0)
        acc = acc * rw[:, None]
        tl.store(
            o_ptr + pair64[:, None] * s_ot + offs_n[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def moe_combine_ref(
    pair_out: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_out: NormOut | None = None,
) -> torch.Tensor:
    """The routed experts' per-pair outputs [T, k, Hd] -> residual + (their sum + shared) [T, Hd] (and its
    RMSNorm into `norm_out`'s buffer, `NormOut`).

    Slots whose id is outside [0, num_experts) count as zero (their rows may hold anything)."""
    ok = (topk_ids >= 0) & (topk_ids < num_experts)
    y = torch.where(ok[..., None], pair_out, torch.zeros((), dtype=pair_out.dtype)).sum(dim=1)
    return _norm_out_ref(_add_ref(y, shared, residual), norm_out)


@jit
def _combine_cols(
    p_ptr, s_ptr, r_ptr, y_ptr, t, c, cm, ks, ok, like, S, s_ps, s_pt, s_pk, s_st, s_rt, s_yt,
    SHARED: tl.constexpr, RESIDUAL: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row t's columns c of the combine, stored; returns them (fp32 values of y's dtype)."""
    v = tl.zeros([KP, BLOCK], dtype=tl.float32)
    for s in range(0, S):
        ptrs = p_ptr + s * s_ps + t * s_pt + ks[:, None] * s_pk + c[None, :]
        v += tl.load(ptrs, mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
    # torch's sum over the slots accumulates in fp32 and rounds once; each add then rounds
    y = round_as(tl.sum(v, axis=0), like)
    if SHARED:
        y = round_as(y + tl.load(s_ptr + t * s_st + c, mask=cm, other=0.0).to(tl.float32), like)
    if RESIDUAL:
        y = round_as(tl.load(r_ptr + t * s_rt + c, mask=cm, other=0.0).to(tl.float32) + y, like)
    tl.store(y_ptr + t * s_yt + c, y.to(y_ptr.dtype.element_ty), mask=cm)
    return y


@jit
def _combine_kernel(
    p_ptr, ids_ptr, s_ptr, r_ptr, y_ptr, w_ptr, n_ptr,
    E, HD, K, S, s_ps, s_pt, s_pk, s_it, s_st, s_rt, s_yt, s_nt, eps,
    SHARED: tl.constexpr, RESIDUAL: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # p_ptr: S split partials of [T, K, HD] (S = 1 but for the decode path's fp32 split-K partials).
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    ids = tl.load(ids_ptr + t * s_it + ks, mask=ks < K, other=-1)
    ok = (ids >= 0) & (ids < E)
    like = tl.zeros([1], dtype=y_ptr.dtype.element_ty)
    if NORM:
        # one program per row: its columns block by block, then the RMSNorm of the row (kernels.norm's
        # rounding) from the values this program stored, read back after a barrier
        ssq = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, HD, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            cm = c < HD
            y = _combine_cols(
                p_ptr, s_ptr, r_ptr, y_ptr, t, c, cm, ks, ok, like, S, s_ps, s_pt, s_pk, s_st, s_rt, s_yt,
                SHARED, RESIDUAL, KP, BLOCK,
            )  # fmt: skip
            ssq += y * y
        inv = 1.0 / tl.sqrt(tl.sum(ssq, axis=0) / HD + eps)
        tl.debug_barrier()
        for c0 in range(0, HD, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            cm = c < HD
            y = tl.load(y_ptr + t * s_yt + c, mask=cm, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
            tl.store(n_ptr + t * s_nt + c, rms_scale(y, inv, w, like).to(n_ptr.dtype.element_ty), mask=cm)
    else:
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        _combine_cols(
            p_ptr, s_ptr, r_ptr, y_ptr, t, c, c < HD, ks, ok, like, S, s_ps, s_pt, s_pk, s_st, s_rt, s_yt,
            SHARED, RESIDUAL, KP, BLOCK,
        )  # fmt: skip


def moe_combine(
    pair_out: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_out: NormOut | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """`moe_combine_ref` in one kernel (a program per token and column block; with `norm_out` a program
    per token). pair_out [T, k, Hd] float with unit last stride; topk_ids [T, k] int with unit last
    stride; shared and residual [T, Hd] in pair_out's dtype with unit last stride. Returns a new
    contiguous [T, Hd]."""
    if not use_triton(backend, pair_out.device):
        return moe_combine_ref(pair_out, topk_ids, num_experts, shared, residual, norm_out)
    check(
        pair_out.dim() == 3 and pair_out.stride(2) == 1, "moe_combine: pair_out [T, k, Hd], unit last stride"
    )
    t, k, hd = pair_out.shape
    check(
        topk_ids.shape == (t, k) and not topk_ids.is_floating_point() and (k == 0 or topk_ids.stride(1) == 1),
        f"moe_combine: topk_ids must be int [{t}, {k}] with unit last stride",
    )
    for name, a in (("shared", shared), ("residual", residual)):
        check(
            a is None or (a.shape == (t, hd) and a.dtype == pair_out.dtype and a.stride(1) == 1),
            f"moe_combine: {name} must be {pair_out.dtype} [{t}, {hd}] with unit last stride",
        )
    return _combine(pair_out[None], topk_ids, num_experts, shared, residual, pair_out.dtype, norm_out)


def _combine(
    parts: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    shared: torch.Tensor | None,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
    norm_out: NormOut | None = None,
) -> torch.Tensor:
    """The combine kernel over S split partials parts [S, T, k, Hd] (summed in fp32 in split order,
    then rounded to `dtype` as one [T, k, Hd] of that dtype would be); inputs as `moe_combine`'s."""
    _, t, k, hd = parts.shape
    _check_norm_out(norm_out, (t, hd), dtype)
    y = torch.empty(t, hd, dtype=dtype, device=parts.device)
    if t and hd:
        s = shared if shared is not None else y
        r = residual if residual is not None else y
        n, w, eps = norm_out if norm_out is not None else (y, y, 0.0)
        kp = next_pow2(max(k, 1))
        # NORM: one program a row, [KP, BLOCK] fp32 a block (at most 8K values in registers)
        block = min(next_pow2(hd), 1024 if norm_out is None else max(16, 8192 // kp))
        _combine_kernel[(t, 1 if norm_out is not None else cdiv(hd, block))](
            parts, topk_ids, s, r, y, w, n, num_experts, hd, k, parts.shape[0],
            parts.stride(0), parts.stride(1), parts.stride(2), topk_ids.stride(0), s.stride(0), r.stride(0),
            y.stride(0), n.stride(0), float(eps),
            SHARED=shared is not None, RESIDUAL=residual is not None, KP=kp, BLOCK=block,
            NORM=norm_out is not None, **pdl(parts.device),
        )  # fmt: skip
    return y


# Shared memory per SM on the H200 is 227 KB (232448 bytes per block); keep a margin for Triton's own
# layout-conversion scratch.
_SMEM_BUDGET = 200 * 1024


def _moe_smem(bm: int, bn: int, bk: int, stages: int, x_bytes: int, w_bytes: int) -> int:
    """Shared memory of the pipelined gate-up kernel (the larger of the two): per stage an x tile and the
    gate and up weight tiles, each in the dtype it is loaded in."""
    return stages * (bm * bk * x_bytes + 2 * bn * bk * w_bytes)


def _pick_moe_tiles(
    t: int, k: int, e: int, hd: int = 1 << 30, inter: int = 1 << 30, x_bytes: int = 2, w_bytes: int = 1
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for T tokens, top-k of E experts, hidden `hd`,
    intermediate `inter`, activation/weight element sizes. Never returns a config over the shared-memory
    budget: stages, then BLOCK_K, then BLOCK_N shrink until it fits (fp32 weights at tiny dims used to ask
    for 288 KB)."""
    per_expert = t * k / max(1, e)
    if per_expert <= 16:
        # Decode is a weight stream: BLOCK_M=16 (the smallest tensor-core M). H200 sweep at GLM-5.3 shapes
        # (bench/results/moe-decode-h200.md): BLOCK_N=64 with 4 stages reads the hit experts at 0.59 of
        # HBM at batch 1 and 0.84 at batch 8 (120.5 / 572 us), against 0.58 / 0.70 for the previous
        # BLOCK_N=32 with 5 stages (122.5 / 688 us).
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif per_expert <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    # Tiles no larger than the problem (tiny test models: hd 64, inter 32); tl.dot needs >= 16.
    bk = min(bk, max(16, next_pow2(min(hd, inter))))
    bn = min(bn, max(16, next_pow2(max(hd, inter))))
    while _moe_smem(bm, bn, bk, stages, x_bytes, w_bytes) > _SMEM_BUDGET:
        if stages > 2:
            stages -= 1
        elif bk > 32:
            bk //= 2
        elif bn > 16:
            bn //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    return bm, bn, bk, warps, stages


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str = "silu",
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    join: Callable[[], None] | None = None,
    norm_out: NormOut | None = None,
    backend: str = "auto",
    tiles: tuple[int, int, int, int, int] | None = None,
    decode: bool | DecodeConfig | None = None,
    stream: bool | StreamConfig | None = None,
) -> torch.Tensor:
    """Routed experts with the contract of `moe_experts_ref` (layouts in the module docstring); Triton when
    `common.use_triton(backend, device)` says so, else the reference.

    x [T, Hd] float, unit column stride; topk_ids [T, k] int; topk_w [T, k] float; weights and scales contiguous.
    `decode` picks the Triton path: None (default) `moe_decode` for at most DECODE_MAX_PAIRS pairs (T*k)
    and the grouped GEMMs above that (or when `tiles` is given); True / a `moe_decode.DecodeConfig` the decode path (its tiles);
    False the grouped GEMMs. `stream`: None (default) `moe_stream` for at most STREAM_MAX_PAIRS pairs
    when it supports the weights (fp8, Hd and I multiples of 128) and neither `decode` nor `tiles` is
    given; True / a `moe_stream.StreamConfig` that path (raises if unsupported); False never.
    `tiles` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the grouped GEMMs' heuristic
    (bench).
    Returns y [T, Hd] in x's dtype (plus `shared` and `residual`, [T, Hd] with unit column stride,
    added by the combine kernel). `join`, if given, is called once the experts' kernels are queued and
    before the combine reads `shared` (which a side stream may still be making). `norm_out` (`NormOut`):
    the combine also writes the result's RMSNorm into its buffer.
    """
    if not use_triton(backend, x.device):
        return moe_experts_ref(
            x, topk_ids, topk_w, w_gate_up, w_down, act, w_gate_up_scale, w_down_scale,
            shared=shared, residual=residual, join=join, norm_out=norm_out,
        )  # fmt: skip
    t, hd, e, inter, k, fp8 = _check_experts(
        x, topk_ids, topk_w, w_gate_up, w_down, act, w_gate_up_scale, w_down_scale, shared, residual
    )
    check(x.stride(1) == 1, "moe_experts: x needs unit column stride")
    check(w_gate_up.is_contiguous() and w_down.is_contiguous(), "moe_experts: weights must be contiguous")
    join = join or _no_join
    if t == 0 or k == 0:
        join()
        return _norm_out_ref(_add_ref(torch.zeros_like(x), shared, residual), norm_out)
    ids = topk_ids if topk_ids.stride(1) == 1 else topk_ids.contiguous()
    if stream is None:
        stream = (
            decode is None and tiles is None and t * k <= STREAM_MAX_PAIRS and stream_supports(hd, inter, fp8)
        )
    if stream is not False:
        check(fp8, "moe_experts: the stream path needs fp8 block weights")
        scfg = stream if isinstance(stream, StreamConfig) else None
        assert w_gate_up_scale is not None and w_down_scale is not None  # fp8: checked above
        s_gu, s_d = w_gate_up_scale.contiguous(), w_down_scale.contiguous()
        parts = experts_stream(x, ids, topk_w, w_gate_up, w_down, s_gu, s_d, scfg)
        join()
        return _combine(parts, ids, e, shared, residual, x.dtype, norm_out)
    if decode is None:
        decode = tiles is None and t * k <= DECODE_MAX_PAIRS
    if decode is not False:
        cfg = decode if isinstance(decode, DecodeConfig) else None
        sgu, sd = (w_gate_up_scale.contiguous(), w_down_scale.contiguous()) if fp8 else (None, None)  # type: ignore[union-attr]
        parts = experts_decode(x, ids, topk_w, w_gate_up, w_down, sgu, sd, cfg)
        join()
        return _combine(parts, ids, e, shared, residual, x.dtype, norm_out)
    bm, bn, bk, warps, stages = tiles or _pick_moe_tiles(
        t, k, e, hd, inter, x.element_size(), w_gate_up.element_size()
    )
    check(bk <= 128 and 128 % bk == 0, "moe_experts: BLOCK_K must divide 128")
    dev = x.device
    p = t * k
    sorted_pairs, block_expert = moe_align(topk_ids, e, bm)
    nb = block_expert.numel()
    bn_gu = bn_d = bn
    if tiles is None and FILL_SMS:
        sms = num_sms(x.device, cpu=0)  # (the interpreter's tiny grids: no point in more programs)
        bn_gu, bn_d = fill_sms_bn(bn, nb, inter, sms), fill_sms_bn(bn, nb, hd, sms)
    h = torch.empty(p, inter, dtype=x.dtype, device=dev)
    out = torch.empty(p, hd, dtype=x.dtype, device=dev)  # the combine skips the rows of ignored ids
    tw = topk_w.reshape(-1).float().contiguous()
    f32 = x.dtype == torch.float32 or triton_interpret()
    x16 = fp8 and x.dtype == torch.bfloat16 and bm <= FP16_MMA_MAX_BM
    sgu = w_gate_up_scale.contiguous() if fp8 else w_gate_up  # type: ignore[union-attr]
    sd = w_down_scale.contiguous() if fp8 else w_down  # type: ignore[union-attr]
    _gate_up_kernel[(nb, cdiv(inter, bn_gu))](
        x, w_gate_up, sgu, sorted_pairs, block_expert, h,
        p, hd, inter, k,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), sgu.stride(0), sgu.stride(1), h.stride(0),
        FP8=fp8, X16=x16, F32=f32, BM=bm, BN=bn_gu, BK=bk, num_warps=warps, num_stages=stages, **pdl(dev),
    )  # fmt: skip
    _down_kernel[(nb, cdiv(hd, bn_d))](
        h, w_down, sd, sorted_pairs, block_expert, tw, out,
        p, hd, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), sd.stride(0), sd.stride(1), out.stride(0),
        FP8=fp8, X16=x16, F32=f32, BM=bm, BN=bn_d, BK=bk, num_warps=warps, num_stages=stages, **pdl(dev),
    )  # fmt: skip
    join()
    return moe_combine(out.view(t, k, hd), ids, e, shared, residual, norm_out, backend="triton")
