"""Lightning-indexer logits (DSA) over the paged indexer key pool.

    logits[i, t] = sum_h w[i, h] * relu(q[i, h, :] . k_t)        for t valid for query i
                 = -inf                                            otherwise

Key t of query i is valid iff t < seq_lens[q_seq[i]] and t <= q_pos[i] (causal). Key t of request b
lives in slot page_table[b, t // 64] * 64 + t % 64 of `index_pool` (layouts: `kv_layout`). One call
serves a prefill chunk (many queries of one request), a decode batch (one query per request), or
a mix: queries are grouped by request only through `q_seq`.

What the caller passes (nothing is scaled in here):
- `q` [Tq, H, D]: the indexer queries with rope already applied, in the pool's dtype for dense
  pools (bf16 / fp16 / fp32), any of those for fp8 pools.
- `w` [Tq, H]: the per-head weights `weights_proj(x)`, any float dtype (fp32 for the fused
  prefill kernel in `indexer_topk`), and `w_scale`, a scalar every weight is multiplied by in fp32
  before use (`float(w) * w_scale`; 1.0 when w already has it folded in). For DeepSeek-V3.2 /
  GLM-5 that is `H**-0.5 * softmax_scale` with softmax_scale = D**-0.5 (the reference folds both
  into the weights after the relu; since relu(c * s) = c * relu(s) for c > 0 it does not matter
  on which side positive scalars go). Passing the raw projection and its scale saves the decode
  step a cast and a multiply kernel; rows of w may be strided (a slice of a wider projection).
For the fp8 layout the per-key scale is applied after the head reduction (scale > 0, same
identity), so fp8 logits equal `sum_h w * relu(q . (e4m3 * scale))` up to fp32 rounding.
"""

from __future__ import annotations

import torch

from .common import check, jit, next_pow2, tl, triton_interpret, use_triton
from .kv_layout import PAGE_SIZE, index_row_bytes, is_fp8, read_index_k_ref

_REF_CHUNK_ELEMS = 1 << 24  # bounds the reference's [queries, heads, keys] intermediate (64 MiB fp32)


def _check_inputs(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    w_any_float: bool = False,
) -> None:
    check(
        q.dim() == 3 and q.dtype in (torch.float32, torch.bfloat16, torch.float16),
        "q must be [Tq, H, D] float",
    )
    check(q.stride(2) == 1, "q must have unit stride on D")
    tq, h, d = q.shape
    w_dtypes = (torch.float32, torch.bfloat16, torch.float16) if w_any_float else (torch.float32,)
    check(
        w.shape == (tq, h) and w.dtype in w_dtypes and (h <= 1 or w.stride(1) == 1),
        f"w must be [Tq, H] of {w_dtypes} with unit stride on H",
    )
    check(
        page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1,
        "page_table must be int32 [B, P]",
    )
    b = page_table.shape[0]
    check(seq_lens.shape == (b,) and seq_lens.dtype in (torch.int32, torch.int64), "seq_lens must be int [B]")
    check(q_seq.shape == (tq,) and q_seq.dtype in (torch.int32, torch.int64), "q_seq must be int [Tq]")
    check(q_pos.shape == (tq,) and q_pos.dtype in (torch.int32, torch.int64), "q_pos must be int [Tq]")
    check(
        index_pool.dim() == 2 and index_pool.stride(1) == 1 and index_pool.stride(0) == index_pool.shape[1],
        "index_pool must be contiguous [num_slots, row]",
    )
    if is_fp8(kind):
        check(
            index_pool.dtype == torch.uint8 and index_pool.shape[1] == index_row_bytes(d, kind),
            f"fp8 index pool must be uint8 [S, {d + 4}]",
        )
    else:
        check(
            index_pool.dtype == q.dtype and index_pool.shape[1] == d,
            f"dense index pool must be {q.dtype} [S, {d}]",
        )
    devs = {t.device for t in (q, w, index_pool, page_table, seq_lens, q_seq, q_pos)}
    check(len(devs) == 1, f"all indexer inputs must be on one device, got {devs}")


