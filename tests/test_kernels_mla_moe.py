"""Sparse MLA, MoE experts/router and FP8 block GEMM: Triton (interpreter) vs torch references, and the
references vs straightforward dense math / transformers.

Tolerances (max abs error, relative to the largest |reference| value `ref_max` where stated):
  * fp32 everywhere: 1e-4 absolute on O(1) outputs (observed ~1e-6; only summation order differs).
  * bf16 inputs: 2e-2 * ref_max + 1e-2. The kernels round dequantised KV, softmax weights and the MoE
    intermediate to bf16 before the tensor-core dots and write bf16 outputs (1 ulp = 2^-8 relative).
  * lse: 1e-4 (fp32) / 2e-2 (bf16 / fp8 pools).
  * act_quant: byte-identical to its reference.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels.common import KernelInputError
from longctx.kernels.fp8_gemm import (
    act_quant,
    act_quant_ref,
    dequant_block_fp8_ref,
    fp8_block_linear,
    fp8_block_linear_ref,
    quant_block_fp8_ref,
)
from longctx.kernels.kv_layout import alloc_mla_pool, write_mla_kv_ref
from longctx.kernels.moe import (
    moe_align,
    moe_align_ref,
    moe_combine,
    moe_combine_ref,
    moe_experts,
    moe_experts_ref,
    moe_router,
    moe_router_ref,
    router_logits,
)
from longctx.kernels.moe_decode import DecodeConfig
from longctx.kernels.sparse_mla import sparse_mla, sparse_mla_ref

TRITON = "triton"


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    out, ref = out.float(), ref.float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item() + 1e-2
    err = (out - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------ sparse MLA
def _pool(n: int, L: int, R: int, kind: str, dtype: torch.dtype, gen: torch.Generator):
    lat = torch.randn(n, L, generator=gen)
    rope = torch.randn(n, R, generator=gen)
    pool = alloc_mla_pool(n, L, R, kind, dtype, "cpu")
    write_mla_kv_ref(pool, torch.arange(n), lat, rope, kind)
    return pool, lat, rope


def _indices(tq: int, k: int, n: int, gen: torch.Generator, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Ragged top-k: query i keeps a different number of valid entries (the rest -1), scattered."""
    idx = torch.stack(
        [
            torch.randperm(n, generator=gen)[:k] if k <= n else torch.randint(0, n, (k,), generator=gen)
            for _ in range(tq)
        ]
    )
    for i in range(tq):
        keep = max(1, (k * (i + 1)) // (tq + 1))
        drop = torch.randperm(k, generator=gen)[: k - keep]
        idx[i, drop] = -1
    return idx.to(dtype)


@pytest.mark.parametrize(
    "L,R,H,K,kind,dtype,splits",
    [
        (32, 8, 2, 40, "auto", torch.float32, None),
        (32, 8, 3, 40, "auto", torch.float32, 1),
        (64, 16, 4, 96, "fp8_e4m3", torch.float32, None),
        (64, 16, 4, 96, "fp8_e4m3", torch.bfloat16, 4),
        (64, 16, 2, 64, "bf16", torch.bfloat16, 1),
        (512, 64, 2, 48, "fp8_e4m3", torch.bfloat16, None),
        (512, 64, 3, 48, "fp8_e4m3", torch.bfloat16, 1),
        (512, 64, 2, 40, "bf16", torch.bfloat16, 2),
        (384, 32, 2, 40, "fp8_e4m3", torch.float32, 2),  # 3 scale groups, padded to 4 in the kernel
    ],
)
@pytest.mark.parametrize("impl", ["split", "heads"])
def test_sparse_mla_triton_matches_ref(L, R, H, K, kind, dtype, splits, impl):
    gen = torch.Generator().manual_seed(L * 1000 + H * 10 + K)
    n = 70
    pool, _, _ = _pool(n, L, R, kind, dtype, gen)
    tq = 3
    ql = torch.randn(tq, H, L, generator=gen).to(dtype)
    qr = torch.randn(tq, H, R, generator=gen).to(dtype)
    idx = _indices(tq, K, n, gen)
    scale = 1.0 / math.sqrt(L + R)
    gather = L == 512 and splits == 1 and impl == "split"  # the per-element scale variant (bench alternative)
    o, lse = sparse_mla(
        ql,
        qr,
        pool,
        idx,
        scale,
        kind,
        True,
        backend=TRITON,
        impl=impl,
        num_splits=splits,
        scale_gather=gather,
    )
    ro, rlse = sparse_mla_ref(ql, qr, pool, idx, scale, kind, True)
    assert o.dtype == dtype and o.shape == (tq, H, L) and lse.shape == (tq, H)
    _close(o, ro, dtype, "o")
    lse_tol = 1e-4 if (dtype == torch.float32 and kind == "auto") else 2e-2
    assert (lse - rlse).abs().max().item() <= lse_tol


@pytest.mark.parametrize(
    "tq,splits,kind,dtype,impl",
    [
        (1, 4, "fp8_e4m3", torch.bfloat16, "heads"),  # batch 1 with K splits: merged inside W_UV's GEMV
        (1, 3, "auto", torch.float32, "heads"),
        (1, 2, "fp8_e4m3", torch.bfloat16, "split"),
        (1, 1, "bf16", torch.bfloat16, "heads"),  # one split: no merge, o then the GEMV
        (3, 2, "fp8_e4m3", torch.bfloat16, "heads"),  # several queries: combine, then the GEMV
    ],
)
def test_sparse_mla_out_proj_equals_attention_then_w_uv(tq, splits, kind, dtype, impl, monkeypatch):
    """`out_proj=W_UV` [H, V, L] returns the attention output times W_UV per head [Tq, H, V]: against
    the reference (sparse_mla_ref, then head_gemv_ref) and against the kernel's own o then `head_gemv`; a
    query with nothing selected gives 0. One query over K splits takes the merge-into-GEMV kernel. Bad
    projections are refused."""
    from longctx.kernels import sparse_mla as smla_mod
    from longctx.kernels.gemv import head_gemv

    merged = []
    real_merge = smla_mod.merge_head_gemv
    monkeypatch.setattr(smla_mod, "merge_head_gemv", lambda *a, **k: merged.append(1) or real_merge(*a, **k))

    L, R, H, V = 64, 16, 4, 24
    gen = torch.Generator().manual_seed(tq * 10 + splits)
    n = 140
    pool, _, _ = _pool(n, L, R, kind, dtype, gen)
    ql = torch.randn(tq, H, L, generator=gen).to(dtype)
    qr = torch.randn(tq, H, R, generator=gen).to(dtype)
    idx = _indices(tq, 130, n, gen)  # (the split impl's 64-token tiles: 3 of them)
    if tq > 1:
        idx[1] = -1
    w = (torch.randn(H, V, L, generator=gen) / math.sqrt(L)).to(dtype)
    scale = 1.0 / math.sqrt(L + R)
    kw = dict(backend=TRITON, impl=impl, num_splits=splits)
    got = sparse_mla(ql, qr, pool, idx, scale, kind, out_proj=w, **kw)
    assert got.shape == (tq, H, V) and got.dtype == dtype
    assert merged == ([1] if tq == 1 and splits > 1 else [])
    ref = sparse_mla_ref(ql, qr, pool, idx, scale, kind, out_proj=w)
    _close(got, ref, dtype, "out_proj")
    o = sparse_mla(ql, qr, pool, idx, scale, kind, **kw)
    _close(got, head_gemv(o, w, backend=TRITON), dtype, "out_proj vs o")
    if tq > 1:
        assert (got[1] == 0).all()
    for bad in (w[:, :, :-1], w.float() if dtype != torch.float32 else w.bfloat16(), w[:-1]):
        with pytest.raises(KernelInputError, match="out_proj"):
            sparse_mla(ql, qr, pool, idx, scale, kind, out_proj=bad, **kw)
    with pytest.raises(KernelInputError, match="no lse"):
        sparse_mla(ql, qr, pool, idx, scale, kind, True, out_proj=w, **kw)


@pytest.mark.parametrize(
    "L,R,H,kind,dtype,interleaved,impl",
    [
        (64, 16, 4, "fp8_e4m3", torch.bfloat16, True, "heads"),
        (32, 16, 3, "auto", torch.float32, False, "heads"),
        (64, 8, 2, "auto", torch.float32, True, "heads"),  # R below 16: rotated by kernels.rope first
        (64, 16, 2, "bf16", torch.bfloat16, False, "split"),  # split rotates first too
    ],
)
def test_sparse_mla_rotates_an_unrotated_q_rope(L, R, H, kind, dtype, interleaved, impl):
    """`rotate=(cos, sin, interleaved)`: q_rope is rotated inside the call (in the heads kernel's prologue when R
    is a power of two >= 16). The result is the call on the query rotated by kernels.rope, bit for bit (the
    rotation rounds as the rope kernel does), and the reference's within tolerance."""
    from longctx.kernels.rope import apply_rope, apply_rope_ref

    gen = torch.Generator().manual_seed(L + R + H)
    n, tq = 50, 3
    pool, _, _ = _pool(n, L, R, kind, dtype, gen)
    ql = torch.randn(tq, H, L, generator=gen).to(dtype)
    q = torch.randn(tq, H, 2 * R, generator=gen).to(dtype)
    qr = q[..., R:]  # a strided slice, as the model's q_b output is
    ang = torch.rand(tq, R // 2, generator=gen) * 6.0
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    idx = _indices(tq, 40, n, gen)
    scale = 1.0 / math.sqrt(L + R)
    rope = (cos, sin, interleaved)
    o, lse = sparse_mla(
        ql, qr, pool, idx, scale, kind, True, backend=TRITON, impl=impl, num_splits=2, rotate=rope
    )
    rotated = apply_rope(qr, cos, sin, R, interleaved, backend=TRITON)
    assert torch.equal(rotated, apply_rope_ref(qr, cos, sin, R, interleaved))
    o2, lse2 = sparse_mla(ql, rotated, pool, idx, scale, kind, True, backend=TRITON, impl=impl, num_splits=2)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    ro, rlse = sparse_mla_ref(ql, qr, pool, idx, scale, kind, True, rope)
    ro2 = sparse_mla_ref(ql, rotated, pool, idx, scale, kind)
    assert torch.equal(ro, ro2)
    _close(o, ro, dtype, "o")


@pytest.mark.parametrize("impl", ["split", "heads"])
def test_sparse_mla_topk_larger_than_context_and_empty_queries(impl):
    """Many -1 (top-k > context), a query with no valid index (zeros, lse=-inf), int64 indices."""
    gen = torch.Generator().manual_seed(1)
    n, L, R, H = 12, 32, 8, 2
    pool, _, _ = _pool(n, L, R, "fp8_e4m3", torch.float32, gen)
    idx = torch.full((4, 80), -1, dtype=torch.int64)
    idx[0, :n] = torch.randperm(n, generator=gen)
    idx[1, 70:75] = torch.tensor([3, 4, 5, 6, 7])
    idx[2, 0] = 11  # one valid entry: output = that row's latent exactly
    ql, qr = torch.randn(4, H, L, generator=gen), torch.randn(4, H, R, generator=gen)
    for splits in (None, 1, 3):
        o, lse = sparse_mla(
            ql, qr, pool, idx, 0.2, "fp8_e4m3", True, backend=TRITON, impl=impl, num_splits=splits
        )
        ro, rlse = sparse_mla_ref(ql, qr, pool, idx, 0.2, "fp8_e4m3", True)
        _close(o, ro, torch.float32, f"splits={splits}")
        assert torch.equal(o[3], torch.zeros_like(o[3])) and torch.isneginf(lse[3]).all()
        assert torch.isneginf(rlse[3]).all() and torch.equal(ro[3], torch.zeros_like(ro[3]))
        assert torch.allclose(lse[:3], rlse[:3], atol=1e-4)
    row = sparse_mla_ref(ql[2:3], qr[2:3], pool, idx[2:3, :1], 0.2, "fp8_e4m3")
    assert torch.allclose(o[2], row[0], atol=1e-5)


def test_sparse_mla_heads_head_blocks_and_tiles():
    """impl="heads" with more heads than one program holds (block_h=16 -> 2 head blocks, the last ragged),
    BLOCK_N=16 tiles and the 16-warp config the bench sweeps; bf16 pool, fp32 queries (exact dots)."""
    gen = torch.Generator().manual_seed(11)
    n, L, R, H, tq = 50, 64, 16, 20, 2
    pool, _, _ = _pool(n, L, R, "bf16", torch.float32, gen)
    ql, qr = torch.randn(tq, H, L, generator=gen), torch.randn(tq, H, R, generator=gen)
    idx = _indices(tq, 40, n, gen)
    ro, rlse = sparse_mla_ref(ql, qr, pool, idx, 0.2, "bf16", True)
    for kw in ({"block_h": 16, "block_n": 16}, {"num_splits": 3, "num_warps": 16, "num_stages": 3}):
        o, lse = sparse_mla(ql, qr, pool, idx, 0.2, "bf16", True, backend=TRITON, impl="heads", **kw)
        _close(o, ro, torch.float32, f"heads {kw}")
        assert torch.allclose(lse, rlse, atol=1e-4)


@pytest.mark.parametrize(
    "L,R,tq,K,vsplit,kw",
    [
        (128, 32, 1, 40, 2, {}),  # fp8 group 128 in 4 value blocks of 32 (the GLM layout, scaled down)
        (128, 32, 3, 40, 4, {"block_n": 16, "num_splits": 3}),
        (128, 32, 8, 24, 2, {"num_warps": 4, "num_splits": 1}),
        (128, 32, 3, 40, 1, {"knobs": "vsplit=4,block_n=16,warps=4,splits=2"}),  # env-style knob string
        (512, 64, 3, 33, 2, {"num_warps": 4}),  # the 656-byte token, 2 of 4 x 128 columns per program
        (512, 64, 1, 48, 4, {"block_h": 16, "num_splits": 2}),  # 20 heads -> 2 head blocks x 4 value programs
        (384, 32, 2, 40, 3, {}),  # 3 value blocks, one per program
    ],
)
def test_sparse_mla_heads_value_split_matches_ref(L, R, tq, K, vsplit, kw):
    """impl="heads" with the value columns cut over programs (each rescoring all of S): ragged top-k
    with -1 padding, one query that keeps a single valid key, odd K, and the knobs from an env-style spec."""
    from longctx.kernels.sparse_mla_heads import HeadsKnobs

    gen = torch.Generator().manual_seed(L + 10 * tq + K + vsplit)
    n, H = 60, (20 if "block_h" in kw else 5)
    pool, _, _ = _pool(n, L, R, "fp8_e4m3", torch.bfloat16, gen)
    ql = torch.randn(tq, H, L, generator=gen).to(torch.bfloat16)
    qr = torch.randn(tq, H, R, generator=gen).to(torch.bfloat16)
    idx = _indices(tq, K, n, gen)
    idx[0] = -1
    idx[0, K // 2] = 7
    kw = dict(kw)
    if "knobs" in kw:
        kw["knobs"] = HeadsKnobs.parse(kw["knobs"])
    else:
        kw["value_split"] = vsplit
    scale = 1.0 / math.sqrt(L + R)
    o, lse = sparse_mla(ql, qr, pool, idx, scale, "fp8_e4m3", True, backend=TRITON, impl="heads", **kw)
    ro, rlse = sparse_mla_ref(ql, qr, pool, idx, scale, "fp8_e4m3", True)
    _close(o, ro, torch.bfloat16, f"vsplit={vsplit} {kw}")
    assert (lse - rlse).abs().max().item() <= 2e-2
    assert torch.allclose(o[0].float(), ro[0].float(), rtol=1e-2, atol=1e-2)  # one key: row 7 (bf16-rounded)


def test_sparse_mla_heads_knobs_parse_and_reject():
    from longctx.kernels.sparse_mla_heads import HeadsKnobs

    k = HeadsKnobs.parse("vsplit=2, warps=4,block_n=64")
    assert (k.vsplit, k.warps, k.block_n, k.stages) == (2, 4, 64, 2)
    assert HeadsKnobs.parse(k.spec()) == k and HeadsKnobs.parse("") == HeadsKnobs()
    for bad in ("vsplit=5", "block_n=24", "warps=3", "bogus=1", "vsplit=-1"):
        with pytest.raises(KernelInputError):
            HeadsKnobs.parse(bad)
    gen = torch.Generator().manual_seed(3)
    pool, _, _ = _pool(8, 128, 32, "fp8_e4m3", torch.float32, gen)
    with pytest.raises(KernelInputError, match="value_split"):
        sparse_mla(torch.zeros(1, 2, 128), torch.zeros(1, 2, 32), pool, torch.zeros(1, 4, dtype=torch.int32),
                   1.0, "fp8_e4m3", backend=TRITON, impl="heads", value_split=3)  # fmt: skip


def test_sparse_mla_heads_tiling_choices():
    from longctx.kernels.sparse_mla_heads import heads_blocks, pick_splits_heads

    assert heads_blocks(512, 128, True) == (128, 4)  # GLM-5 / DeepSeek-V3.2: one 128-group per value block
    assert heads_blocks(384, 128, True) == (128, 3)
    assert heads_blocks(48, 48, True) == (16, 3)  # a block never straddles a scale group
    assert heads_blocks(64, 1, False) == (16, 4)
    with pytest.raises(KernelInputError):
        heads_blocks(1024, 128, True)  # more than 4 value blocks
    assert pick_splits_heads(64, 2048, 32, 132) == 2  # batch 64: 128 CTAs, one wave
    assert pick_splits_heads(8, 2048, 32, 132) == 16
    assert pick_splits_heads(1, 2048, 32, 132) == 32  # capped at 2 tiles per split
    assert pick_splits_heads(8192, 2048, 32, 132) == 1  # prefill
    with pytest.raises(KernelInputError):
        sparse_mla(torch.zeros(1, 2, 32), torch.zeros(1, 2, 8), torch.zeros(4, 40),
                   torch.zeros(1, 4, dtype=torch.int32), 1.0, backend=TRITON, impl="dense")  # fmt: skip


def test_sparse_mla_ref_equals_dense_attention():
    """indices = every token (in shuffled order) == dense softmax attention over the whole context."""
    gen = torch.Generator().manual_seed(2)
    n, L, R, H, tq = 20, 32, 8, 3, 4
    pool, lat, rope = _pool(n, L, R, "fp32", torch.float32, gen)
    ql, qr = torch.randn(tq, H, L, generator=gen), torch.randn(tq, H, R, generator=gen)
    idx = torch.stack([torch.randperm(n, generator=gen) for _ in range(tq)])
    o, lse = sparse_mla_ref(ql, qr, pool, idx, 0.3, "fp32", True)
    s = (torch.einsum("thl,nl->thn", ql, lat) + torch.einsum("thr,nr->thn", qr, rope)) * 0.3
    assert torch.allclose(o, torch.softmax(s, -1) @ lat, atol=1e-5)
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-5)
    # and a causal mask expressed as -1 padding
    causal = torch.stack([torch.where(torch.arange(n) <= 5 * i, torch.arange(n), -1) for i in range(tq)])
    o2 = sparse_mla_ref(ql, qr, pool, causal, 0.3, "fp32")
    s2 = s.masked_fill((causal < 0)[:, None, :], -math.inf)
    assert torch.allclose(o2, torch.softmax(s2, -1) @ lat, atol=1e-5)


def test_mla_absorption_identity():
    """Expanded MLA (k_nope = W_UK c, v = W_UV c) == absorbed form (q_latent = W_UK^T q_nope, o = W_UV o_latent).

    This is the identity the model relies on: q_nope . (W_UK c) == (W_UK^T q_nope) . c, and the softmax
    weights are shared, so sum_k p_k W_UV c_k == W_UV sum_k p_k c_k."""
    gen = torch.Generator().manual_seed(3)
    n, L, R, H, dn, dv, tq = 30, 32, 8, 4, 16, 12, 5
    dt = torch.float64
    lat, rope = torch.randn(n, L, generator=gen, dtype=dt), torch.randn(n, R, generator=gen, dtype=dt)
    w_uk = torch.randn(H, dn, L, generator=gen, dtype=dt) / math.sqrt(L)  # wkv_b's k_nope rows, per head
    w_uv = torch.randn(H, dv, L, generator=gen, dtype=dt) / math.sqrt(L)  # wkv_b's v rows, per head
    q_nope = torch.randn(tq, H, dn, generator=gen, dtype=dt)
    q_rope = torch.randn(tq, H, R, generator=gen, dtype=dt)
    idx = _indices(tq, 16, n, gen, torch.int64)
    scale = (dn + R) ** -0.5
    # expanded (MHA) form over the same selected tokens
    k_nope = torch.einsum("hdl,nl->nhd", w_uk, lat)  # [n, H, dn]
    v = torch.einsum("hdl,nl->nhd", w_uv, lat)  # [n, H, dv]
    s = torch.einsum("thd,nhd->thn", q_nope, k_nope) + torch.einsum("thr,nr->thn", q_rope, rope)
    sel = torch.full((tq, n), -math.inf, dtype=dt)
    for t in range(tq):
        valid = idx[t][idx[t] >= 0]
        sel[t, valid] = 0.0
    p = torch.softmax(s * scale + sel[:, None, :], -1)
    o_expanded = torch.einsum("thn,nhd->thd", p, v)
    # absorbed form through the reference kernel
    q_latent = torch.einsum("hdl,thd->thl", w_uk, q_nope)
    pool = torch.cat([lat, rope], 1)
    o_lat = sparse_mla_ref(q_latent.float(), q_rope.float(), pool.float(), idx, scale, "fp32")
    o_absorbed = torch.einsum("hdl,thl->thd", w_uv.float(), o_lat)
    assert torch.allclose(o_absorbed.double(), o_expanded, atol=1e-5)


def test_sparse_mla_rejects_bad_input():
    pool = torch.zeros(4, 40)
    with pytest.raises(KernelInputError):
        sparse_mla_ref(
            torch.zeros(1, 2, 32), torch.zeros(1, 3, 8), pool, torch.zeros(1, 4, dtype=torch.int32), 1.0
        )
    with pytest.raises(KernelInputError):
        sparse_mla(torch.zeros(1, 2, 32), torch.zeros(1, 2, 8), pool, torch.zeros(1, 4), 1.0, backend=TRITON)
    with pytest.raises(KernelInputError):  # fp8 row width that does not match L/R
        sparse_mla_ref(torch.zeros(1, 2, 32), torch.zeros(1, 2, 8), torch.zeros(4, 50, dtype=torch.uint8),
                       torch.zeros(1, 4, dtype=torch.int32), 1.0, "fp8_e4m3")  # fmt: skip


# ------------------------------------------------------------------------------------------------- MoE
def _experts(e: int, hd: int, inter: int, wdtype, gen: torch.Generator):
    wgu = torch.randn(e, 2 * inter, hd, generator=gen) / math.sqrt(hd)
    wd = torch.randn(e, hd, inter, generator=gen) / math.sqrt(inter)
    if wdtype == "fp8":
        (wgu, sgu), (wd, sd) = quant_block_fp8_ref(wgu), quant_block_fp8_ref(wd)
        return wgu, wd, sgu, sd
    return wgu.to(wdtype), wd.to(wdtype), None, None


def _skewed_ids(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Expert 0: every token (many); expert 1: exactly one pair; expert 2: none; the rest random; one -1."""
    others = torch.tensor([x for x in range(3, e)])
    ids = others[torch.randint(0, len(others), (t, k), generator=gen)]
    ids[:, 0] = 0
    ids[0, 1] = 1
    ids[-1, -1] = -1  # ignored slot (expert parallelism marks non-local experts so)
    # distinct experts per token, as a router gives
    for i in range(t):
        seen = set()
        for j in range(k):
            while int(ids[i, j]) in seen and ids[i, j] >= 0:
                ids[i, j] = others[(int(ids[i, j]) - 3 + 1) % len(others)]
            seen.add(int(ids[i, j]))
    return ids


@pytest.mark.parametrize(
    "t,hd,inter,e,k,xdtype,wdtype",
    [
        (6, 64, 32, 8, 2, torch.float32, torch.float32),
        (20, 48, 40, 7, 3, torch.float32, torch.float32),
        (9, 200, 72, 6, 3, torch.float32, "fp8"),  # Hd, 2I and I cross 128-blocks partially
        (9, 200, 72, 6, 3, torch.bfloat16, "fp8"),
        (5, 64, 32, 5, 2, torch.bfloat16, torch.bfloat16),
        (1, 64, 32, 16, 4, torch.float32, torch.float32),  # decode: one token, most experts idle
    ],
)
def test_moe_experts_triton_matches_ref(t, hd, inter, e, k, xdtype, wdtype):
    """The grouped GEMMs (test_moe_decode_path_matches_ref covers the decode path these sizes default to)."""
    gen = torch.Generator().manual_seed(t * 100 + hd + e)
    wgu, wd, sgu, sd = _experts(e, hd, inter, wdtype, gen)
    x = torch.randn(t, hd, generator=gen).to(xdtype)
    ids = _skewed_ids(t, k, e, gen) if t > 1 else torch.randperm(e, generator=gen)[:k][None]
    w = torch.rand(t, k, generator=gen)
    y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend=TRITON, decode=False)
    ref = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd)
    assert y.dtype == xdtype and y.shape == (t, hd)
    _close(y, ref, xdtype, "moe")


def test_moe_fill_sms_bn_rule():
    """BLOCK_N halves (not below 16) until blocks x slabs covers the SMs; a full grid keeps its tiles."""
    from longctx.kernels.moe_decode import fill_sms_bn

    assert fill_sms_bn(64, 5, 512, 132) == 16  # small-1m batch 1 gate-up: 5 x 32 = 160 programs
    assert fill_sms_bn(64, 5, 2048, 132) == 64  # its down projection: 5 x 32 already
    assert fill_sms_bn(64, 9, 2048, 132) == 64  # GLM-5.3 batch 1 gate-up (8 experts + the spare block)
    assert fill_sms_bn(64, 1, 64, 132) == 16  # never below 16
    assert fill_sms_bn(16, 1, 64, 132) == 16


@pytest.mark.parametrize("path", ["grouped", "decode"])
@pytest.mark.parametrize("fill", [True, False])
def test_moe_experts_fill_the_sms_at_decode(fill, path, monkeypatch):
    """Batch 1 on a "132-SM" device: the grouped gate-up and down grids (or the decode path's gate-up) take
    smaller BLOCK_N with LONGCTX_MOE_FILL_SMS=1 (off by default: the configured ones), and the result still matches the
    reference."""
    from longctx.kernels import moe as moe_mod
    from longctx.kernels import moe_decode as dec_mod

    mod = moe_mod if path == "grouped" else dec_mod
    monkeypatch.setattr(mod, "num_sms", lambda device, cpu=4: 132)
    monkeypatch.setattr(mod, "FILL_SMS", fill)
    seen: list[int] = []
    real = dec_mod.fill_sms_bn
    monkeypatch.setattr(mod, "fill_sms_bn", lambda *a: seen.append(real(*a)) or seen[-1])
    gen = torch.Generator().manual_seed(7)
    e, hd, inter, k = 16, 128, 256, 4
    wgu, wd, sgu, sd = _experts(e, hd, inter, torch.float32, gen)
    x = torch.randn(1, hd, generator=gen)
    ids = torch.randperm(e, generator=gen)[:k][None]
    w = torch.rand(1, k, generator=gen)
    y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend=TRITON, decode=path == "decode")
    _close(y, moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd), torch.float32, "moe")
    want = [16, 16] if path == "grouped" else [16]  # (decode: 4 pairs x 16 slabs = 64 programs)
    assert seen == (want if fill else [])


@pytest.mark.parametrize(
    "t,k,wdtype,xdtype,cfg",
    [
        (1, 8, "fp8", torch.bfloat16, None),  # GLM-5.3 decode at batch 1: every expert one pair
        (1, 2, torch.float32, torch.float32, DecodeConfig(bn_down=16, splits_down=3)),
        (3, 2, "fp8", torch.float32, DecodeConfig(bn_gate_up=16, bn_down=32, splits_down=2)),
        (3, 8, torch.bfloat16, torch.bfloat16, None),
        (8, 2, "fp8", torch.bfloat16, DecodeConfig(bn_gate_up=32, bk=64, splits_down=2)),
        (8, 8, "fp8", torch.bfloat16, DecodeConfig(bn_down=128)),
    ],
)
def test_moe_decode_path_matches_ref(t, k, wdtype, xdtype, cfg):
    """kernels/moe_decode on fresh inputs: 10 experts, so top-8 tokens share most of them (expert 0 takes
    every token), one ignored slot (-1) and one id >= E; Hd and I off the 128 blocks and the tiles, I
    over two scale blocks so the down projection splits."""
    gen = torch.Generator().manual_seed(t * 10 + k)
    e, hd, inter = 10, 200, 136
    wgu, wd, sgu, sd = _experts(e, hd, inter, wdtype, gen)
    x = torch.randn(t, hd, generator=gen).to(xdtype)
    ids = _skewed_ids(t, k, e, gen) if t > 1 else torch.randperm(e, generator=gen)[:k][None]
    if t > 1:
        ids[1, -1] = e + 3
    w = torch.rand(t, k, generator=gen)
    y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend=TRITON, decode=cfg or True)
    assert y.dtype == xdtype and y.shape == (t, hd)
    _close(y, moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd), xdtype, "moe decode")


def test_moe_decode_expert_over_one_group_and_dispatch(monkeypatch):
    """An expert with more pairs than one program serves (moe_decode.BM): its later pairs get leaders
    of their own. Dispatch: the decode path up to DECODE_MAX_PAIRS pairs (or when asked), else grouped."""
    from longctx.kernels import moe as moe_mod
    from longctx.kernels import moe_decode

    gen = torch.Generator().manual_seed(3)
    t, k, e, hd, inter = moe_decode.BM + 5, 2, 4, 64, 32
    wgu, wd, sgu, sd = _experts(e, hd, inter, "fp8", gen)
    x = torch.randn(t, hd, generator=gen)
    ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.randint(1, e, (t,), generator=gen)], dim=1)
    w = torch.rand(t, k, generator=gen)
    ref = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd)
    calls = []

    def spy(*a, **kw):
        calls.append(1)
        return moe_decode.experts_decode(*a, **kw)

    monkeypatch.setattr(moe_mod, "experts_decode", spy)
    monkeypatch.setattr(moe_mod, "DECODE_MAX_PAIRS", t * k)
    _close(moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend=TRITON), ref, torch.float32, "decode")
    assert calls == [1]
    monkeypatch.setattr(moe_mod, "DECODE_MAX_PAIRS", t * k - 1)
    _close(moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend=TRITON), ref, torch.float32, "grouped")
    assert calls == [1]


def test_moe_decode_pick_splits_and_tiles_override():
    from longctx.kernels.moe_decode import PROGRAMS_PER_SM, parse_tiles, pick_splits

    base = DecodeConfig()
    assert parse_tiles("", base) == base
    assert parse_tiles(" bn_gate_up=32, splits_down=4 ", base) == DecodeConfig(bn_gate_up=32, splits_down=4)
    assert parse_tiles("splits_down=none", DecodeConfig(splits_down=2)) == base
    for bad in ("bn=32", "bn_down=x", "bn_down"):
        with pytest.raises(KernelInputError, match="LONGCTX_MOE_DECODE_TILES"):
            parse_tiles(bad, base)

    # GLM-5.3 down at batch 1: 8 experts x 96 row tiles of 64; at most one split per 128 columns of I
    assert pick_splits(8, 96, 2048, 132) == -(-PROGRAMS_PER_SM * 132 // (8 * 96))
    assert pick_splits(64, 96, 2048, 132) == 1
    assert pick_splits(1, 1, 300, 132) == 3


@pytest.mark.parametrize(
    "t,k,hd,dtype,shared,residual",
    [
        (1, 8, 200, torch.float32, True, True),  # decode: one token, Hd not a power of two
        (5, 3, 1500, torch.bfloat16, True, True),  # two column blocks
        (4, 2, 72, torch.bfloat16, False, True),
        (3, 5, 40, torch.float16, True, False),
        (6, 1, 33, torch.float32, False, False),
    ],
)
def test_moe_combine_kernel_matches_reference(t, k, hd, dtype, shared, residual):
    """The combine (sum of the valid slots + shared + residual, each rounded like torch's ops) on fresh
    inputs: pair_out a strided slice, ignored ids (-1 and >= E) with NaN garbage in their rows."""
    gen = torch.Generator().manual_seed(t * 1000 + k * 10 + hd)
    e = 9
    big = torch.randn(t, k + 2, hd + 7, generator=gen).to(dtype)
    pair_out = big[:, 1 : k + 1, 3 : hd + 3]  # strided over tokens, slots and columns
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[0, 0] = -1
    ids[-1, -1] = e + 2
    pair_out[0, 0] = float("nan")
    pair_out[-1, -1] = float("nan")
    sh = torch.randn(t, hd, generator=gen).to(dtype) if shared else None
    rs = torch.randn(t, hd + 5, generator=gen).to(dtype)[:, 2 : hd + 2] if residual else None
    y = moe_combine(pair_out, ids, e, sh, rs, backend=TRITON)
    ref = moe_combine_ref(pair_out, ids, e, sh, rs)
    assert y.dtype == dtype and y.shape == (t, hd) and not y.isnan().any()
    # only the fp32 order of the slot sum differs: at most one rounding step of the dtype apart
    ulp = 2.0 ** {torch.float32: -23, torch.bfloat16: -8, torch.float16: -10}[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=ulp, atol=ulp * 4)
    if dtype == torch.float32 and k == 1:
        assert torch.equal(y, ref)


@pytest.mark.parametrize(
    "t,k,hd,dtype,path",
    [
        (1, 8, 200, torch.float32, "combine"),  # one row: one column block of 1024 (8192 // KP 8)
        (3, 2, 5000, torch.bfloat16, "combine"),  # 2 blocks of 4096 (8192 // KP 2), the last one masked
        (2, 4, 96, torch.bfloat16, "grouped"),
        (2, 4, 96, torch.bfloat16, "decode"),
        (0, 4, 96, torch.float32, "grouped"),  # no tokens: the buffer is left as it is
    ],
)
def test_combine_writes_the_next_norm(t, k, hd, dtype, path):
    """`norm_out`: the combine also writes RMSNorm(y) * w (the next layer's input norm) into the buffer, the
    result y unchanged; it equals kernels.norm's rms_norm of y (the sum of squares in another order: at most
    a rounding step apart), and the reference path gives the same."""
    from longctx.kernels.norm import rms_norm, rms_norm_ref

    gen = torch.Generator().manual_seed(t * 7 + hd)
    e = 6
    w = (1 + 0.1 * torch.randn(hd, generator=gen)).to(dtype)
    if path == "combine":
        pair_out = torch.randn(t, k, hd, generator=gen).to(dtype)
        ids = torch.randint(0, e, (t, k), generator=gen)
        rs = torch.randn(t, hd, generator=gen).to(dtype)
        run = lambda no, backend: moe_combine(pair_out, ids, e, None, rs, no, backend=backend)  # noqa: E731
    else:
        x = torch.randn(t, hd, generator=gen).to(dtype)
        gate_up, down, _, _ = _experts(e, hd, 32, dtype, gen)
        ids = torch.randint(0, e, (t, k), generator=gen)
        tw = torch.rand(t, k, generator=gen)
        rs = torch.randn(t, hd, generator=gen).to(dtype)

        def run(no, backend):
            return moe_experts(
                x, ids, tw, gate_up, down, residual=rs, norm_out=no, backend=backend, decode=path == "decode"
            )

    outs = {}
    for backend in ("torch", TRITON):
        buf = torch.full((t, hd), 7.0, dtype=dtype)
        y = run((buf, w, 1e-5), backend)
        assert torch.equal(y, run(None, backend))
        outs[backend] = (y, buf)
        if t == 0:
            continue
        want = rms_norm(y, w, 1e-5, backend=backend)
        ulp = 2.0 ** {torch.float32: -22, torch.bfloat16: -7}[dtype]
        torch.testing.assert_close(buf.float(), want.float(), rtol=ulp, atol=ulp)
        if backend == "torch":
            assert torch.equal(buf, rms_norm_ref(y, w, 1e-5))
    with pytest.raises(KernelInputError, match="norm_out"):
        run((torch.empty(t, hd + 1, dtype=dtype), w, 1e-5), TRITON)


def test_moe_experts_adds_shared_and_residual():
    """moe_experts(shared=, residual=) == residual + (moe_experts() + shared), on both paths."""
    gen = torch.Generator().manual_seed(11)
    t, hd, inter, e, k = 3, 72, 40, 6, 3
    wgu, wd, sgu, sd = _experts(e, hd, inter, torch.float32, gen)
    x = torch.randn(t, hd, generator=gen)
    ids = _skewed_ids(t, k, e, gen)
    ids[1, 2] = -1
    w = torch.rand(t, k, generator=gen)
    sh, rs = torch.randn(t, hd, generator=gen), torch.randn(t, hd, generator=gen)
    ref = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd, shared=sh, residual=rs)
    torch.testing.assert_close(ref, rs + (moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd) + sh))
    y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, shared=sh, residual=rs, backend=TRITON)
    _close(y, ref, torch.float32, "moe + shared + residual")
    with pytest.raises(KernelInputError, match="residual"):
        moe_experts(x, ids, w, wgu, wd, "silu", residual=rs[:, :10], backend=TRITON)


@pytest.mark.parametrize("path", ["ref", "decode", "grouped"])
def test_moe_experts_reads_shared_after_join(path):
    """`join` runs before the combine reads `shared` (a side stream may still be writing it): a shared
    tensor filled only by the join gives the same sum as one filled from the start, on every path."""
    gen = torch.Generator().manual_seed(12)
    t, hd, inter, e, k = 3, 72, 40, 6, 3
    wgu, wd, sgu, sd = _experts(e, hd, inter, torch.float32, gen)
    x = torch.randn(t, hd, generator=gen)
    ids = _skewed_ids(t, k, e, gen)
    w = torch.rand(t, k, generator=gen)
    sh, rs = torch.randn(t, hd, generator=gen), torch.randn(t, hd, generator=gen)
    late = torch.zeros_like(sh)
    joins = []

    def join():
        joins.append(1)
        late.copy_(sh)

    if path == "ref":
        y = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd, shared=late, residual=rs, join=join)
    else:
        y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, shared=late, residual=rs, join=join,
                        backend=TRITON, decode=path == "decode")  # fmt: skip
    ref = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd, shared=sh, residual=rs)
    assert joins == [1]
    _close(y, ref, torch.float32, f"moe + shared after join ({path})")


def test_moe_align_invariants():
    gen = torch.Generator().manual_seed(5)
    e, bm = 9, 4
    ids = _skewed_ids(11, 3, e, gen)
    pairs, bexp = moe_align(ids, e, bm)
    flat = ids.reshape(-1)
    p = flat.numel()
    assert bexp.numel() == -(-p // bm) + min(e, p) and pairs.numel() == bexp.numel() * bm
    blocks = pairs.view(-1, bm)
    seen = []
    for b in range(blocks.shape[0]):
        real = blocks[b][blocks[b] < p].long()
        if bexp[b] < 0:
            assert real.numel() == 0
            continue
        assert real.numel() > 0 and (flat[real] == bexp[b]).all()
        seen += real.tolist()
    valid = [i for i in range(p) if 0 <= flat[i] < e]
    assert sorted(seen) == valid  # every routed pair exactly once, ignored ids nowhere
    used = bexp[bexp >= 0]
    assert (used[1:] >= used[:-1]).all()  # runs sorted by expert; expert 2 (no tokens) gets no block
    assert 2 not in used.tolist()


def test_moe_experts_ref_matches_transformers():
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaExperts

    gen = torch.Generator().manual_seed(6)
    cfg = GlmMoeDsaConfig(hidden_size=48, moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2)
    mod = GlmMoeDsaExperts(cfg)
    wgu, wd, _, _ = _experts(6, 48, 24, torch.float32, gen)
    with torch.no_grad():
        mod.gate_up_proj.copy_(wgu)
        mod.down_proj.copy_(wd)
    x = torch.randn(7, 48, generator=gen)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(7)])  # expert 5 idle
    w = torch.rand(7, 2, generator=gen)
    with torch.no_grad():
        want = mod(x, ids, w)
    assert torch.allclose(moe_experts_ref(x, ids, w, wgu, wd), want, atol=1e-6)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 3, False)])
def test_moe_router_matches_transformers(n_group, topk_group, norm):
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    gen = torch.Generator().manual_seed(7 + n_group)
    cfg = GlmMoeDsaConfig(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = GlmMoeDsaTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
    h = torch.randn(10, 32, generator=gen).bfloat16()
    with torch.no_grad():
        _, want_w, want_ids = router(h)
    args = (h, router.weight, router.e_score_correction_bias, 4, n_group, topk_group, norm, 2.5)
    for fn in (moe_router_ref, moe_router, lambda *a: moe_router(*a, backend=TRITON)):
        ids, w = fn(*args)
        o1, o2 = ids.sort(-1), want_ids.sort(-1)
        assert torch.equal(o1.values, o2.values)
        assert torch.allclose(w.gather(1, o1.indices), want_w.gather(1, o2.indices), atol=1e-6)
        assert w.dtype == torch.float32


@pytest.mark.parametrize(
    "t,e,k,n_group,topk_group,norm",
    [(1, 256, 8, 8, 4, True), (5, 256, 8, 8, 4, True), (3, 16, 4, 1, 1, True), (4, 12, 6, 3, 2, False),
     (2, 8, 2, 1, 1, True), (64, 16, 4, 1, 1, True)],
)  # fmt: skip
def test_moe_router_kernel_matches_reference(t, e, k, n_group, topk_group, norm):
    """GLM-5's shape (256 experts in 8 groups, top-4 groups, top-8), small-1m's, and a top-k that is not
    a power of two: the same experts and weights as the reference (slots compared as sets)."""
    gen = torch.Generator().manual_seed(t * 100 + e + k)
    h = torch.randn(t, 64, generator=gen).bfloat16()
    wt = torch.randn(e, 64, generator=gen)
    bias = torch.randn(e, generator=gen) * 0.05
    args = (h, wt, bias, k, n_group, topk_group, norm, 2.5)
    ids, w = moe_router(*args, backend=TRITON)
    rids, rw = moe_router_ref(*args)
    assert ids.shape == (t, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    o1, o2 = ids.sort(-1), rids.sort(-1)
    assert torch.equal(o1.values, o2.values)
    torch.testing.assert_close(w.gather(1, o1.indices), rw.gather(1, o2.indices), rtol=1e-5, atol=1e-6)
    assert (ids[:, :-1] != ids[:, 1:]).all()  # k distinct experts


@pytest.mark.parametrize("t", [1, 3, 33])
@pytest.mark.parametrize("e,hd", [(16, 2048), (256, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits_kernel_matches_fp32_linear(t, e, hd, dtype):
    """The logits kernel reads bf16 / fp32 rows as they are and computes exact fp32 products: only the
    summation order differs from `F.linear(h.float(), w)`, so each logit is within 1e-6 of its sum of
    |products| (observed ~1e-7)."""
    gen = torch.Generator().manual_seed(t * 7 + e + hd)
    h = torch.randn(t, hd, generator=gen).to(dtype)
    w = torch.randn(e, hd, generator=gen) * 0.05
    out = router_logits(h, w)
    ref = torch.nn.functional.linear(h.float(), w)
    scale = torch.nn.functional.linear(h.float().abs(), w.abs())
    assert out.shape == (t, e) and out.dtype == torch.float32
    assert ((out - ref).abs() <= 1e-6 * scale).all(), ((out - ref).abs() / scale).max()


@pytest.mark.parametrize("t", [1, 3, 33])
@pytest.mark.parametrize(
    "e,k,n_group,topk_group", [(256, 8, 8, 4), (256, 8, 1, 1), (16, 4, 1, 1), (16, 4, 4, 2)]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_moe_router_two_kernels_match_reference(t, e, k, n_group, topk_group, dtype, masked):
    """The Triton router (logits kernel + select kernel) against the reference at GLM-5's routing (256
    experts in 8 groups, top-4 groups, top-8), without a group limit, and at small-1m's 16 experts, with
    and without padding rows (`valid`: ids -1 and weights 0 on both backends). Slots compared as sets."""
    gen = torch.Generator().manual_seed(t * 1000 + e + n_group * 10 + masked)
    hd = 128
    h = torch.randn(t, hd, generator=gen).to(dtype)
    wt = torch.randn(e, hd, generator=gen) * 0.1
    bias = torch.randn(e, generator=gen) * 0.05
    valid = torch.rand(t, generator=gen) < 0.6 if masked else None
    if valid is not None:
        valid[0], valid[-1] = False, t > 1  # at least one padding row, and one real row if t > 1
    args = (h, wt, bias, k, n_group, topk_group, True, 2.5)
    ids, w = moe_router(*args, valid=valid, backend=TRITON)
    rids, rw = moe_router_ref(*args, valid=valid)
    assert ids.shape == (t, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    o1, o2 = ids.sort(-1), rids.sort(-1)
    assert torch.equal(o1.values, o2.values)
    torch.testing.assert_close(w.gather(1, o1.indices), rw.gather(1, o2.indices), rtol=1e-5, atol=1e-5)
    if valid is not None:
        assert (ids[~valid] == -1).all() and (w[~valid] == 0).all() and (ids[valid] >= 0).all()
        plain, _ = moe_router_ref(*args)  # the reference's mask is the MoE's old one on the ids alone
        assert torch.equal(rids, plain.masked_fill(~valid[:, None], -1))


@pytest.mark.parametrize("t", [1, 3, 4])
@pytest.mark.parametrize(
    "e,k,n_group,topk_group,hd", [(256, 8, 8, 4, 96), (16, 4, 1, 1, 2048), (12, 3, 3, 2, 40)]
)
@pytest.mark.parametrize("masked", [False, True])
def test_moe_router_one_launch_equals_two_kernels(t, e, k, n_group, topk_group, hd, masked):
    """With a `done` counter a few tokens route in one launch (`_router_fused_kernel`: every program
    writes its logits tile, the last one to finish selects every token): the same ids and weights, bit
    for bit, as the logits + select kernels, over many programs (256 experts: 128 of them), the counter
    back at 0 after each call, and a second call on the same counter the same again."""
    from longctx.kernels import moe as moe_mod

    gen = torch.Generator().manual_seed(t * 10 + e + masked)
    h = torch.randn(t, hd, generator=gen).bfloat16()
    wt = torch.randn(e, hd, generator=gen) * 0.1
    bias = torch.randn(e, generator=gen) * 0.05
    valid = None
    if masked:
        valid = torch.ones(t, dtype=torch.bool)
        valid[0] = t == 1  # (a padding row, unless it is the only one)
    args = (h, wt, bias, k, n_group, topk_group, True, 2.5)
    done = torch.zeros(1, dtype=torch.int32)
    calls = []
    real = moe_mod._router_fused
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_mod, "ROUTER_FUSED_MAX_TOKENS", 4)  # (off by default)
        mp.setattr(moe_mod, "_router_fused", lambda *a: calls.append(1) or real(*a))
        for _ in range(2):
            ids, w = moe_router(*args, valid=valid, done=done, backend=TRITON)
            assert done.item() == 0
    assert len(calls) == 2
    want_ids, want_w = moe_router(*args, valid=valid, backend=TRITON)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    rids, _ = moe_router_ref(*args, valid=valid)
    assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)


def test_moe_router_counter_is_checked_and_many_tokens_take_two_kernels(monkeypatch):
    from longctx.kernels import moe as moe_mod

    h, wt, bias = torch.randn(9, 32).bfloat16(), torch.randn(16, 32), torch.zeros(16)
    args = (h, wt, bias, 4, 1, 1, True, 1.0)
    with pytest.raises(KernelInputError, match="done must be an int32"):
        moe_router(*args, done=torch.zeros(2, dtype=torch.int32), backend=TRITON)
    monkeypatch.setattr(moe_mod, "ROUTER_FUSED_MAX_TOKENS", 4)
    monkeypatch.setattr(moe_mod, "_router_fused", lambda *a: pytest.fail("9 tokens took the one launch"))
    ids, _ = moe_router(*args, done=torch.zeros(1, dtype=torch.int32), backend=TRITON)
    assert ids.shape == (9, 4)


@pytest.mark.parametrize("t,k,e,bm", [(1, 4, 16, 16), (1, 8, 256, 16), (8, 4, 16, 16), (64, 4, 16, 16),
                                      (11, 3, 9, 4), (32, 8, 256, 16), (5, 2, 8, 64)])  # fmt: skip
def test_moe_align_kernel_equals_reference(t, k, e, bm):
    gen = torch.Generator().manual_seed(t + k + e)
    ids = _skewed_ids(t, k, e, gen) if t > 1 else torch.randperm(e, generator=gen)[:k][None]
    ids = ids.clone()
    if t > 2:
        ids[1, 0] = -1  # an id outside [0, E) (expert parallelism's "not local") is dropped
    pairs, bexp = moe_align(ids, e, bm)
    rp, rb = moe_align_ref(ids, e, bm)
    assert torch.equal(pairs, rp) and torch.equal(bexp, rb)


# -------------------------------------------------------------------------------------------- FP8 GEMM
def test_block_quant_roundtrip_and_ref_vs_dense():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(200, 300, generator=gen)
    q, s = quant_block_fp8_ref(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    deq = dequant_block_fp8_ref(q, s)
    assert ((deq - w).abs() <= w.abs() / 16 + s.max() / 512).all()  # half an e4m3 ulp (+ subnormal step)
    x = torch.randn(5, 300, generator=gen)
    assert torch.allclose(fp8_block_linear_ref(x, q, s), x @ deq.T, atol=1e-4)


@pytest.mark.parametrize(
    "t,n,k,dtype,qa",
    [
        (1, 200, 300, torch.float32, False),
        (3, 130, 257, torch.bfloat16, False),
        (33, 64, 128, torch.float32, False),
        (5, 200, 300, torch.float32, True),
        (17, 130, 257, torch.bfloat16, True),
    ],
)
def test_fp8_block_linear_triton_matches_ref(t, n, k, dtype, qa):
    gen = torch.Generator().manual_seed(t + n + k)
    q, s = quant_block_fp8_ref(torch.randn(n, k, generator=gen) / math.sqrt(k))
    x = torch.randn(t, k, generator=gen).to(dtype)
    out = fp8_block_linear(x, q, s, quantize_act=qa, backend=TRITON)
    ref = fp8_block_linear_ref(x, q, s, quantize_act=qa)
    assert out.dtype == dtype and out.shape == (t, n)
    _close(out, ref, dtype, "fp8 gemm")
    out32 = fp8_block_linear(x, q, s, torch.float32, quantize_act=qa, backend=TRITON)
    assert out32.dtype == torch.float32


@pytest.mark.parametrize("split_k", [1, 2, 3, 64])
@pytest.mark.parametrize("t,k,qa", [(1, 640, False), (2, 300, True), (1, 300, False)])
def test_fp8_block_linear_split_k_matches_ref(split_k, t, k, qa):
    """Split-K (the small-T decode path): whole 128-column blocks per split, a partial last block, more
    splits asked for than blocks; fp32 partials summed in a fixed order."""
    gen = torch.Generator().manual_seed(split_k * 7 + k)
    n = 72
    q, s = quant_block_fp8_ref(torch.randn(n, k, generator=gen) / math.sqrt(k))
    x = torch.randn(t, k, generator=gen)
    out = fp8_block_linear(x, q, s, quantize_act=qa, backend=TRITON, split_k=split_k)
    _close(out, fp8_block_linear_ref(x, q, s, quantize_act=qa), torch.float32, f"split_k={split_k}")


def test_fp8_pick_splits_fills_the_gpu():
    from longctx.kernels.fp8_gemm import _pick_splits

    # q_a_proj at T=1: 32 tiles of BN=64 over N=2048, K=6144 (48 scale blocks) on 132 SMs
    assert 32 * _pick_splits(32, 6144, 132) >= 4 * 132
    assert _pick_splits(384 * 2, 6144, 132) == 1  # enough tiles already (prefill / dense_gate_up)
    assert _pick_splits(1, 128, 132) == 1  # one scale block: nothing to split


@pytest.mark.parametrize("x_bytes,w_bytes", [(4, 4), (2, 2), (2, 1), (4, 1)])
@pytest.mark.parametrize("t,hd,inter", [(1, 64, 32), (64, 6144, 2048), (4096, 6144, 2048), (8, 48, 40)])
def test_moe_tiles_fit_shared_memory(x_bytes, w_bytes, t, hd, inter):
    """fp32 weights at tiny dims once asked for 288 KB of shared memory (H200 limit 227 KB)."""
    from longctx.kernels.moe import _SMEM_BUDGET, _moe_smem, _pick_moe_tiles

    bm, bn, bk, _, st = _pick_moe_tiles(t, 8, 256, hd, inter, x_bytes, w_bytes)
    assert _moe_smem(bm, bn, bk, st, x_bytes, w_bytes) <= _SMEM_BUDGET
    assert 128 % bk == 0 and bk >= 16 and bn >= 16 and bm >= 16


def test_act_quant_exact():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 300, generator=gen) * torch.logspace(-3, 2, 300)
    x[1, :128] = 0.0  # an all-zero group takes the 1e-4 floor
    for xx in (x, x.bfloat16()):
        q, s = act_quant(xx, backend=TRITON)
        rq, rs = act_quant_ref(xx)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert (
        (rq.float() * rs.repeat_interleave(128, -1)[:, :300] - x.bfloat16().float()).abs()
        <= x.abs() / 8 + 1e-3
    ).all()


def test_fp8_linear_rejects_bad_scales():
    q, s = quant_block_fp8_ref(torch.randn(130, 257))
    with pytest.raises(KernelInputError):
        fp8_block_linear_ref(torch.randn(2, 257), q, s[:1])
    with pytest.raises(KernelInputError):
        fp8_block_linear(torch.randn(2, 256), q, s, backend=TRITON)


def test_bench_imports_on_cpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "kernels_mla_moe.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_mla_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not torch.cuda.is_available():
        assert mod.main([]) == 0
        assert "CUDA" in capsys.readouterr().out


def test_sparse_mla_impl_auto_resolves(monkeypatch):
    from longctx.kernels import sparse_mla as sm

    monkeypatch.delenv("LONGCTX_SPARSE_MLA_IMPL", raising=False)
    assert sm.resolve_impl("split", 10**6) == "split" and sm.resolve_impl("heads", 1) == "heads"
    monkeypatch.setattr(sm, "HEADS_MIN_QUERIES", 64)
    assert sm.resolve_impl("auto", 63) == "split" and sm.resolve_impl("auto", 64) == "heads"
    monkeypatch.setenv("LONGCTX_SPARSE_MLA_IMPL", "split")
    assert sm.resolve_impl("auto", 10**6) == "split"
    monkeypatch.setenv("LONGCTX_SPARSE_MLA_IMPL", "bogus")
    with pytest.raises(Exception, match="LONGCTX_SPARSE_MLA_IMPL"):
        sm.resolve_impl("auto", 1)
