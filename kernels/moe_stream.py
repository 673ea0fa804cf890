"""Routed experts with fp8 block weights for a few tokens: a persistent weight stream.

At decode (GLM-5.3 at batch 1: 8 experts of [4096, 6144] + [6144, 2048] e4m3, 302 MB for one row of
x) the time is the hit experts' bytes over the HBM read rate. What the two older paths leave on the
table on the H200 (bench/results/moe-decode-h200.md, profiler figures at batch 1):
  * `moe.py`'s grouped GEMMs: an align launch (3 us), then the down projection's 8 x 96 = 768 tiles of
    16 K steps at ~4 resident per SM are ~1.45 waves: the second wave leaves half the SMs idle, so
    down reads its 100 MB at 0.48 of the copy rate (49 us) while gate-up gets 0.71 (66 us).
  * `moe_decode`: no align, but the same one-tile-per-program grids (and a slower gate-up).
This path keeps `moe_decode`'s grouping (no align: a program serves up to BM pairs of one expert,
found in-kernel from the ids, `moe_decode._group`) and swap-AB tiles (weight rows are the MMA's M
side, the pairs its narrow N side), and changes:
  * persistent grids: `programs_per_sm` x SMs programs walk the (pair, row tile[, K split]) list, so
    every SM streams to the end instead of the last wave running on a fraction of them (0 = one
    program per tile, the old grids, for the A/B sweep);
  * whole 128 x 128 scale blocks: Hd and I are multiples of 128 and a row tile (<= 128 rows, a power
    of two) sits inside one block row, so each K step's dequantisation is one scalar per weight tile
    (no [BN] scale gather, no K masks: every load is a full 16-byte vector);
  * two MMA forms (`mma`):
      "fp16": e4m3 -> fp16 weights against x rows scaled to fp16 by powers of two (`fp16_rows`), the
              older paths' form (exact: only the summation order differs);
      "fp8":  the weights go to the fp8 tensor cores as loaded (no per-element conversion, which the
              gemv sweep found to limit fp8 streams: bench/results/gemv-h200.md); x's 128-column block is
              split as x ~= s * (hi + lo / 16) with hi, lo e4m3 (s = amax / 448 per row and block), two
              fp8 MMAs: ~8 significant bits of x, bf16's precision (relative error ~2^-9 per element),
              not bit-equal to the reference.
Three launches as `moe_decode` (gate-up writing silu(gate) * up in x's dtype to h [T*k, I]; down
writing routing-weighted fp32 split partials [S, T*k, Hd]; `moe.py`'s combine). No host sync, no
host->device copy: graph-safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

from .common import check, jit, next_pow2, num_sms, pdl, pdl_wait, round_as, tl, triton_interpret
from .fp8_gemm import FP8_BLOCK, cdiv, fp16_rows, mma, pow2
from .moe_decode import BM, _group

MMA_FORMS = ("fp16", "fp8")


@dataclass(frozen=True)
class StreamConfig:
    """Tiles: `bn_gate_up` gate rows (and as many up rows) per gate-up tile, `bn_down` rows of w_down per
    down tile (powers of two in [16, 128]); warps and pipeline stages per kernel; the down projection's
    K splits (None: enough tiles for `programs_per_sm`); programs per SM of both persistent grids (0:
    one program per tile); the MMA form ("fp16" or "fp8", module docstring). K steps are 128 columns."""

    bn_gate_up: int = 64
    warps_gate_up: int = 4
    stages_gate_up: int = 4
    bn_down: int = 64
    warps_down: int = 4
    stages_down: int = 4
    splits_down: int | None = None
    programs_per_sm: int = 2
    mma: str = "fp16"


def parse_config(spec: str, base: StreamConfig) -> StreamConfig:
    """`base` with the fields named in `spec` replaced: "bn_down=32,mma=fp8,splits_down=none"."""
    kw: dict[str, object] = {}
    names = {f.name for f in fields(StreamConfig)}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, val = item.partition("=")
        check(name in names, f"LONGCTX_MOE_STREAM_TILES: unknown field in {item!r}")
        if name == "mma":
            check(val in MMA_FORMS, f"LONGCTX_MOE_STREAM_TILES: mma must be one of {MMA_FORMS}")
            kw[name] = val
        else:
            check(val.isdigit() or val == "none", f"LONGCTX_MOE_STREAM_TILES: {item!r} needs an int")
            kw[name] = None if val == "none" else int(val)
    return replace(StreamConfig(), **{**vars(base), **kw})  # type: ignore[arg-type]


# Chosen before any GPU run (bench/moe8_sweep.py times it and its neighbours). The older paths' best
# decode tiles (64 rows, 128 e4m3 columns, 4 stages: 2 gate-up programs per SM by shared memory) with
# the grid made persistent at that residency. LONGCTX_MOE_STREAM_TILES overrides fields for a process.
DEFAULT = parse_config(os.environ.get("LONGCTX_MOE_STREAM_TILES", ""), StreamConfig())


def supports(hd: int, inter: int, fp8: bool) -> bool:
    """Whether this path serves the shape: fp8 weights with Hd and I whole 128-column blocks."""
    return fp8 and hd % FP8_BLOCK == 0 and inter % FP8_BLOCK == 0


@jit
def _e4m3_round(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still fp32: the cast to
    e4m3 after it is exact. Done by hand because the Triton 3.9 interpreter's fp32 -> e4m3 cast loses
    the carry when rounding up crosses a power of two (125.8 -> 64); the GPU's cvt would be fine."""
    e = ((tl.abs(v).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |v|)
    e = tl.maximum(e, -6)  # e4m3's subnormals share the smallest normal binade's spacing, 2^-9
    r = v * pow2(3 - e)  # the e4m3 mantissa step is 1 here; |r| < 16
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 adds round r to an integer, ties to even
    return r * pow2(e - 3)


@jit
def _x_fp8(a):
    """x tile [BM, 128] (one scale block) -> (hi, lo) e4m3 and the row scales s [BM] with
    a ~= s * (hi + lo / 16). Zero rows get s = 1 (hi = lo = 0)."""
    af = a.to(tl.float32)
    amax = tl.max(tl.abs(af), axis=1)
    s = tl.where(amax > 0, amax / 448.0, 1.0)  # 448: e4m3 max
    q = tl.minimum(tl.maximum(af / s[:, None], -448.0), 448.0)
    hi = _e4m3_round(q)
    lo = _e4m3_round((q - hi) * 16.0)  # |q - hi| <= half a step of hi's binade <= |q| / 16
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv), s