def indexer_logits_paged_ref(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    max_len: int | None = None,
    *,
    w_scale: float = 1.0,
) -> torch.Tensor:
    """Reference: per request, gather + dequantise its keys, then one fp32 matmul per query chunk."""
    _check_inputs(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, w_any_float=True)
    w = w.float() * w_scale
    tq, h, d = q.shape
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    out = torch.full((tq, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    if tq == 0 or max_len == 0:
        return out
    q_seq_l = q_seq.long()
    for b in torch.unique(q_seq_l).tolist():
        n = min(int(seq_lens[b]), max_len)
        if n <= 0:
            continue
        t = torch.arange(n, device=q.device)
        slots = page_table[b, t // PAGE_SIZE].long() * PAGE_SIZE + t % PAGE_SIZE
        k = read_index_k_ref(index_pool, slots, kind, torch.float32)  # [n, D]
        rows = torch.nonzero(q_seq_l == b).flatten()
        step = max(1, _REF_CHUNK_ELEMS // (h * n))
        for i in range(0, rows.numel(), step):
            r = rows[i : i + step]
            s = torch.relu(q[r].float().reshape(-1, d) @ k.T).view(r.numel(), h, n)
            s = (s * w[r, :, None]).sum(1)  # [r, n]
            s.masked_fill_(t[None, :] > q_pos[r, None], float("-inf"))
            out[r, :n] = s
    return out


def indexer_logits_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    max_len: int | None = None,
    *,
    w_scale: float = 1.0,
    backend: str = "auto",
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Indexer logits [Tq, max_len] fp32 (-inf where invalid); see the module docstring.

    q [Tq, H, D], w [Tq, H] float (unit stride on H) scaled by `w_scale`, index_pool [S, D+4] uint8 (fp8) or [S, D] (dense),
    page_table int32 [B, P], seq_lens int [B], q_seq int [Tq] (request of each query),
    q_pos int [Tq] (absolute position of each query). `max_len` defaults to max(seq_lens), which
    costs a device sync; pass it when known (the decode path does: then there is no host sync and no
    host->device copy, so the call can be captured in a CUDA graph). `block_n` (keys per program, a power of
    two >= 16) and `num_warps` are bench knobs; None picks the defaults. Queries sorted by request are fastest (the kernel
    tiles BLOCK_M neighbouring queries and loops over the requests they span).
    """
    _check_inputs(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, w_any_float=True)
    if not use_triton(backend, q.device):
        return indexer_logits_paged_ref(
            q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, max_len, w_scale=w_scale
        )
    tq, h, d = q.shape
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    out = torch.empty((tq, max_len), dtype=torch.float32, device=q.device)
    if tq == 0 or max_len == 0:
        return out
    hp, dp = max(16, next_pow2(h)), max(16, next_pow2(d))
    # Decode (one query per request) gains nothing from query tiles; prefill shares each key tile
    # between BLOCK_M queries so keys are read Tq / BLOCK_M times instead of Tq times.
    block_m = 1 if tq <= page_table.shape[0] else max(1, min(8, 128 // hp))
    # H200 sweep, decode batch 1 at 1M keys, in a graph (bench/results/kernels-h200.json):
    # block_n 64 / 4 warps 108 us, 128: 133-140 us, 256-512: 140-157 us -> 64 for decode
    block_n = block_n or (64 if block_m == 1 or d > 128 else 128)
    check(block_n >= 16 and block_n & (block_n - 1) == 0, "indexer: block_n must be a power of two >= 16")
    grid = (_cdiv(tq, block_m), _cdiv(max_len, block_n))
    fp8 = is_fp8(kind)
    _indexer_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0), float(w_scale), index_pool, page_table, page_table.stride(0),
        seq_lens, q_seq, q_pos, out, out.stride(0), tq, max_len,
        H=h, HP=hp, D=d, DP=dp, ROW=index_pool.shape[1], FP8=fp8, PAGE=PAGE_SIZE,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        INTERPRET=triton_interpret(), num_warps=num_warps or 4,
    )  # fmt: skip
    return out


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@jit
def load_index_keys(pool_ptr, slot, kmask, offs_d, like, ROW: tl.constexpr, FP8: tl.constexpr):
    """Key tile [BK, DP] of the paged index pool at `slot` [BK] (int64), as like.dtype: fp8 rows of
    ROW (D + 4) bytes, or dense rows of ROW elements. Shared by the indexer and fused top-k kernels."""
    # Row starts are only 4-byte aligned for 132-byte rows; without this hint the compiler derives a
    # 16-byte alignment from the caller's `% PAGE` and emits misaligned vector loads (faults on H200).
    row0 = tl.multiple_of(slot * ROW, 4)
    if FP8:
        kp = pool_ptr.to(tl.pointer_type(tl.float8e4nv))
        k = tl.load(kp + row0[:, None] + offs_d[None, :], mask=kmask, other=0.0)
    else:
        k = tl.load(pool_ptr + row0[:, None] + offs_d[None, :], mask=kmask, other=0.0)
    return k.to(like.dtype)  # a no-op for dense rows, which have q's dtype


@jit
def load_index_scales(pool_ptr, slot, mask, D: tl.constexpr, ROW: tl.constexpr):
    """The fp32 scales [BK] stored after the D fp8 bytes of each index row at `slot`."""
    sp = pool_ptr.to(tl.pointer_type(tl.float32))
    return tl.load(sp + slot * (ROW // 4) + D // 4, mask=mask, other=0.0)


@jit
def _indexer_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, w_scale, pool_ptr, pt_ptr, stride_pb,
    seq_lens_ptr, q_seq_ptr, q_pos_ptr, out_ptr, stride_ot, Tq, max_len,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROW: tl.constexpr,
    FP8: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # Program (m, n): queries [m*BLOCK_M, +BLOCK_M) x keys [n*BLOCK_N, +BLOCK_N). All H heads of the
    # BLOCK_M queries sit in one [BLOCK_M*HP, DP] register tile so one dot scores the key tile.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M * HP)
    mi = m0 + rows // HP
    hi = rows % HP
    rmask = (mi < Tq) & (hi < H)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    qt = tl.load(
        q_ptr + mi.to(tl.int64)[:, None] * stride_qt + hi[:, None] * stride_qh + offs_d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_M*HP, DP]
    wv = tl.load(w_ptr + mi.to(tl.int64) * stride_wt + hi, mask=rmask, other=0.0)
    wv = wv.to(tl.float32) * w_scale  # [BLOCK_M*HP], the reference's `w.float() * w_scale`

    ms = m0 + tl.arange(0, BLOCK_M)
    mvalid = ms < Tq
    qb = tl.load(q_seq_ptr + ms, mask=mvalid, other=-1).to(tl.int32)
    qp = tl.load(q_pos_ptr + ms, mask=mvalid, other=-1).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    b_lo = tl.min(tl.where(mvalid, qb, 2147483647), axis=0)
    b_hi = tl.max(tl.where(mvalid, qb, -1), axis=0)
    for b in range(b_lo, b_hi + 1):
        in_b = mvalid & (qb == b)
        seqlen = tl.load(seq_lens_ptr + b).to(tl.int64)
        lim = tl.minimum(seqlen, tl.max(tl.where(in_b, qp, -1), axis=0) + 1)  # keys any query of b needs
        if n0 < lim:
            nmask = offs_n < lim
            page = tl.load(pt_ptr + b * stride_pb + offs_n // PAGE, mask=nmask, other=0)
            slot = page.to(tl.int64) * PAGE + offs_n % PAGE  # [BLOCK_N]
            k = load_index_keys(pool_ptr, slot, nmask[:, None] & dmask[None, :], offs_d, qt, ROW, FP8)
            if FP8:
                kscale = load_index_scales(pool_ptr, slot, nmask, D, ROW)
            if INTERPRET:  # the interpreter's dot reads bf16 as raw uint16; fp32 is exact for both
                s = tl.dot(qt.to(tl.float32), tl.trans(k.to(tl.float32)))
            elif IEEE:
                s = tl.dot(qt, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(qt, tl.trans(k))
            s = tl.maximum(s, 0.0) * wv[:, None]  # [BLOCK_M*HP, BLOCK_N]
            s = tl.sum(tl.reshape(s, (BLOCK_M, HP, BLOCK_N)), axis=1)  # [BLOCK_M, BLOCK_N]
            if FP8:
                s = s * kscale[None, :]
            valid = in_b[:, None] & (offs_n[None, :] <= qp[:, None]) & (offs_n[None, :] < seqlen)
            acc = tl.where(valid, s, acc)
    omask = mvalid[:, None] & (offs_n[None, :] < max_len)
    tl.store(out_ptr + ms.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], acc, mask=omask)
