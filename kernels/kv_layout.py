"""Per-token byte layouts of the paged MLA KV pool and the indexer key pool, and their writers.

A pool is a 2-D tensor `[num_slots, row]`, one row per token of one layer, slot = page * 64 +
offset (pages of 64 tokens; the page table lives with the caller). Rows are contiguous
(`pool.stride() == (row, 1)`), so a page is 64 consecutive rows.

MLA KV, kind "fp8_e4m3" (alias "fp8"): a uint8 pool, row bytes = L + 4 * (L / G) + 2 * R, with
L = kv_lora_rank, R = rope dim, G = group size = min(128, L). For GLM-5.3 (L=512, R=64) that is
the 656-byte token of FlashMLA:

    bytes [0, L)              L x float8_e4m3fn latent; group g = elements [g*G, (g+1)*G)
    bytes [L, L + 4*L/G)      L/G x fp32 scales (little endian), scale_g = max(amax_g, AMAX_EPS) / 448
    bytes [L + 4*L/G, row)    R x bf16 rope key, not quantised

    latent[i] ~= float(e4m3[i]) * scale[i // G];   e4m3[i] = rne_e4m3(clamp(x[i] / scale_g, +-448))

MLA KV, any other kind ("auto", "bf16", "fp16", "fp32", ...): `[num_slots, L + R]` in the pool's
own float dtype (the model dtype): elements [0, L) latent, [L, L + R) rope.

Indexer keys, kind "fp8_e4m3": a uint8 pool `[num_slots, D + 4]` (D = index_head_dim; 132 bytes
per token for D=128), laid out page-major as DeepGEMM / FlashMLA lay out the DSA key cache: the
64 rows of page p are one block of 64 * (D + 4) bytes (8448 for D=128) starting at byte
p * 64 * (D + 4), and inside it

    bytes [o * D, (o + 1) * D)           D x float8_e4m3fn key of the token at offset o
    bytes [64 * D + 4 * o, + 4)          its fp32 scale = max(amax over the D dims, AMAX_EPS) / 448

so every key starts on a D-byte boundary (128 for D=128: whole-row 16-byte vector loads) and a
page's 64 scales are one 256-byte run. A row of the tensor is therefore NOT one token's bytes:
address fp8 index keys only through `index_k_offsets` (torch) / `index_fp8_offsets` (Triton).
The number of slots is a multiple of 64 (whole pages).

Indexer keys, other kinds: `[num_slots, D]` in the pool's float dtype, one row per token.

Quantisation is round-to-nearest-even with both divisions IEEE-rounded, so the Triton writers and
the torch references produce identical bytes. e4m3 keeps 3 mantissa bits: a dequantised element
differs from its input by at most 2^-4 relative (half an ulp) for |x| >= 2^-6 * scale, and by at
most 2^-10 * scale (half the subnormal step) below that, i.e. |x - x'| <= max(|x| / 16, scale / 1024).

Slots written in one call must be distinct (duplicate slots leave an unspecified winner).
"""

from __future__ import annotations

import torch

from longctx.config import DTYPE_NAMES, canonical_dtype
from longctx.kv_kinds import DENSE_KINDS, dense_dtype, index_row_bytes, is_fp8, mla_group_size, mla_row_bytes

from .common import check, jit, next_pow2, pdl, pdl_wait, tl, use_triton

PAGE_SIZE = 64
FP8_MAX = 448.0
AMAX_EPS = 1e-10  # an all-zero group gets a tiny positive scale instead of dividing by zero
# The kinds and the bytes of a row are torch-free, so `longctx plan` budgets with them too (`longctx.kv_kinds`).
_DENSE_KIND_DTYPES = {k: getattr(torch, canonical) for k in DENSE_KINDS if (canonical := canonical_dtype(k))}
_FLOAT_DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)


def _dense_dtype(kind: str, dtype: torch.dtype | None) -> torch.dtype:
    return getattr(torch, dense_dtype(kind, dtype))


