"""Fused lightning indexer + top-k for prefill chunks: the [Tq, L] logits are never materialised.

`indexer_topk_paged(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k)` returns the
same int32 [Tq, k] as

    topk_indices(indexer_logits_paged(q, w, index_pool, ..., kind, max_len), k, q_pos + 1)

(`kernels.indexer` for the logits and their masks, `kernels.topk` for the contract: the k
largest of the first n_i = clamp(q_pos + 1, 0, max_len) logits, ties at the boundary won by the
lowest key index, output ascending then -1 padded). The reference `indexer_topk_paged_ref` is
literally that composition over chunks of queries.

Why: a 1M-token prefill scores ~5.5e11 (query, key) pairs per full layer. Materialised, a
16K-query chunk at 1M keys is a 64 GiB fp32 buffer that the radix top-k then reads six times,
while the indexer FLOPs (32 heads x 128 dims) are what actually needs doing.

Algorithm (Triton; one program per block of BQ queries, all their heads in one tensor-core dot,
looping over key tiles in ascending key order):
1. Sample pass: logits of a stratified random sample, one key at a pseudo-random offset in every
   stratum of S consecutive keys (S = power of two, ~`sample_keys` strata cover max_len), written
   to a small [Tq, M] buffer (M <= sample_keys). Per query, the threshold t_i is the j_i-th
   largest sample value with j_i = j* + 4 sqrt(j*) + 1 and j* = k * m_i / n_i (m_i samples among
   n_i valid keys) so that, with high probability, k <= #{logit >= t_i} <= ~2k. Queries with
   n_i <= k get t_i = -inf (everything valid is selected). Costs M / L of one full pass.
2. Select pass: recompute every logit; keys with logit > t_i go to a candidate buffer
   (value + index, capacity C = max(4k, the count a threshold at the largest rank j_i can let
   through, ~(j + 4 sqrt(j) + 1) S: `candidate_capacity`)), keys with logit == t_i to a tie buffer
   (index, capacity k). With k = 2048 at 1M (j* ~ 16) C is 4k; a small k makes j* small and the
   margin's share large (k = 32 at 128K: ~4.3k keys pass a threshold, and a fixed 4k sent 58% of
   the queries to the fallback, a 17x slower training step in the seventeenth session).
   Positions come from a running per-query count plus an exclusive scan inside the key tile, so
   both buffers are filled in ascending key order without atomics (one program owns a query).
   The tie buffer thus holds the LOWEST-index keys equal to t_i, which is exactly what the
   tie-break needs even when millions of logits tie (e.g. all-zero from relu).
3. Resolve (small): if #gt >= k, the answer is the top-k of the candidates (their order is key
   order, so topk_indices' lowest-position tie-break is the lowest-index tie-break); otherwise it
   is all candidates plus the first k - #gt tie entries. Exact whenever #gt <= C and
   #gt + #eq >= min(k, n_i).
4. Fallback: a query whose sampled threshold missed (checked exactly from the counts, never
   assumed) is recomputed by the unfused logits + top-k kernels, a bounded number of queries at a
   time. On iid-like logits this is ~1e-4 of queries; correctness never depends on the sample.

Total work: (1 + M/L) x the indexer FLOPs plus a compare and a scan per (query, key) pair, against
the unfused path's one pass plus ~6 fp32 round trips of [Tq, L] through HBM. For max_len <=
`sample_keys` the sample would be the whole context, so the wrapper runs the unfused composition
directly (its [Tq, <= sample_keys] buffer is the size the sample buffer would have been).

Memory per query (defaults, k = 2048): sample 32 KiB + candidates 64 KiB + ties 8 KiB.
"""

from __future__ import annotations

import math

import torch

from .common import check, jit, next_pow2, tl, triton_interpret, use_triton
from .indexer import (
    _check_inputs,
    fp16_scaled_q,
    indexer_logits_paged,
    indexer_logits_paged_ref,
    load_index_keys,
    load_index_scales,
)
from .kv_layout import PAGE_SIZE, is_fp8
from .topk import topk_indices, topk_indices_ref