@jit
def _tile_dot(w, a, A8: tl.constexpr, F32: tl.constexpr):
    """[BN, BM] fp32 product of an e4m3 weight tile w [BN, 128] and an x tile a [BM, 128], the block
    scale not applied (the caller multiplies by one scalar)."""
    if A8:
        hi, lo, s = _x_fp8(a)
        part = mma(w, tl.trans(hi), F32) + mma(w, tl.trans(lo), F32) * 0.0625
        part = part * s[None, :]
    else:
        a16, inv = fp16_rows(a)
        part = mma(w.to(tl.float16), tl.trans(a16), F32) * inv[None, :]
    return part


@jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, h_ptr,
    P, E, HD, I, TOPK,
    s_xt, s_we, s_wn, s_wse, s_wsn, s_hp,
    A8: tl.constexpr, F32: tl.constexpr, PP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # Tiles: pair-major (pair, BN rows of I); a program takes every num_programs-th tile.
    tiles_n = I // BN
    rn = tl.arange(0, BN)
    rk = tl.arange(0, 128)
    for tile in range(tl.program_id(0), P * tiles_n, tl.num_programs(0)):
        lead, ex, pair, ok = _group(ids_ptr, tile // tiles_n, P, E, PP, BM)
        if lead:
            n0 = (tile % tiles_n) * BN
            wg_rows = w_ptr + ex * s_we + (n0 + rn)[:, None].to(tl.int64) * s_wn + rk[None, :]  # [BN, 128]
            wu_rows = wg_rows + I * s_wn  # up rows: the second half of the packed matrix
            sg_row = ws_ptr + ex * s_wse + (n0 // 128) * s_wsn  # BN <= 128 rows: one scale row
            su_row = ws_ptr + ex * s_wse + ((n0 + I) // 128) * s_wsn
            x_rows = x_ptr + (pair // TOPK)[:, None] * s_xt + rk[None, :]  # [BM, 128]
            acc_g = tl.zeros([BN, BM], dtype=tl.float32)
            acc_u = tl.zeros([BN, BM], dtype=tl.float32)
            for k0 in range(0, HD, 128):
                a = tl.load(x_rows + k0, mask=ok[:, None], other=0.0)
                wg = tl.load(wg_rows + k0)
                wu = tl.load(wu_rows + k0)
                acc_g += _tile_dot(wg, a, A8, F32) * tl.load(sg_row + k0 // 128)
                acc_u += _tile_dot(wu, a, A8, F32) * tl.load(su_row + k0 // 128)
            h = round_as(acc_g * tl.sigmoid(acc_g) * acc_u, tl.zeros([1], dtype=h_ptr.dtype.element_ty))
            tl.store(
                h_ptr + pair[None, :] * s_hp + (n0 + rn)[:, None],
                h.to(h_ptr.dtype.element_ty),
                mask=ok[None, :],
            )


@jit
def _down_kernel(
    h_ptr, ids_ptr, tw_ptr, w_ptr, ws_ptr, o_ptr,
    P, E, HD, I, K_SPLIT, S,
    s_hp, s_we, s_wn, s_wse, s_wsn, s_os,
    A8: tl.constexpr, F32: tl.constexpr, PP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # Tiles: (pair, BN rows of Hd, K split) with the split fastest; K_SPLIT is whole 128-column blocks.
    tiles_n = HD // BN
    rn = tl.arange(0, BN)
    rk = tl.arange(0, 128)
    for tile in range(tl.program_id(0), P * tiles_n * S, tl.num_programs(0)):
        lead, ex, pair, ok = _group(ids_ptr, tile // (tiles_n * S), P, E, PP, BM)
        if lead:
            n0 = (tile // S % tiles_n) * BN
            pid_k = tile % S
            w_rows = w_ptr + ex * s_we + (n0 + rn)[:, None].to(tl.int64) * s_wn + rk[None, :]
            s_row = ws_ptr + ex * s_wse + (n0 // 128) * s_wsn
            h_rows = h_ptr + pair[:, None] * s_hp + rk[None, :]
            k_lo = pid_k * K_SPLIT
            k_hi = tl.minimum(k_lo + K_SPLIT, I)
            acc = tl.zeros([BN, BM], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, 128):
                a = tl.load(h_rows + k0, mask=ok[:, None], other=0.0)
                w = tl.load(w_rows + k0)
                acc += _tile_dot(w, a, A8, F32) * tl.load(s_row + k0 // 128)
            acc = acc * tl.load(tw_ptr + pair, mask=ok, other=0.0)[None, :]
            tl.store(
                o_ptr + pid_k.to(tl.int64) * s_os + pair[None, :] * HD + (n0 + rn)[:, None],
                acc,
                mask=ok[None, :],
            )


def pick_splits(leads: int, tiles_n: int, inter: int, programs: int) -> int:
    """Down-projection K splits: enough tiles that each of `programs` persistent programs gets ~2
    (so the uneven last round is a small share), at most one split per 128-column block of I."""
    return max(1, min(cdiv(2 * programs, leads * tiles_n), inter // FP8_BLOCK))


def experts_stream(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate_up_scale: torch.Tensor,
    w_down_scale: torch.Tensor,
    config: StreamConfig | None = None,
) -> torch.Tensor:
    """The routed experts' per-pair outputs as fp32 split partials [S, T, k, Hd] (routing weight applied;
    rows of ids outside [0, E) unwritten), for `moe.moe_experts`'s combine kernel to sum.

    x [T, Hd] bf16/fp16/fp32 with unit column stride; topk_ids [T, k] int; topk_w [T, k] float;
    w_gate_up [E, 2I, Hd] and w_down [E, Hd, I] float8_e4m3fn, contiguous, Hd and I multiples of 128;
    scales fp32 [E, 2I/128, Hd/128] and [E, Hd/128, I/128], contiguous (`moe.py`'s layout).
    `config` overrides DEFAULT."""
    cfg = config or DEFAULT
    check(x.dim() == 2 and x.is_floating_point() and x.stride(1) == 1, "moe_stream: x [T, Hd], unit stride")
    t, hd = x.shape
    check(w_gate_up.dim() == 3 and w_down.dim() == 3, "moe_stream: weights [E, 2I, Hd] and [E, Hd, I]")
    e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    check(
        w_gate_up.dtype == torch.float8_e4m3fn and w_down.dtype == torch.float8_e4m3fn,
        "moe_stream: e4m3 weights only",
    )
    check(
        tuple(w_gate_up.shape) == (e, 2 * inter, hd) and tuple(w_down.shape) == (e, hd, inter),
        f"moe_stream: w_gate_up {tuple(w_gate_up.shape)} / w_down {tuple(w_down.shape)} vs Hd={hd}",
    )
    check(supports(hd, inter, True), f"moe_stream: Hd={hd} and I={inter} must be multiples of 128")
    check(w_gate_up.is_contiguous() and w_down.is_contiguous(), "moe_stream: weights must be contiguous")
    for name, s, want in (
        ("w_gate_up_scale", w_gate_up_scale, (e, two_i // 128, hd // 128)),
        ("w_down_scale", w_down_scale, (e, hd // 128, inter // 128)),
    ):
        check(
            tuple(s.shape) == want and s.dtype == torch.float32 and s.is_contiguous(),
            f"moe_stream: {name} must be contiguous fp32 {want}",
        )
    check(
        topk_ids.dim() == 2 and topk_ids.shape[0] == t and not topk_ids.is_floating_point(),
        "moe_stream: topk_ids must be int [T, k]",
    )
    check(tuple(topk_w.shape) == tuple(topk_ids.shape), "moe_stream: topk_w must match topk_ids")
    check(cfg.mma in MMA_FORMS, f"moe_stream: mma must be one of {MMA_FORMS}, got {cfg.mma!r}")
    for bn in (cfg.bn_gate_up, cfg.bn_down):
        check(16 <= bn <= 128 and bn & (bn - 1) == 0, "moe_stream: row tiles are powers of two in [16, 128]")
    k = topk_ids.shape[1]
    p = t * k
    dev = x.device
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_w.reshape(-1).float().contiguous()
    bn_gu, bn_d = min(cfg.bn_gate_up, inter), min(cfg.bn_down, hd)
    programs = cfg.programs_per_sm * num_sms(dev)
    leads = min(p, e)  # at most: one per expert hit (more when an expert has over BM pairs)
    tiles_d = hd // bn_d
    kb = inter // FP8_BLOCK
    splits = cfg.splits_down or (pick_splits(leads, tiles_d, inter, programs) if programs else 1)
    k_split = cdiv(kb, max(1, min(splits, kb))) * FP8_BLOCK
    splits = cdiv(inter, k_split)
    h = torch.empty(p, inter, dtype=x.dtype, device=dev)
    out = torch.empty(splits, p, hd, dtype=torch.float32, device=dev)
    if p == 0:
        return out.view(splits, t, k, hd)
    n_gu, n_d = p * (inter // bn_gu), p * tiles_d * splits
    # Persistent grids cover the tiles of the leading pairs only (~leads / P of all tiles).
    grid_gu = min(n_gu, programs) if programs else n_gu
    grid_d = min(n_d, programs) if programs else n_d
    common = dict(
        A8=cfg.mma == "fp8", F32=x.dtype == torch.float32 or triton_interpret(), PP=next_pow2(p), BM=BM
    )
    _gate_up_kernel[(grid_gu,)](
        x, ids, w_gate_up, w_gate_up_scale, h,
        p, e, hd, inter, k,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up_scale.stride(0),
        w_gate_up_scale.stride(1), h.stride(0),
        BN=bn_gu, num_warps=cfg.warps_gate_up, num_stages=cfg.stages_gate_up, **common, **pdl(x.device),
    )  # fmt: skip
    _down_kernel[(grid_d,)](
        h, ids, tw, w_down, w_down_scale, out,
        p, e, hd, inter, k_split, splits,
        h.stride(0), w_down.stride(0), w_down.stride(1), w_down_scale.stride(0), w_down_scale.stride(1),
        out.stride(0),
        BN=bn_d, num_warps=cfg.warps_down, num_stages=cfg.stages_down, **common, **pdl(x.device),
    )  # fmt: skip
    return out.view(splits, t, k, hd)