def alloc_mla_pool(
    num_slots: int,
    kv_lora_rank: int,
    rope_dim: int,
    kind: str,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """An uninitialised MLA KV pool: uint8 [num_slots, row bytes] for fp8, else dtype [num_slots, L+R]."""
    if is_fp8(kind):
        return torch.empty(
            num_slots, mla_row_bytes(kv_lora_rank, rope_dim, kind), dtype=torch.uint8, device=device
        )
    return torch.empty(num_slots, kv_lora_rank + rope_dim, dtype=_dense_dtype(kind, dtype), device=device)


def alloc_index_pool(
    num_slots: int, head_dim: int, kind: str, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """An uninitialised indexer key pool: uint8 [num_slots, D+4] (page-major, num_slots a multiple
    of 64) for fp8, else dtype [num_slots, D]."""
    if is_fp8(kind):
        check(
            num_slots % PAGE_SIZE == 0,
            f"fp8 index pool needs whole pages of {PAGE_SIZE}, got {num_slots} slots",
        )
        return torch.empty(num_slots, index_row_bytes(head_dim, kind), dtype=torch.uint8, device=device)
    return torch.empty(num_slots, head_dim, dtype=_dense_dtype(kind, dtype), device=device)


# ----------------------------------------------------------------------------------------- checks


def _check_pool(pool: torch.Tensor, kind: str, width: int) -> None:
    check(
        pool.dim() == 2 and pool.stride(1) == 1 and pool.stride(0) == pool.shape[1],
        "pool must be a contiguous 2-D [num_slots, row] tensor",
    )
    if is_fp8(kind):
        check(pool.dtype == torch.uint8, f"fp8 pool must be uint8, got {pool.dtype}")
        check(pool.data_ptr() % 16 == 0, "fp8 pool must be 16-byte aligned")
    else:
        check(pool.dtype in _FLOAT_DTYPES, f"dense pool must be a float tensor, got {pool.dtype}")
        if kind in _DENSE_KIND_DTYPES:
            check(
                pool.dtype == _DENSE_KIND_DTYPES[kind],
                f"kind {kind!r} needs a {_DENSE_KIND_DTYPES[kind]} pool, got {pool.dtype}",
            )
    check(pool.shape[1] == width, f"pool row is {pool.shape[1]} wide, layout {kind!r} needs {width}")


def _check_rows(slots: torch.Tensor, x: torch.Tensor, name: str, pool: torch.Tensor) -> None:
    check(
        x.dim() == 2 and x.dtype in _FLOAT_DTYPES,
        f"{name} must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}",
    )
    check(x.stride(1) == 1, f"{name} must have unit stride on its last dim")
    check(slots.dim() == 1 and slots.dtype == torch.int64, "slots must be int64 [T]")
    check(slots.shape[0] == x.shape[0], f"slots has {slots.shape[0]} rows, {name} has {x.shape[0]}")
    check(
        x.device == pool.device and slots.device == pool.device, "pool, slots and inputs must share a device"
    )


def _quantise_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, N] float -> (e4m3 [T, N] as uint8, fp32 scales [T, N/group]); the kernels' exact math."""
    t, n = x.shape
    xg = x.float().reshape(t, n // group, group)
    amax = xg.abs().amax(-1).clamp_min(AMAX_EPS)
    scale = amax / FP8_MAX
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, n).view(torch.uint8), scale


def mla_fp8_roundtrip(latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an fp8 MLA pool gives back for these rows: latent [T, L] and rope [T, R] written to a scratch
    pool and read back (`write_mla_kv_ref`, `read_mla_kv_ref`: the latent quantised per group, the rope
    through bf16), in the latent's dtype. For a training forward that sees the KV the engine's fp8 cache
    serves (`longctx.train --kv-fp8`)."""
    check(latent.dim() == 2 and rope.dim() == 2, "latent and rope must be 2-D [T, L] / [T, R]")
    t, lora = latent.shape
    pool = alloc_mla_pool(t, lora, rope.shape[1], "fp8_e4m3", latent.dtype, latent.device)
    slots = torch.arange(t, device=latent.device)
    write_mla_kv_ref(pool, slots, latent, rope, "fp8_e4m3")
    return read_mla_kv_ref(pool, slots, "fp8_e4m3", latent.dtype, lora)


# -------------------------------------------------------------------------------------- MLA KV


def write_mla_kv_ref(
    pool: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, kind: str
) -> None:
    """Reference of `write_mla_kv` (torch, any device)."""
    _check_mla_write(pool, slots, latent, rope, kind)
    t, lora = latent.shape
    if not is_fp8(kind):
        pool[slots] = torch.cat([latent, rope], dim=1).to(pool.dtype)
        return
    q, scale = _quantise_groups(latent, mla_group_size(lora))
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)  # [T, 2R]
    pool[slots] = torch.cat([q, scale.contiguous().view(torch.uint8).reshape(t, -1), rope_bytes], dim=1)


def write_mla_kv(
    pool: torch.Tensor,
    slots: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    kind: str,
    *,
    backend: str = "auto",
) -> None:
    """Store T tokens' MLA KV at `slots` (int64 [T]): latent [T, L], rope [T, R] (any float dtype).

    fp8 kinds quantise the latent per group of min(128, L) and store the rope as bf16 in one pass
    (layout in the module docstring); dense kinds cast to the pool dtype.
    """
    _check_mla_write(pool, slots, latent, rope, kind)
    if not use_triton(backend, pool.device):
        write_mla_kv_ref(pool, slots, latent, rope, kind)
        return
    t, lora = latent.shape
    rdim = rope.shape[1]
    if t == 0:
        return
    if is_fp8(kind):
        g = mla_group_size(lora)
        _write_fp8_rows_kernel[(t,)](
            latent, latent.stride(0), rope, rope.stride(0), slots, pool,
            ROW=pool.shape[1], N=lora, GS=g, GSP=next_pow2(g), R=rdim, RP=next_pow2(max(rdim, 1)),
            EPS=AMAX_EPS, num_warps=2,
        )  # fmt: skip
    else:
        _write_dense_rows_kernel[(t,)](
            latent, latent.stride(0), rope, rope.stride(0), slots, pool,
            ROW=pool.shape[1], N=lora, NP=next_pow2(lora), R=rdim, RP=next_pow2(max(rdim, 1)), num_warps=2,
        )  # fmt: skip


def _check_mla_write(
    pool: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, kind: str
) -> None:
    _check_rows(slots, latent, "latent", pool)
    _check_rows(slots, rope, "rope", pool)
    lora, rdim = latent.shape[1], rope.shape[1]
    _check_pool(pool, kind, mla_row_bytes(lora, rdim, kind) if is_fp8(kind) else lora + rdim)


def read_mla_kv_ref(
    pool: torch.Tensor, slots: torch.Tensor, kind: str, out_dtype: torch.dtype, kv_lora_rank: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather + dequantise T tokens: returns (latent [T, L], rope [T, R]) in `out_dtype`.

    The pool row alone cannot tell L from R, so `kv_lora_rank` (L) is given; a pool width that
    does not fit it raises.
    """
    check(slots.dim() == 1 and slots.dtype == torch.int64, "slots must be int64 [T]")
    rows = pool[slots]
    if not is_fp8(kind):
        rdim = pool.shape[1] - kv_lora_rank
        _check_pool(pool, kind, kv_lora_rank + max(rdim, 0))
        check(rdim >= 0, f"pool width {pool.shape[1]} < kv_lora_rank {kv_lora_rank}")
        return rows[:, :kv_lora_rank].to(out_dtype), rows[:, kv_lora_rank:].to(out_dtype)
    g = mla_group_size(kv_lora_rank)
    nsc = kv_lora_rank // g
    rope_bytes = pool.shape[1] - kv_lora_rank - 4 * nsc
    check(
        rope_bytes >= 0 and rope_bytes % 2 == 0,
        f"fp8 pool width {pool.shape[1]} does not fit kv_lora_rank {kv_lora_rank}",
    )
    _check_pool(pool, kind, kv_lora_rank + 4 * nsc + rope_bytes)
    t = rows.shape[0]
    q = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, kv_lora_rank : kv_lora_rank + 4 * nsc].contiguous().view(torch.float32)  # [T, nsc]
    latent = (q.view(t, nsc, g) * scale[..., None]).view(t, kv_lora_rank)
    rope = rows[:, kv_lora_rank + 4 * nsc :].contiguous().view(torch.bfloat16)
    return latent.to(out_dtype), rope.to(out_dtype)


def read_mla_kv(
    pool: torch.Tensor, slots: torch.Tensor, kind: str, out_dtype: torch.dtype, kv_lora_rank: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised gather (torch on every device: used by references and tests, not hot paths)."""
    return read_mla_kv_ref(pool, slots, kind, out_dtype, kv_lora_rank)


# --------------------------------------------------------------------------------- indexer keys


def index_k_offsets(slots: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets (key, scale) of fp8 index keys at `slots` (int64 [T]) in the page-major layout."""
    page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
    base = page * (PAGE_SIZE * (head_dim + 4))
    return base + off * head_dim, base + PAGE_SIZE * head_dim + 4 * off


def _check_index_pool(pool: torch.Tensor, kind: str, head_dim: int) -> None:
    _check_pool(pool, kind, index_row_bytes(head_dim, kind) if is_fp8(kind) else head_dim)
    if is_fp8(kind):
        check(pool.shape[0] % PAGE_SIZE == 0, f"fp8 index pool needs whole pages of {PAGE_SIZE} slots")


def write_index_k_ref(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, kind: str) -> None:
    """Reference of `write_index_k` (torch, any device)."""
    _check_rows(slots, k, "k", pool)
    d = k.shape[1]
    _check_index_pool(pool, kind, d)
    if not is_fp8(kind):
        pool[slots] = k.to(pool.dtype)
        return
    q, scale = _quantise_groups(k, d)
    flat = pool.view(-1)
    ko, so = index_k_offsets(slots, d)
    flat[ko[:, None] + torch.arange(d, device=pool.device)] = q
    flat[so[:, None] + torch.arange(4, device=pool.device)] = scale.contiguous().view(torch.uint8)


def write_index_k(
    pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, kind: str, *, backend: str = "auto"
) -> None:
    """Store T indexer keys k [T, D] at `slots` (int64 [T]); fp8 kinds quantise with one scale per key."""
    _check_rows(slots, k, "k", pool)
    _check_index_pool(pool, kind, k.shape[1])
    if not use_triton(backend, pool.device):
        write_index_k_ref(pool, slots, k, kind)
        return
    t, d = k.shape
    if t == 0:
        return
    if is_fp8(kind):
        _write_fp8_rows_kernel[(t,)](
            k, k.stride(0), k, 0, slots, pool, ROW=pool.shape[1], N=d, GS=d, GSP=next_pow2(d), R=0, RP=1,
            EPS=AMAX_EPS, INDEX_PAGE=PAGE_SIZE, num_warps=2,
        )  # fmt: skip
    else:
        _write_dense_rows_kernel[(t,)](
            k, k.stride(0), k, 0, slots, pool, ROW=pool.shape[1], N=d, NP=next_pow2(d), R=0, RP=1, num_warps=2
        )


def read_index_k_ref(
    pool: torch.Tensor, slots: torch.Tensor, kind: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """Gather + dequantise T indexer keys -> [T, D] in `out_dtype`."""
    check(slots.dim() == 1 and slots.dtype == torch.int64, "slots must be int64 [T]")
    if not is_fp8(kind):
        _check_pool(pool, kind, pool.shape[1])
        return pool[slots].to(out_dtype)
    d = pool.shape[1] - 4
    _check_index_pool(pool, kind, d)
    flat = pool.view(-1)
    ko, so = index_k_offsets(slots, d)
    q = flat[ko[:, None] + torch.arange(d, device=pool.device)].view(torch.float8_e4m3fn).float()  # [T, D]
    scale = flat[so[:, None] + torch.arange(4, device=pool.device)].view(torch.float32)  # [T, 1]
    return (q * scale).to(out_dtype)


def read_index_k(pool: torch.Tensor, slots: torch.Tensor, kind: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantised gather (torch on every device)."""
    return read_index_k_ref(pool, slots, kind, out_dtype)


def index_fp8_roundtrip(k: torch.Tensor) -> torch.Tensor:
    """What an fp8 index pool gives back for these keys: k [T, D] written to a scratch pool of whole pages
    and read back (`write_index_k_ref`, `read_index_k_ref`: e4m3 with one fp32 scale per key), in k's
    dtype. For a training forward whose indexers score the keys the engine's fp8 cache serves
    (`longctx.train --index-fp8`)."""
    check(k.dim() == 2, "k must be 2-D [T, D]")
    t, d = k.shape
    pool = alloc_index_pool(-(-max(t, 1) // PAGE_SIZE) * PAGE_SIZE, d, "fp8_e4m3", k.dtype, k.device)
    slots = torch.arange(t, device=k.device)
    write_index_k_ref(pool, slots, k, "fp8_e4m3")
    return read_index_k_ref(pool, slots, "fp8_e4m3", k.dtype)


# ----------------------------------------------------------------------------------- Triton


# The Triton interpreter rounds fp32 -> e4m3 / bf16 by truncation or half-up, while the GPU and
# torch round to nearest even. The kernels therefore round explicitly with exact fp32/int ops,
# after which every conversion is exact: interpreter, GPU and reference agree byte for byte.


@jit
def _round_e4m3(x):
    # x: fp32 with |x| <= 448 -> the nearest e4m3 value (ties to even), still fp32.
    u = x.to(tl.int32, bitcast=True)
    # normals: keep 3 mantissa bits of the fp32 pattern, ties to even
    un = (u + 0x7FFFF + ((u >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = un.to(tl.float32, bitcast=True)
    # subnormals (|x| < 2^-6): the step is 2^-9; adding 2^14 makes fp32's own RNE do the rounding
    ax = tl.abs(x)
    sub = (ax + 16384.0) - 16384.0
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < 0.015625, sub, normal)


@jit
def _quant_store(row8, offs, x, mask, scale):
    # x fp32 (exact values of the stored dtype) -> e4m3 of x / scale at row8 + offs
    q = tl.fdiv(x, scale, ieee_rounding=True)
    q = _round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
    tl.store(row8 + offs, q.to(tl.float8e4nv), mask=mask)


@jit
def _bf16_bits(x):
    # fp32 -> bf16 bit pattern as int16, round to nearest even (finite inputs).
    u = x.to(tl.int32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.int16)


@jit
def index_fp8_offsets(slot, D: tl.constexpr, PAGE: tl.constexpr):
    """(key byte offset, scale offset in fp32 units) of fp8 index keys at `slot` (int64), page-major."""
    page = slot // PAGE
    off = slot % PAGE
    key = page * (PAGE * (D + 4)) + off * D
    return key, page * (PAGE * (D + 4) // 4) + PAGE * D // 4 + off


@jit
def _write_fp8_rows_kernel(
    x_ptr, stride_x, r_ptr, stride_r, slots_ptr, pool_ptr,
    ROW: tl.constexpr, N: tl.constexpr, GS: tl.constexpr, GSP: tl.constexpr,
    R: tl.constexpr, RP: tl.constexpr, EPS: tl.constexpr, INDEX_PAGE: tl.constexpr = 0,
):  # fmt: skip
    # One program per token: quantise N values in groups of GS, store e4m3 | fp32 scales | bf16 rope.
    # INDEX_PAGE > 0: the page-major index key layout instead (one group, no rope).
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if INDEX_PAGE > 0:
        key_off, scale_off = index_fp8_offsets(slot, N, INDEX_PAGE)
        row8 = pool_ptr.to(tl.pointer_type(tl.float8e4nv)) + key_off
        sc32 = pool_ptr.to(tl.pointer_type(tl.float32)) + scale_off
    else:
        row8 = pool_ptr.to(tl.pointer_type(tl.float8e4nv)) + slot * ROW
        sc32 = pool_ptr.to(tl.pointer_type(tl.float32)) + slot * (ROW // 4) + N // 4
    offs = tl.arange(0, GSP)
    gmask = offs < GS
    for g in tl.static_range(N // GS):
        x = tl.load(x_ptr + t * stride_x + g * GS + offs, mask=gmask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
        scale = tl.fdiv(amax, 448.0, ieee_rounding=True)
        _quant_store(row8, g * GS + offs, x, gmask, scale)
        tl.store(sc32 + g, scale)
    if R > 0:
        roffs = tl.arange(0, RP)
        rmask = roffs < R
        r = tl.load(r_ptr + t * stride_r + roffs, mask=rmask, other=0.0)
        row16 = pool_ptr.to(tl.pointer_type(tl.int16)) + slot * (ROW // 2) + (N + 4 * (N // GS)) // 2
        if r.dtype == tl.bfloat16:
            bits = r.to(tl.int16, bitcast=True)
        else:
            bits = _bf16_bits(r.to(tl.float32))
        tl.store(row16 + roffs, bits, mask=rmask)


@jit
def _write_dense_rows_kernel(
    x_ptr, stride_x, r_ptr, stride_r, slots_ptr, pool_ptr,
    ROW: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, NP)
    x = tl.load(x_ptr + t * stride_x + offs, mask=offs < N)
    _store_cast(pool_ptr + slot * ROW + offs, x, offs < N)
    if R > 0:
        roffs = tl.arange(0, RP)
        r = tl.load(r_ptr + t * stride_r + roffs, mask=roffs < R)
        _store_cast(pool_ptr + slot * ROW + N + roffs, r, roffs < R)


@jit
def _store_cast(ptr, x, mask):
    # Store x into ptr's element type; fp32 -> bf16 goes through the explicit RNE above.
    if ptr.dtype.element_ty == tl.bfloat16 and x.dtype == tl.float32:
        tl.store(ptr.to(tl.pointer_type(tl.int16)), _bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------- paged addressing


def logical_to_rows_ref(
    positions: torch.Tensor, page_table: torch.Tensor, q_seq: torch.Tensor, page_size: int = PAGE_SIZE
) -> torch.Tensor:
    """Logical token positions [T, K] of each query's request (-1 = none) -> pool rows int64 [T, K]
    (-1 stays -1): row = page_table[q_seq[t], pos // page_size] * page_size + pos % page_size."""
    valid = positions >= 0
    pos = positions.clamp(min=0).long()
    pages = page_table.long()[q_seq.long()[:, None], pos // page_size]
    rows = pages * page_size + pos % page_size
    return torch.where(valid, rows, torch.full_like(rows, -1))


@jit
def _logical_to_rows_kernel(
    pos_ptr, table_ptr, seq_ptr, out_ptr, K, s_pos, s_table,
    PAGE: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    km = k < K
    p = tl.load(pos_ptr + t * s_pos + k, mask=km, other=-1).to(tl.int64)
    b = tl.load(seq_ptr + t).to(tl.int64)
    ok = km & (p >= 0)
    page = tl.load(table_ptr + b * s_table + p // PAGE, mask=ok, other=0).to(tl.int64)
    tl.store(out_ptr + t * K + k, tl.where(ok, page * PAGE + p % PAGE, -1), mask=km)


def logical_to_rows(
    positions: torch.Tensor,
    page_table: torch.Tensor,
    q_seq: torch.Tensor,
    page_size: int = PAGE_SIZE,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """`logical_to_rows_ref` in one kernel (torch spends ~10 on it). positions [T, K] int (unit
    column stride), page_table [B, P] int (unit column stride), q_seq [T] int."""
    if not use_triton(backend, positions.device):
        return logical_to_rows_ref(positions, page_table, q_seq, page_size)
    check(positions.dim() == 2 and positions.stride(1) == 1, "logical_to_rows: positions [T, K], unit stride")
    check(page_table.dim() == 2 and page_table.stride(1) == 1, "logical_to_rows: page_table [B, P]")
    check(q_seq.shape == (positions.shape[0],), "logical_to_rows: q_seq must be [T]")
    check(not positions.dtype.is_floating_point, "logical_to_rows: positions must be integers")
    t, k = positions.shape
    out = torch.empty(t, k, dtype=torch.int64, device=positions.device)
    if t and k:
        bk = min(next_pow2(k), 1024)
        _logical_to_rows_kernel[(t, -(-k // bk))](
            positions, page_table, q_seq.contiguous(), out, k, positions.stride(0), page_table.stride(0),
            PAGE=page_size, BK=bk, **pdl(positions.device),
        )  # fmt: skip
    return out