_REF_CHUNK_ELEMS = 1 << 24  # the reference materialises at most this many logits at once (64 MiB)
_FALLBACK_CHUNK_ELEMS = 1 << 27  # likewise for the fused path's fallback queries (512 MiB)
_Z = 4.0  # safety margin of the sampled threshold, in standard deviations of the sample count
_BIG = 2**31 - 1

# Launch defaults of `_fused_kernel` (H=32, D=128: BQ = 4 queries x 32 heads = a 128-column dot,
# 64-key tiles, 4 warps, 2 stages): the winner of `python -m bench.kernels_indexer_topk --sweep` on
# the H200 (305.6 ms per 8192-query chunk at 1M keys = 231 TFLOP/s; 128-key tiles with 8 warps, the
# previous default, 369.5 ms; bench/results/kernels-indexer-topk-sweep-h200.md).
_BLOCK_QH = 128  # queries per program x padded heads
_BLOCK_K = 64  # keys per tile (halved for D > 128)
_WARPS = 4
_STAGES = 2


def indexer_topk_paged_ref(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    k: int,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reference: `topk_indices_ref(indexer_logits_paged_ref(...), k, q_pos + 1)`, chunked over queries."""
    _check_all(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k)
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    tq = q.shape[0]
    out = torch.full((tq, k), -1, dtype=torch.int32, device=q.device)
    step = max(1, _REF_CHUNK_ELEMS // max(max_len, 1))
    for i in range(0, tq, step):
        s = slice(i, i + step)
        logits = indexer_logits_paged_ref(
            q[s], w[s], index_pool, page_table, seq_lens, q_seq[s], q_pos[s], kind, max_len
        )
        out[s] = topk_indices_ref(logits, k, q_pos[s] + 1)
    return out


def indexer_topk_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    k: int,
    *,
    max_len: int | None = None,
    backend: str = "auto",
    sample_keys: int = 8192,
    capacity: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp32_dot: str = "ieee",
    stats: dict | None = None,
) -> torch.Tensor:
    """Top-k key positions (int32 [Tq, k], ascending, -1 padded) of the indexer logits, fused.

    Inputs as `kernels.indexer.indexer_logits_paged` (q [Tq, H, D], w [Tq, H] fp32, paged index
    pool, page_table int32 [B, P], seq_lens [B], q_seq [Tq], q_pos [Tq]); the result equals
    `topk_indices(indexer_logits_paged(...), k, q_pos + 1)` (see the module docstring).
    `max_len` defaults to max(seq_lens) (a device sync). Tuning knobs: `sample_keys` (strata of
    the threshold sample; contexts up to it take the unfused path), `capacity` (candidate slots
    per query, default `candidate_capacity`), `block_q` / `block_k` / `num_warps` / `num_stages`
    (queries per program / keys per tile / the launch's; None picks the `_BLOCK_*` / `_WARPS` /
    `_STAGES` defaults, which `python -m bench.kernels_indexer_topk --sweep` ranks on the GPU).
    `fp32_dot` (fp32 q only): "ieee" (exact products: the contract above up to summation order) or
    "tf32x3" (three TF32 tensor-core products, ~1e-6 relative: selections may differ between
    near-ties; the trainer's choice, whose fp32 scores are not the engine's fp8 ones anyway). If
    `stats` is a dict it receives what the call did (path, S, fallback queries).
    """
    _check_all(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k)
    check(sample_keys >= 1, f"sample_keys must be >= 1, got {sample_keys}")
    check(fp32_dot in ("ieee", "tf32x3"), f"fp32_dot must be 'ieee' or 'tf32x3', got {fp32_dot!r}")
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    tq = q.shape[0]
    info = stats if stats is not None else {}
    info.update(path="ref", tq=tq, max_len=max_len, fallback_queries=0)
    if not use_triton(backend, q.device):
        return indexer_topk_paged_ref(
            q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k, max_len=max_len
        )
    if tq == 0 or k == 0 or max_len == 0:
        info["path"] = "empty"
        return torch.full((tq, k), -1, dtype=torch.int32, device=q.device)
    if max_len <= sample_keys:
        info["path"] = "unfused"
        return _unfused(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k, max_len, backend)

    dev = q.device
    h, d = q.shape[1], q.shape[2]
    hp, dp = next_pow2(h), max(16, next_pow2(d))
    bq = block_q if block_q is not None else max(1, _BLOCK_QH // hp)
    bq = max(bq, 16 // hp if hp < 16 else 1)  # the dot's N = bq * hp must be >= 16
    bk = block_k if block_k is not None else (_BLOCK_K if d <= 128 else _BLOCK_K // 2)
    check(bq == next_pow2(bq) and bk == next_pow2(bk) and 16 <= bk <= 32768, "block_q/block_k: powers of 2")
    # --- sample pass: one key per stratum of S keys, at a fixed pseudo-random offset
    spos, s_len = sample_positions(max_len, sample_keys, dev)
    m_cols = spos.numel()
    cap = capacity if capacity is not None else candidate_capacity(k, s_len, m_cols, max_len)
    check(cap >= k, f"capacity {cap} must be >= k {k}")
    n_valid = (q_pos.long() + 1).clamp(0, max_len)  # [Tq] keys each query may select from
    sample = torch.empty((tq, m_cols), dtype=torch.float32, device=dev)
    nval32 = n_valid.to(torch.int32)
    thr = torch.empty(tq, dtype=torch.float32, device=dev)
    dummy_i = torch.empty(1, dtype=torch.int32, device=dev)
    common = dict(
        H=h, HP=hp, D=d, DP=dp, ROW=index_pool.shape[1], FP8=is_fp8(kind), PAGE=PAGE_SIZE, BQ=bq, BK=bk,
        F32=q.dtype == torch.float32, DOT=fp32_dot if q.dtype == torch.float32 else "",
        INTERPRET=triton_interpret(),
        num_warps=num_warps or _WARPS, num_stages=num_stages or _STAGES,
    )  # fmt: skip
    grid = (-(-tq // bq),)
    _fused_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0), index_pool, page_table, page_table.stride(0),
        seq_lens, q_seq, nval32, thr, tq,
        spos, sample, sample.stride(0), m_cols, s_len,
        sample, dummy_i, dummy_i, dummy_i, cap, k,
        SAMPLE=True, **common,
    )  # fmt: skip

    thr.copy_(sample_thresholds(sample, spos, s_len, n_valid, k))
    del sample

    # --- select pass: candidates (> t) and ties (== t) in key order, with exact counts
    gt_val = torch.empty((tq, cap), dtype=torch.float32, device=dev)
    gt_idx = torch.empty((tq, cap), dtype=torch.int32, device=dev)
    eq_idx = torch.empty((tq, k), dtype=torch.int32, device=dev)
    counts = torch.zeros((tq, 2), dtype=torch.int32, device=dev)
    _fused_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0), index_pool, page_table, page_table.stride(0),
        seq_lens, q_seq, nval32, thr, tq,
        spos, gt_val, 0, m_cols, s_len,
        gt_val, gt_idx, eq_idx, counts, cap, k,
        SAMPLE=False, **common,
    )  # fmt: skip

    # --- resolve: top-k of the candidates, topped up with the lowest-index ties
    n_gt, n_eq = counts[:, 0].long(), counts[:, 1].long()
    sel = topk_indices(gt_val, k, n_gt.clamp_max(cap), backend=backend)  # positions, ascending
    a = torch.where(sel >= 0, gt_idx.gather(1, sel.clamp_min(0).long()), _BIG)
    r = torch.minimum((k - n_gt).clamp_min(0), n_eq)
    e = torch.where(torch.arange(k, device=dev)[None, :] < r[:, None], eq_idx, _BIG)
    out = torch.cat([a, e], dim=1).sort(dim=1).values[:, :k].contiguous()
    out.masked_fill_(out == _BIG, -1)

    # --- exact check; the (rare) misses go through the unfused kernels
    ok = (n_gt <= cap) & (n_gt + n_eq >= torch.clamp(n_valid, max=k))
    bad = torch.nonzero(~ok).flatten()
    info.update(
        path="fused", S=s_len, M=m_cols, capacity=cap, block_q=bq, block_k=bk,
        num_warps=common["num_warps"], num_stages=common["num_stages"],
    )  # fmt: skip
    info["fallback_queries"] = int(bad.numel())
    if bad.numel():
        step = max(1, _FALLBACK_CHUNK_ELEMS // max_len)
        for i in range(0, bad.numel(), step):
            rows = bad[i : i + step]
            out[rows] = _unfused(
                q[rows], w[rows], index_pool, page_table, seq_lens, q_seq[rows], q_pos[rows],
                kind, k, max_len, backend,
            )  # fmt: skip
    return out


def sample_positions(max_len: int, sample_keys: int, device: torch.device | str) -> tuple[torch.Tensor, int]:
    """(key positions int32 [M], stratum S): one key per S consecutive keys at a hashed offset.

    S is the smallest power of two with ceil(max_len / S) <= sample_keys; positions ascend, so
    the sample keys valid for a query (position < n_i) are a prefix.
    """
    s_len = next_pow2(-(-max_len // sample_keys))
    j = torch.arange(-(-max_len // s_len), device=device, dtype=torch.int64)
    off = ((j * 2654435761 + 0x5BD1E995) % (1 << 32)) >> 11 & (s_len - 1)  # Knuth hash, middle bits
    return (j * s_len + off).to(torch.int32), s_len


def sample_thresholds(
    sample: torch.Tensor, spos: torch.Tensor, s_len: int, n_valid: torch.Tensor, k: int
) -> torch.Tensor:
    """Per-query threshold t_i (fp32 [Tq]) from the sample logits [Tq, M] (overwritten past each prefix).

    t_i is the j_i-th largest of query i's m_i valid samples, j_i = j* + Z sqrt(j*) + 1 with
    j* = k m_i / n_i, so #{logit >= t_i} is about (j_i / j*) k; -inf where n_i <= k.
    """
    m_cols = spos.numel()
    m_valid = torch.searchsorted(spos.long(), n_valid)  # [Tq] samples among the valid keys
    jstar = k * m_valid.double() / n_valid.clamp_min(1).double()
    jlo = torch.ceil(jstar + _Z * jstar.sqrt() + 1).long()
    jlo = torch.minimum(jlo, m_valid).clamp_min(1)
    jmax = _max_rank(k, s_len, m_cols)
    cols = torch.arange(m_cols, device=sample.device)
    sample.masked_fill_(cols[None, :] >= m_valid[:, None], float("-inf"))
    top = sample.topk(jmax, dim=1).values  # [Tq, jmax] descending
    t = top.gather(1, (jlo.clamp_max(jmax) - 1)[:, None]).squeeze(1)
    return torch.where((n_valid <= k) | (m_valid == 0), float("-inf"), t)


def _max_rank(k: int, s_len: int, m_cols: int) -> int:
    """The largest sample rank j_i any query's threshold takes (j* <= k / S + 1 when n_i > k, as
    m_i <= n_i / S + 1)."""
    js_max = k / s_len + 1.0
    return min(m_cols, math.ceil(js_max + _Z * math.sqrt(js_max) + 1))


def candidate_capacity(k: int, s_len: int, m_cols: int, max_len: int) -> int:
    """Candidate slots per query: 4k, or more where the sampled threshold's margin lets more through.

    A threshold at sample rank j has about j strata of S keys above it (keys between samples are as
    likely to be above as the samples), with a spread of ~sqrt(j) strata; the capacity covers
    (j + Z sqrt(j) + 1) S at the largest rank any query uses, and never more than the context."""
    j = _max_rank(k, s_len, m_cols)
    need = math.ceil((j + _Z * math.sqrt(j) + 1) * s_len)
    return max(k, min(max(4 * k, need), max_len))


def _unfused(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k, max_len, backend):  # type: ignore[no-untyped-def]
    logits = indexer_logits_paged(
        q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, max_len, backend=backend
    )
    return topk_indices(logits, k, q_pos + 1, backend=backend)


def _check_all(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, k) -> None:  # type: ignore[no-untyped-def]
    _check_inputs(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind)
    check(isinstance(k, int) and k >= 0, f"k must be a non-negative int, got {k!r}")


# ----------------------------------------------------------------------------------- Triton


@jit
def _fused_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, pool_ptr, pt_ptr, stride_pb,
    seq_lens_ptr, q_seq_ptr, nval_ptr, thr_ptr, Tq,
    spos_ptr, samp_ptr, stride_samp, M, S,
    gtv_ptr, gti_ptr, eqi_ptr, cnt_ptr, C, K,
    SAMPLE: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    ROW: tl.constexpr, FP8: tl.constexpr, PAGE: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
    F32: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # Program: queries [pid*BQ, +BQ), all heads. Keys are the M side of the dot ([BK, D] x
    # [D, BQ*HP]) so the head sum runs along the accumulator's N axis (in-thread + quad shuffles)
    # and fp8 keys are upcast in registers, where Hopper's MMA can take its A operand.
    pid = tl.program_id(0)
    m0 = pid * BQ
    cols = tl.arange(0, BQ * HP)
    ci = m0 + cols // HP
    ch = cols % HP
    cmask = (ci < Tq) & (ch < H)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    qT = tl.load(
        q_ptr + ci.to(tl.int64)[None, :] * stride_qt + ch[None, :] * stride_qh + offs_d[:, None],
        mask=cmask[None, :] & dmask[:, None],
        other=0.0,
    )  # [DP, BQ*HP]
    wv = tl.load(w_ptr + ci.to(tl.int64) * stride_wt + ch, mask=cmask, other=0.0)  # [BQ*HP]
    if FP8 and not F32:  # fp16 operands (see `fp16_scaled_q`); fp32 q keeps fp32
        qT, wq = fp16_scaled_q(qT, 0)  # [DP, BQ*HP] fp16, [BQ*HP]
        wv = wv * wq
    if INTERPRET:  # the interpreter's dot reads bf16 as raw uint16; fp32 is exact for all
        qT = qT.to(tl.float32)

    qs = m0 + tl.arange(0, BQ)
    qvalid = qs < Tq
    qb = tl.load(q_seq_ptr + qs, mask=qvalid, other=-1).to(tl.int32)
    nval = tl.load(nval_ptr + qs, mask=qvalid, other=0)  # keys each query selects from
    if not SAMPLE:
        thr = tl.load(thr_ptr + qs, mask=qvalid, other=0.0)
    cnt_gt = tl.zeros((BQ,), tl.int32)
    cnt_eq = tl.zeros((BQ,), tl.int32)
    b_lo = tl.min(tl.where(qvalid, qb, 2147483647), axis=0)
    b_hi = tl.max(tl.where(qvalid, qb, -1), axis=0)
    for b in range(b_lo, b_hi + 1):
        in_b = qvalid & (qb == b)
        seqlen = tl.load(seq_lens_ptr + b).to(tl.int32)
        lim = tl.max(tl.where(in_b, nval, 0), axis=0)  # keys any query of b needs
        if SAMPLE:
            n_tiles = tl.cdiv(tl.cdiv(lim, S), BK)  # strata j with j*S < lim
        else:
            n_tiles = tl.cdiv(lim, BK)
        pt_row = pt_ptr + b * stride_pb
        # Positions and page ids of tile kt + 1 are loaded while tile kt is scored, so the key
        # loads depend on loop-carried registers only and Triton's pipeliner can keep
        # num_stages - 1 key tiles in flight (as in kernels.indexer's decode kernel).
        pos_nx, pg_nx = _tile_pages(spos_ptr, pt_row, 0, M, lim, seqlen, SAMPLE, BK, PAGE)
        for kt in range(0, n_tiles):
            rk = kt * BK + tl.arange(0, BK)
            pos = pos_nx
            slot = pg_nx.to(tl.int64) * PAGE + pos % PAGE  # [BK]; page 0 where not needed
            pos_nx, pg_nx = _tile_pages(spos_ptr, pt_row, kt + 1, M, lim, seqlen, SAMPLE, BK, PAGE)
            # unmasked rows: keys past `lim` / `seqlen` read page 0 (always in the pool) and are
            # masked out below
            kt_ = load_index_keys(pool_ptr, slot, dmask[None, :], offs_d, D, ROW, FP8, PAGE)
            if FP8:
                kscale = load_index_scales(pool_ptr, slot, rk >= 0, D, PAGE)
            kt_ = kt_.to(qT.dtype)  # fp8: e4m3 -> fp16 (exact) or fp32
            if F32:  # fp32 operands: exact products ("ieee") or three TF32 MMAs ("tf32x3")
                s = tl.dot(kt_, qT, input_precision=DOT)
            else:
                s = tl.dot(kt_, qT)  # [BK, BQ*HP] fp32
            s = tl.maximum(s, 0.0) * wv[None, :]
            v = tl.sum(tl.reshape(s, (BK, BQ, HP)), axis=2)  # [BK, BQ]
            if FP8:
                v = v * kscale[:, None]
            v = tl.where((pos < seqlen)[:, None], v, float("-inf"))  # as the unfused logits
            if SAMPLE:
                smask = (rk < M)[:, None] & in_b[None, :]
                tl.store(samp_ptr + qs.to(tl.int64)[None, :] * stride_samp + rk[:, None], v, mask=smask)
            else:
                valid = in_b[None, :] & (pos[:, None] < nval[None, :])
                gt = valid & (v > thr[None, :])
                eq = valid & (v == thr[None, :])
                packed = gt.to(tl.int32) + eq.to(tl.int32) * 65536  # two counts in one scan
                n_hit = tl.sum(packed, axis=0)  # [BQ]
                if tl.max(n_hit, axis=0) > 0:
                    before = tl.cumsum(packed, axis=0) - packed  # exclusive, ascending key order
                    p_gt = cnt_gt[None, :] + (before & 65535)
                    p_eq = cnt_eq[None, :] + (before >> 16)
                    qrow = qs.to(tl.int64)[None, :]
                    mg = gt & (p_gt < C)
                    tl.store(gtv_ptr + qrow * C + p_gt, v, mask=mg)
                    tl.store(gti_ptr + qrow * C + p_gt, pos[:, None] + tl.zeros((BK, BQ), tl.int32), mask=mg)
                    me = eq & (p_eq < K)
                    tl.store(eqi_ptr + qrow * K + p_eq, pos[:, None] + tl.zeros((BK, BQ), tl.int32), mask=me)
                cnt_gt += n_hit & 65535
                cnt_eq += n_hit >> 16
    if not SAMPLE:
        tl.store(cnt_ptr + qs * 2, cnt_gt, mask=qvalid)
        tl.store(cnt_ptr + qs * 2 + 1, cnt_eq, mask=qvalid)


@jit
def _tile_pages(
    spos_ptr, pt_row, kt, M, lim, seqlen, SAMPLE: tl.constexpr, BK: tl.constexpr, PAGE: tl.constexpr
):
    # (key positions [BK], page ids [BK]) of key tile kt: the sample positions in the sample pass;
    # page 0 for keys no query of this request needs
    rk = kt * BK + tl.arange(0, BK)
    if SAMPLE:
        pos = tl.load(spos_ptr + rk, mask=rk < M, other=2147483647)
    else:
        pos = rk
    need = (pos < lim) & (pos < seqlen)
    return pos, tl.load(pt_row + pos // PAGE, mask=need, other=0)
