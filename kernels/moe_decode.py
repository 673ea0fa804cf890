"""Routed experts for a few tokens (decode): a stream of the selected experts' weights.

At decode each selected expert sees one token or a handful (GLM-5.3 at batch 1: 8 experts of
[4096, 6144] + [6144, 2048] e4m3, 302 MB, for one row of x), so the time is those bytes over the HBM
read rate. `moe.py`'s grouped GEMMs are shaped for M: an align kernel sorts the pairs into BLOCK_M = 16
row blocks (one real row each at batch 1), the weight tiles are 32 rows (mma.sync, not a warpgroup's
wgmma, and x's 16-row tile is loaded and rescaled to fp16 for every 32 gate + 32 up rows), and at batch 1
the down projection is 1536 programs of only 16 K steps (~2 waves at 6 per SM). This path is `gemv.py`'s
weight stream per expert:

  * no align: the grid's first axis is the T*k (token, slot) pairs. A program leads when its pair is
    the first of its expert (the BM-th, 2*BM-th, ... when one expert has more than BM pairs) and then
    serves up to BM pairs of that expert, found in the kernel from the k ids of the T tokens (a
    [BM, pairs] one-hot: a few hundred elements). Other programs, and ids outside [0, E), exit.
  * swap-AB: the weight tile is the MMA's M side (acc [BN, BM] = W[BN, BK] @ x[BM, BK]^T) and the
    pairs pad only the narrow side to 16, as in `gemv`; fp8 weights with bf16 x go through the fp16
    MMA of `fp8_gemm.fp16_rows`, the block scale multiplies each 128-column partial.
  * `_gate_up_kernel`: program (pair, BN rows of I): BN gate and BN up rows over all of Hd, then
    silu(gate) * up rounded to x's dtype into h [T*k, I] (as `moe.py`; no split-K, so the activation
    needs no second pass).
  * `_down_kernel`: program (pair, BN rows of Hd, split of I): h @ w_down.T over the split's whole
    128-column blocks, times the routing weight, into fp32 partials [S, T*k, Hd]; `moe.py`'s combine
    kernel sums splits and slots in a fixed order (deterministic, no atomics) and adds the shared
    experts' output and the residual.
Three launches (gate-up, down, combine) instead of four, no host sync, graph-safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from .common import check, jit, next_pow2, num_sms, pdl, pdl_wait, round_as, tl, triton_interpret
from .fp8_gemm import FP8_BLOCK, cdiv, fp16_rows, mma

# Pairs (token, slot) served by one leading program: the MMA's narrow side (16 is its minimum).
BM = 16
# Down-projection programs to aim for per SM (split-K supplies them when the experts' row tiles do not):
# two waves of ~4 resident programs, so the last programs to start do not leave most SMs idle.
PROGRAMS_PER_SM = 8
# LONGCTX_MOE_FILL_SMS=1: weight-streaming grids at decode shrink their BLOCK_N (not below 16) until they have
# a program for every SM (`fill_sms_bn`), for `moe`'s grouped GEMMs (both kernels) and this path's gate-up at
# its default tiles. Off by default: small-1m's 128K batch-1 decode on an H100 (s61, bench/results/s61.md)
# ran its gate-up (4 experts x 32 slabs of 16 rows instead of 8 of 64) 1.8 us slower a MoE layer, align end
# to gate-up end 12.7 against 10.9 us, and the down projection's end 1.2 us later; the step's median was
# 1.185 against 1.179 ms.
FILL_SMS = os.environ.get("LONGCTX_MOE_FILL_SMS", "0").strip() == "1"


def fill_sms_bn(bn: int, blocks: int, n: int, sms: int) -> int:
    """BLOCK_N for a grid of `blocks` row blocks x cdiv(n, BLOCK_N) slabs: `bn` halved (not below 16) while
    the grid has fewer programs than `sms`. A weight-streaming program moves its slab at one SM's rate, so
    an underfilled grid leaves HBM idle however large its tiles (GLM-5.3's 8 experts x 32 slabs keep 64)."""
    while bn > 16 and blocks * cdiv(n, bn) < sms:
        bn //= 2
    return bn


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the decode path, per kernel: `bn_gate_up` rows of gate (and as many of up) per gate-up
    program and `bn_down` rows of w_down per down program, their warps and pipeline stages; BK columns
    per K step (divides 128; None: 128 bytes of a weight row, 128 e4m3 or 64 bf16) for both; the down
    projection's split-K factor (None: `pick_splits`)."""

    bn_gate_up: int = 64
    warps_gate_up: int = 4
    stages_gate_up: int = 4
    bn_down: int = 64
    warps_down: int = 4
    stages_down: int = 4
    splits_down: int | None = None
    bk: int | None = None


def parse_tiles(spec: str, base: DecodeConfig) -> DecodeConfig:
    """`base` with the fields named in `spec` replaced: "bn_gate_up=32,splits_down=4" (DecodeConfig's
    field names; "none" for splits_down / bk)."""
    kw: dict[str, int | None] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, val = item.partition("=")
        check(
            name in DecodeConfig.__dataclass_fields__ and (val.isdigit() or val == "none"),
            f"LONGCTX_MOE_DECODE_TILES: {item!r} is not <DecodeConfig field>=<int>",
        )
        kw[name] = None if val == "none" else int(val)
    return replace(base, **kw)  # type: ignore[arg-type]


# The default, chosen before any GPU run (`python -m bench.kernels_mla_moe --moe-decode` times each knob
# alone around it; set the winners here). Figures from Triton 3.9 for sm_90a at GLM-5.3 shapes, fp8
# weights and bf16 x. 64-row weight tiles are one warpgroup's wgmma M (as `gemv`'s best fp8 tiles);
# 128 e4m3 columns per K step (one scale block), 4 stages: 3 steps of cp.async loads in flight. (bf16
# weights take 64 columns: 128 would need 144 KB of shared memory for the gate-up kernel.)
#   gate-up: 64 gate + 64 up rows = 16 KB of weights per step, 48 KB in flight; 177 registers and
#     64 KB of shared memory: 2 programs per SM, 264 on the 132 SMs, and batch 1's 8 experts x 32 row
#     tiles = 256 programs run as one wave (32 rows: 3 per SM, 396 slots for 512 programs; 1.3 waves).
#   down: 8 KB per step; 137 registers, 40 KB: 3 per SM; batch 1's 768 row tiles x `pick_splits`' 2 =
#     1536 programs of 8 steps, ~4 waves (the last wave's idle SMs are a small share).
# LONGCTX_MOE_DECODE_TILES (`parse_tiles`' form) overrides knobs of it for a process (A/B benches).
DEFAULT = parse_tiles(os.environ.get("LONGCTX_MOE_DECODE_TILES", ""), DecodeConfig())


def pick_splits(groups: int, tiles_n: int, inter: int, sms: int) -> int:
    """Split-K of the down projection: PROGRAMS_PER_SM programs per SM for `groups` experts of
    `tiles_n` row tiles, at most one split per 128-column block of I."""
    return max(1, min(cdiv(PROGRAMS_PER_SM * sms, groups * tiles_n), cdiv(inter, FP8_BLOCK)))


@jit
def _group(ids_ptr, pid, P, E, PP: tl.constexpr, BM: tl.constexpr):
    """Whether program `pid` leads, its expert, and the pair ids [BM] (with their mask) it serves.

    Pair q's rank is the number of earlier pairs of the same expert; pid leads if its rank is a multiple
    of BM and serves the pairs of ranks [rank, rank + BM)."""
    q = tl.arange(0, PP)
    ids = tl.load(ids_ptr + q, mask=q < P, other=-1)
    ex = tl.load(ids_ptr + pid)
    valid = (ex >= 0) & (ex < E)
    same = ((ids == ex) & (q < P)).to(tl.int32)
    rank = tl.cumsum(same, axis=0) - same  # [PP]
    mine = tl.sum(tl.where(q == pid, rank, 0), axis=0)
    r = tl.arange(0, BM)
    hit = (same[None, :] > 0) & (rank[None, :] == mine + r[:, None])  # [BM, PP]
    pairs = tl.sum(tl.where(hit, q[None, :], 0), axis=1)
    ok = tl.sum(hit.to(tl.int32), axis=1) > 0
    return valid & (mine % BM == 0), ex.to(tl.int64), pairs.to(tl.int64), ok


@jit
def _w_dot(w, x16, inv, ws_rows, k0, mask_n, FP8: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr):
    """[BN, BM] fp32 partial of a weight tile [BN, BK] and the x tile [BM, BK] (`x16`, with the inverse
    row scales `inv` when X16: `fp16_rows`), block-scaled if FP8."""
    if X16:
        part = mma(w.to(tl.float16), tl.trans(x16), F32)
        part = part * tl.load(ws_rows + k0 // 128, mask=mask_n, other=0.0)[:, None] * inv[None, :]
    else:
        part = mma(w.to(x16.dtype), tl.trans(x16), F32)
        if FP8:
            part = part * tl.load(ws_rows + k0 // 128, mask=mask_n, other=0.0)[:, None]
    return part


@jit
def _x_tile(x, X16: tl.constexpr):
    """The x tile as `_w_dot` takes it: fp16 rows scaled by powers of two (and their inverses) if X16."""
    if X16:
        x16, inv = fp16_rows(x)
    else:
        x16, inv = x, tl.zeros([x.shape[0]], dtype=tl.float32)
    return x16, inv


@jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, h_ptr,
    P, E, HD, I, TOPK,
    s_xt, s_we, s_wn, s_wse, s_wsn, s_hp,
    FP8: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr,
    PP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # Whole BK steps run without a K mask, so the weight loads keep their 16-byte vectors; the partial
    # last step, if any, runs once with the mask (as in gemv).
    lead, ex, pair, ok = _group(ids_ptr, tl.program_id(0), P, E, PP, BM)
    if lead:
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < I
        wg_rows = w_ptr + ex * s_we + offs_n[:, None].to(tl.int64) * s_wn  # [BN, 1] gate rows
        wu_rows = wg_rows + I * s_wn  # up rows: the second half of the packed matrix
        sg_rows = ws_ptr + ex * s_wse + (offs_n // 128) * s_wsn
        su_rows = ws_ptr + ex * s_wse + ((offs_n + I) // 128) * s_wsn
        x_rows = x_ptr + (pair // TOPK)[:, None] * s_xt  # [BM, 1]
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
        k_full = HD // BK * BK
        for k0 in range(0, k_full, BK):
            offs_k = k0 + tl.arange(0, BK)
            x16, inv = _x_tile(tl.load(x_rows + offs_k[None, :], mask=ok[:, None], other=0.0), X16)
            wg = tl.load(wg_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            wu = tl.load(wu_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            acc_g += _w_dot(wg, x16, inv, sg_rows, k0, mask_n, FP8, X16, F32)
            acc_u += _w_dot(wu, x16, inv, su_rows, k0, mask_n, FP8, X16, F32)
        if k_full < HD:
            offs_k = k_full + tl.arange(0, BK)
            mk = offs_k < HD
            xm = ok[:, None] & mk[None, :]
            x16, inv = _x_tile(tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0), X16)
            wm = mask_n[:, None] & mk[None, :]
            wg = tl.load(wg_rows + offs_k[None, :], mask=wm, other=0.0)
            wu = tl.load(wu_rows + offs_k[None, :], mask=wm, other=0.0)
            acc_g += _w_dot(wg, x16, inv, sg_rows, k_full, mask_n, FP8, X16, F32)
            acc_u += _w_dot(wu, x16, inv, su_rows, k_full, mask_n, FP8, X16, F32)
        h = round_as(acc_g * tl.sigmoid(acc_g) * acc_u, tl.zeros([1], dtype=h_ptr.dtype.element_ty))
        tl.store(
            h_ptr + pair[None, :] * s_hp + offs_n[:, None],
            h.to(h_ptr.dtype.element_ty),
            mask=mask_n[:, None] & ok[None, :],
        )


@jit
def _down_kernel(
    h_ptr, ids_ptr, tw_ptr, w_ptr, ws_ptr, o_ptr,
    P, E, HD, I, K_SPLIT,
    s_hp, s_we, s_wn, s_wse, s_wsn, s_os,
    FP8: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr,
    PP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    lead, ex, pair, ok = _group(ids_ptr, tl.program_id(0), P, E, PP, BM)
    if lead:
        pid_k = tl.program_id(2)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < HD
        w_rows = w_ptr + ex * s_we + offs_n[:, None].to(tl.int64) * s_wn
        ws_rows = ws_ptr + ex * s_wse + (offs_n // 128) * s_wsn
        h_rows = h_ptr + pair[:, None] * s_hp
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, I)
        k_full = k_lo + (k_hi - k_lo) // BK * BK
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(k_lo, k_full, BK):
            offs_k = k0 + tl.arange(0, BK)
            x16, inv = _x_tile(tl.load(h_rows + offs_k[None, :], mask=ok[:, None], other=0.0), X16)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            acc += _w_dot(w, x16, inv, ws_rows, k0, mask_n, FP8, X16, F32)
        if k_full < k_hi:
            offs_k = k_full + tl.arange(0, BK)
            mk = offs_k < k_hi
            x16, inv = _x_tile(
                tl.load(h_rows + offs_k[None, :], mask=ok[:, None] & mk[None, :], other=0.0), X16
            )
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0)
            acc += _w_dot(w, x16, inv, ws_rows, k_full, mask_n, FP8, X16, F32)
        acc = acc * tl.load(tw_ptr + pair, mask=ok, other=0.0)[None, :]
        tl.store(
            o_ptr + pid_k.to(tl.int64) * s_os + pair[None, :] * HD + offs_n[:, None],
            acc,
            mask=mask_n[:, None] & ok[None, :],
        )


def experts_decode(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """The routed experts' per-pair outputs as fp32 split partials [S, T, k, Hd] (routing weight applied;
    rows of ids outside [0, E) unwritten): `moe.moe_experts`'s decode path, whose combine sums them.

    Inputs as `moe.moe_experts` after its checks: x [T, Hd] unit column stride, topk_ids [T, k] int,
    weights and scales contiguous (fp8 iff the scales are given). `config` overrides DEFAULT."""
    cfg = config or DEFAULT
    t, hd = x.shape
    e, two_i, _ = w_gate_up.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    p = t * k
    fp8 = w_gate_up_scale is not None
    dev = x.device
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_w.reshape(-1).float().contiguous()
    bk = min(cfg.bk or 128 // w_gate_up.element_size(), max(16, next_pow2(min(hd, inter))))
    bn_gu = min(cfg.bn_gate_up, max(16, next_pow2(inter)))
    if config is None and FILL_SMS:
        bn_gu = fill_sms_bn(bn_gu, p, inter, num_sms(dev, cpu=0))  # (not on the interpreter)
    bn_d = min(cfg.bn_down, max(16, next_pow2(hd)))
    tiles_d = cdiv(hd, bn_d)
    splits = cfg.splits_down or pick_splits(min(p, e), tiles_d, inter, num_sms(dev))
    kb = cdiv(inter, FP8_BLOCK)
    k_split = cdiv(kb, max(1, min(splits, kb))) * FP8_BLOCK  # whole 128-column blocks per split
    splits = cdiv(inter, k_split)
    h = torch.empty(p, inter, dtype=x.dtype, device=dev)
    out = torch.empty(splits, p, hd, dtype=torch.float32, device=dev)
    f32 = x.dtype == torch.float32 or triton_interpret()
    x16 = fp8 and x.dtype == torch.bfloat16
    sgu = w_gate_up_scale if w_gate_up_scale is not None else w_gate_up  # not read unless FP8
    sd = w_down_scale if w_down_scale is not None else w_down
    common = dict(FP8=fp8, X16=x16, F32=f32, PP=next_pow2(p), BM=BM, BK=bk)
    _gate_up_kernel[(p, cdiv(inter, bn_gu))](
        x, ids, w_gate_up, sgu, h,
        p, e, hd, inter, k,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), sgu.stride(0) if fp8 else 0,
        sgu.stride(1) if fp8 else 0, h.stride(0),
        BN=bn_gu, num_warps=cfg.warps_gate_up, num_stages=cfg.stages_gate_up, **common, **pdl(dev),
    )  # fmt: skip
    _down_kernel[(p, tiles_d, splits)](
        h, ids, tw, w_down, sd, out,
        p, e, hd, inter, k_split,
        h.stride(0), w_down.stride(0), w_down.stride(1), sd.stride(0) if fp8 else 0,
        sd.stride(1) if fp8 else 0, out.stride(0),
        BN=bn_d, num_warps=cfg.warps_down, num_stages=cfg.stages_down, **common, **pdl(dev),
    )  # fmt: skip
    return out.view(splits, t, k, hd)
