"""KV / indexer-key layouts and writers, and the lightning-indexer logits: Triton (interpreter) vs reference."""

from __future__ import annotations

import pytest
import torch
from longctx.kernels import kv_layout as kvl
from longctx.kernels.common import KernelInputError, triton_interpret, use_triton
from longctx.kernels.indexer import DecodeKnobs, indexer_logits_paged, indexer_logits_paged_ref

from . import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are built)

# ----------------------------------------------------------------------------------- layouts


def test_row_bytes_match_design_table():
    assert kvl.mla_row_bytes(512, 64, "fp8_e4m3") == 656
    assert kvl.mla_row_bytes(512, 64, "bf16") == 1152
    assert kvl.mla_row_bytes(512, 64, "auto", torch.float32) == 2304
    assert kvl.index_row_bytes(128, "fp8") == 132
    assert kvl.index_row_bytes(128, "auto", torch.bfloat16) == 256
    assert kvl.mla_row_bytes(32, 8, "fp8") == 32 + 4 + 16  # tiny config: one group of 32
    assert kvl.index_row_bytes(16, "fp8") == 20
    with pytest.raises(KernelInputError):
        kvl.mla_row_bytes(192, 64, "fp8")  # not a multiple of the 128 group
    with pytest.raises(KernelInputError):
        kvl.is_fp8("int4")


def test_use_triton_dispatch():
    assert triton_interpret()
    assert not use_triton("torch", "cpu")
    assert not use_triton("auto", "cpu")
    assert use_triton("triton", "cpu")
    with pytest.raises(KernelInputError):
        use_triton("cuda", "cpu")


def _mla_inputs(t: int, lora: int, rope: int, dtype: torch.dtype, num_slots: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # per-token magnitudes spread over decades so the per-group scales really differ
    mag = torch.exp(torch.randn(t, 1, generator=g) * 2)
    latent = (torch.randn(t, lora, generator=g) * mag).to(dtype)
    latent[0, : min(lora, 128)] = 0  # an all-zero group exercises AMAX_EPS
    rope_x = torch.randn(t, rope, generator=g).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:t]  # scattered over pages, crossing page boundaries
    return latent, rope_x, slots


@pytest.mark.parametrize("lora,rope", [(32, 8), (512, 64), (384, 64)])
@pytest.mark.parametrize("kind", ["fp8_e4m3", "auto", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_mla_kv_triton_matches_ref_bytes(lora, rope, kind, dtype):
    t, slots_n = 70, 3 * 64 + 5
    latent, rope_x, slots = _mla_inputs(t, lora, rope, dtype, slots_n, seed=lora + rope)
    pool_dtype = torch.bfloat16 if kind == "bf16" else dtype
    a = kvl.alloc_mla_pool(slots_n, lora, rope, kind, pool_dtype, "cpu").zero_()
    b = a.clone()
    kvl.write_mla_kv(a, slots, latent, rope_x, kind, backend="triton")
    kvl.write_mla_kv_ref(b, slots, latent, rope_x, kind)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # identical bytes, untouched slots still 0
    assert a.shape[1] == (kvl.mla_row_bytes(lora, rope, kind) if kvl.is_fp8(kind) else lora + rope)


@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize("kind", ["fp8", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_index_k_triton_matches_ref_bytes(d, kind, dtype):
    g = torch.Generator().manual_seed(d)
    k = (torch.randn(67, d, generator=g) * torch.exp(torch.randn(67, 1, generator=g))).to(dtype)
    slots = torch.randperm(256, generator=g)[:67]  # scattered over 4 pages
    a = kvl.alloc_index_pool(256, d, kind, dtype, "cpu").zero_()
    b = a.clone()
    kvl.write_index_k(a, slots, k, kind, backend="triton")
    kvl.write_index_k_ref(b, slots, k, kind)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    back = kvl.read_index_k(a, slots, kind, torch.float32)
    if kind == "auto":
        assert torch.equal(back, k.float())


def _fp8_bound(x: torch.Tensor, scale_per_elem: torch.Tensor) -> torch.Tensor:
    # e4m3 RNE: half an ulp = 2^-4 relative in the normal range, 2^-10 * scale in the subnormal
    # range; the fp32 divide / multiply add ~2^-23 relative on top.
    return torch.maximum(x.abs() / 16, scale_per_elem / 1024) * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("lora,rope", [(32, 8), (512, 64)])
def test_fp8_mla_round_trip_error_bound_and_byte_layout(lora, rope):
    t = 40
    latent, rope_x, slots = _mla_inputs(t, lora, rope, torch.float32, 128, seed=7)
    pool = kvl.alloc_mla_pool(128, lora, rope, "fp8", torch.float32, "cpu").zero_()
    kvl.write_mla_kv(pool, slots, latent, rope_x, "fp8", backend="triton")
    lat_back, rope_back = kvl.read_mla_kv(pool, slots, "fp8", torch.float32, kv_lora_rank=lora)

    grp = kvl.mla_group_size(lora)
    amax = latent.view(t, lora // grp, grp).abs().amax(-1).clamp_min(kvl.AMAX_EPS)
    scale = amax / 448.0
    assert torch.all((lat_back - latent).abs() <= _fp8_bound(latent, scale.repeat_interleave(grp, 1)))
    assert torch.all(lat_back[0, :grp] == 0)  # the zero group stays exactly zero
    # rope is stored as bf16: RNE, half an ulp = 2^-8 relative
    assert torch.all((rope_back - rope_x).abs() <= rope_x.abs() * 2**-8)

    # the documented bytes: [0, L) e4m3 | [L, L + 4G) fp32 scales | [.., row) bf16 rope
    rows = pool[slots]
    scales = rows[:, lora : lora + 4 * (lora // grp)].contiguous().view(torch.float32)
    assert torch.equal(scales, scale)
    assert torch.equal(
        rows[:, lora + 4 * (lora // grp) :].contiguous().view(torch.bfloat16), rope_x.bfloat16()
    )
    e4m3 = rows[:, :lora].contiguous().view(torch.float8_e4m3fn).float()
    assert e4m3.abs().max() <= 448 and torch.all(e4m3.view(t, -1, grp).abs().amax(-1)[1:] == 448)


def test_fp8_index_round_trip_error_bound():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(50, 128, generator=g) * torch.exp(torch.randn(50, 1, generator=g) * 3)
    slots = torch.randperm(64, generator=g)[:50]
    pool = kvl.alloc_index_pool(64, 128, "fp8", torch.float32, "cpu")
    kvl.write_index_k(pool, slots, k, "fp8", backend="triton")
    back = kvl.read_index_k(pool, slots, "fp8", torch.float32)
    scale = k.abs().amax(1, keepdim=True) / 448
    assert torch.all((back - k).abs() <= _fp8_bound(k, scale.expand_as(k)))
    # the documented page-major bytes: page p = 64 keys of 128 e4m3, then their 64 fp32 scales
    flat = pool.view(-1)
    for t in range(slots.numel()):
        o = int(slots[t])  # one page: slot == offset
        key = flat[o * 128 : (o + 1) * 128].view(torch.float8_e4m3fn).float()
        assert torch.equal(key * scale[t], back[t])
        assert torch.equal(flat[64 * 128 + 4 * o : 64 * 128 + 4 * o + 4].view(torch.float32), scale[t])


def test_fp8_index_layout_is_page_major_over_pages():
    """Keys of page p start at byte p * 64 * (D + 4); every key is D-byte aligned."""
    d, pages = 16, 3
    k = torch.randn(pages * 64, d, generator=torch.Generator().manual_seed(5))
    pool = kvl.alloc_index_pool(pages * 64, d, "fp8", torch.float32, "cpu").zero_()
    slots = torch.arange(pages * 64).flip(0)
    kvl.write_index_k(pool, slots, k, "fp8", backend="triton")
    ko, so = kvl.index_k_offsets(slots, d)
    page, off = slots // 64, slots % 64
    assert torch.equal(ko, page * 64 * (d + 4) + off * d) and torch.all(ko % d == 0)
    assert torch.equal(so, page * 64 * (d + 4) + 64 * d + 4 * off)
    flat = pool.view(-1)
    scale = flat[so[:, None] + torch.arange(4)].view(torch.float32)
    assert torch.equal(scale.flatten(), k.abs().amax(1) / 448)
    with pytest.raises(KernelInputError):
        kvl.alloc_index_pool(100, d, "fp8", torch.float32, "cpu")  # not whole pages


def test_write_rejects_bad_inputs():
    pool = kvl.alloc_mla_pool(64, 32, 8, "fp8", torch.float32, "cpu")
    lat, rope = torch.randn(4, 32), torch.randn(4, 8)
    with pytest.raises(KernelInputError):
        kvl.write_mla_kv(pool, torch.arange(4, dtype=torch.int32), lat, rope, "fp8")  # int32 slots
    with pytest.raises(KernelInputError):
        kvl.write_mla_kv(pool, torch.arange(4), torch.randn(4, 64), rope, "fp8")  # wrong row width
    with pytest.raises(KernelInputError):
        kvl.write_mla_kv(pool.float(), torch.arange(4), lat, rope, "fp8")  # fp8 pool must be uint8


# ----------------------------------------------------------------------------------- indexer


def _indexer_case(kind, dtype, heads, dim, lens, queries, seed):
    """Pages shuffled over a pool with spare pages; queries: list of (request, positions)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    p = max(max((n + 63) // 64 for n in lens), 1) + 1  # one spare column of the page table
    num_pages = b * p + 3
    page_table = torch.randperm(num_pages, generator=g)[: b * p].view(b, p).int()
    pool = kvl.alloc_index_pool(num_pages * 64, dim, kind, dtype, "cpu").zero_()
    keys = []
    for r, n in enumerate(lens):
        t = torch.arange(n)
        k = torch.randn(n, dim, generator=g).to(dtype)
        kvl.write_index_k(pool, page_table[r, t // 64].long() * 64 + t % 64, k, kind, backend="torch")
        keys.append(k)
    q_seq = torch.tensor([r for r, pos in queries for _ in pos], dtype=torch.int32)
    q_pos = torch.tensor([x for _, pos in queries for x in pos], dtype=torch.int64)
    tq = q_seq.numel()
    q = torch.randn(tq, heads, dim, generator=g).to(dtype)
    w = torch.rand(tq, heads, generator=g) * heads**-0.5 * dim**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (q, w, pool, page_table, seq_lens, q_seq, q_pos), keys


INDEXER_CASES = {
    # decode batch, ragged, none a multiple of 64, one exactly a page, one of 1 token
    "decode_ragged": (8, 16, [100, 37, 200, 64, 1], [(0, [99]), (1, [36]), (2, [199]), (3, [63]), (4, [0])]),
    # prefill chunk crossing a page boundary plus a decode query of another request (mixed batch)
    "prefill_mixed": (8, 16, [130, 70], [(0, list(range(58, 75))), (1, [69])]),
    # a chunked-prefill query set that ends before the request's length (later keys masked causally)
    "prefill_partial": (4, 32, [150], [(0, [3, 64, 65, 90])]),
    # GLM-5.3 indexer shape: 32 heads x 128 dims
    "glm_shape": (32, 128, [193, 65], [(0, [192]), (1, [64])]),
}


@pytest.mark.parametrize("case", list(INDEXER_CASES))
@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_triton_matches_ref(case, kind, dtype):
    heads, dim, lens, queries = INDEXER_CASES[case]
    args, _ = _indexer_case(kind, dtype, heads, dim, lens, queries, seed=len(case))
    got = indexer_logits_paged(*args, kind, backend="triton")
    ref = indexer_logits_paged_ref(*args, kind)
    assert got.shape == ref.shape == (len(args[5]), max(lens)) and got.dtype == torch.float32
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert torch.all(got[~fin] == float("-inf")) and torch.all(ref[~fin] == float("-inf"))
    # same products, fp32 accumulation in another order: fp32 rounding only
    tol = 1e-5 * ref[fin].abs().max().clamp_min(1e-30)
    assert (got[fin] - ref[fin]).abs().max() <= tol


def test_indexer_ref_matches_dense_formula_and_masks():
    heads, dim, lens, queries = INDEXER_CASES["prefill_mixed"]
    args, keys = _indexer_case("auto", torch.float32, heads, dim, lens, queries, seed=11)
    q, w, _, _, seq_lens, q_seq, q_pos = args
    ref = indexer_logits_paged_ref(*args, "auto", max_len=160)
    assert ref.shape == (q.shape[0], 160)
    for i in range(q.shape[0]):
        r, pos = int(q_seq[i]), int(q_pos[i])
        k = keys[r][: pos + 1]
        expect = (torch.relu(torch.einsum("hd,td->ht", q[i], k)) * w[i, :, None]).sum(0)
        torch.testing.assert_close(ref[i, : pos + 1], expect, rtol=1e-5, atol=1e-6)
        assert torch.all(ref[i, pos + 1 :] == float("-inf"))  # causal and beyond the request's length
    got = indexer_logits_paged(*args, "auto", max_len=160, backend="triton")
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref))


def test_indexer_rejects_bad_inputs():
    heads, dim, lens, queries = INDEXER_CASES["decode_ragged"]
    args, _ = _indexer_case("auto", torch.float32, heads, dim, lens, queries, seed=1)
    q, w, pool, pt, sl, qs, qp = args
    with pytest.raises(KernelInputError):
        indexer_logits_paged(q.bfloat16(), w, pool, pt, sl, qs, qp, "auto")  # q dtype != pool dtype
    with pytest.raises(KernelInputError):
        indexer_logits_paged(q, w.t().contiguous().t(), pool, pt, sl, qs, qp, "auto")  # w needs unit H stride
    with pytest.raises(KernelInputError):
        indexer_logits_paged(q, w, pool, pt.long(), sl, qs, qp, "auto")  # page table must be int32


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_indexer_takes_raw_head_weights_and_their_scale(kind, wdtype):
    """w as the model's fused projection gives it (a strided slice, maybe bf16) plus `w_scale`:
    the same logits as the pre-scaled fp32 weights `w.float() * w_scale`, on both paths (fp32 w:
    bit for bit on the reference, where the product is the same one fp32 multiply)."""
    heads, dim, lens, queries = INDEXER_CASES["decode_ragged"]
    args, _ = _indexer_case(kind, torch.float32, heads, dim, lens, queries, seed=7)
    q, w, *rest = args
    wide = torch.randn(w.shape[0], heads + 9, generator=torch.Generator().manual_seed(3)).to(wdtype)
    raw = wide[:, 4 : 4 + heads]  # rows strided, as a slice of a wider GEMM output
    scale = heads**-0.5 * dim**-0.5
    folded = raw.float() * scale
    ref = indexer_logits_paged_ref(q, folded, *rest, kind)
    assert torch.equal(indexer_logits_paged_ref(q, raw, *rest, kind, w_scale=scale), ref)
    got = indexer_logits_paged(q, raw, *rest, kind, w_scale=scale, backend="triton")
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert (got[fin] - ref[fin]).abs().max() <= 1e-5 * ref[fin].abs().max()


@pytest.mark.parametrize("block_n,num_warps", [(16, 4), (256, 8)])
def test_indexer_block_knobs_match_ref(block_n, num_warps):
    """The bench's keys-per-program / warps knobs change tiling only, not results."""
    heads, dim, lens, queries = INDEXER_CASES["decode_ragged"]
    args, _ = _indexer_case("fp8_e4m3", torch.float32, heads, dim, lens, queries, seed=3)
    got = indexer_logits_paged(*args, "fp8_e4m3", backend="triton", block_n=block_n, num_warps=num_warps)
    ref = indexer_logits_paged_ref(*args, "fp8_e4m3")
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert (got[fin] - ref[fin]).abs().max() <= 1e-5 * ref[fin].abs().max().clamp_min(1e-30)


def _assert_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert torch.all(got[~fin] == float("-inf"))
    assert (got[fin] - ref[fin]).abs().max() <= 1e-5 * ref[fin].abs().max().clamp_min(1e-30)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_n,splits", [(16, 1), (32, 5), (64, 3), (128, None), (256, 2)])
def test_indexer_decode_splits_and_tiles_match_ref(kind, dtype, block_n, splits):
    """The decode kernel: several key tiles per program and several programs per query, contexts
    that are not whole pages or tiles, a decode query before its request's end (its later keys
    masked), and more columns than any request has keys."""
    lens = [700, 333, 64, 129, 1]
    queries = [(0, [699]), (1, [200]), (2, [63]), (3, [128]), (4, [0])]
    args, _ = _indexer_case(kind, dtype, 8, 16, lens, queries, seed=block_n)
    got = indexer_logits_paged(*args, kind, 760, backend="triton", block_n=block_n, splits=splits)
    ref = indexer_logits_paged_ref(*args, kind, 760)
    assert got.shape == (5, 760)
    _assert_logits_close(got, ref)
    assert torch.all(got[1, 201:] == float("-inf")) and torch.all(got[0, 700:] == float("-inf"))


def test_indexer_decode_fp16_operands_are_exact_per_head():
    """fp8 pool, bf16 q: the kernel scores in fp16 with q scaled per head by a power of two; heads
    of very different magnitude (and an all-zero one) each match the reference on their own."""
    lens, queries = [300, 190], [(0, [299]), (1, [189])]
    args, _ = _indexer_case("fp8_e4m3", torch.bfloat16, 32, 128, lens, queries, seed=9)
    q, w, *rest = args
    mags = torch.tensor([1.0, 2.0**60, 2.0**-60, 0.0, 3e4, 1e-3] + [1.0] * 26)
    q = (q.float() * mags[None, :, None]).bfloat16()
    for h in (0, 1, 2, 3, 4, 5):
        wh = torch.zeros_like(w)
        wh[:, h] = w[:, h]
        got = indexer_logits_paged(q, wh, *rest, "fp8_e4m3", backend="triton")
        ref = indexer_logits_paged_ref(q, wh, *rest, "fp8_e4m3")
        _assert_logits_close(got, ref)
    _assert_logits_close(
        indexer_logits_paged(q, w, *rest, "fp8_e4m3", backend="triton"),
        indexer_logits_paged_ref(q, w, *rest, "fp8_e4m3"),
    )


@pytest.mark.parametrize("t,k,b", [(1, 2048, 1), (5, 300, 3), (8, 16, 8), (3, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_logical_to_rows_matches_reference(t, k, b, dtype):
    """Top-k positions across page boundaries, -1 pads, rows of different requests and lengths."""
    g = torch.Generator().manual_seed(t * 7 + k + b)
    pages = 40
    table = torch.randperm(b * pages, generator=g).view(b, pages).to(torch.int32)
    table[0, 30:] = -1  # a shorter request: its table is padded
    q_seq = torch.randint(0, b, (t,), generator=g).to(torch.int32)
    lens = torch.where(q_seq == 0, 30 * 64, pages * 64)
    pos = (torch.rand(t, k, generator=g) * lens[:, None]).long()
    pos[torch.rand(t, k, generator=g) < 0.2] = -1
    pos = pos.to(dtype)
    got = kvl.logical_to_rows(pos, table, q_seq, 64, backend="triton")
    want = kvl.logical_to_rows_ref(pos, table, q_seq, 64)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    with pytest.raises(KernelInputError):
        kvl.logical_to_rows(pos.float(), table, q_seq, backend="triton")


# Every decode knob the sweep (bench/idx_sweep.py) sets, alone or combined: TMA pages one / two / four to
# an iteration, deeper pipelines, programs per SM (0: as many as fit), waves, forced splits (one program a
# query, or more programs than tiles), the gather kernel's tiles and its scales loaded a tile ahead
# (sc_ahead with a 32-key tile: two tiles a page).
DECODE_SPECS = [
    "",
    "tma=0",
    "tma=0,block_n=128,stages=3,per_sm=3",
    "tma=1,block_n=64,stages=4,per_sm=4",
    "tma=1,block_n=256,warps=8,stages=2",
    "tma=1,splits=1",
    "tma=1,waves=4,per_sm=2",
    "block_n=64,stages=4,per_sm=4",
    "block_n=256,warps=8,waves=2",
    "block_n=16,stages=1,splits=64",
    "sc_ahead=1",
    "sc_ahead=1,block_n=32,per_sm=0",
    "sc_ahead=1,tma=1,per_sm=0",
]
# contexts not a multiple of the 64-key page, one of exactly a page, one key; ragged within a batch
DECODE_LENS = {1: [301], 3: [190, 1, 129], 8: [250, 64, 1, 37, 300, 65, 129, 200]}


@pytest.mark.parametrize("batch", sorted(DECODE_LENS))
@pytest.mark.parametrize("spec", DECODE_SPECS)
def test_indexer_decode_knobs_match_ref(spec, batch):
    """Decode launches under every knob setting give the reference's logits on fresh random inputs: fp8
    pool, bf16 q (fp16 operands in the kernel), raw weights + w_scale; in batch 3 one query stops short
    of its request's end (causal mask inside the context)."""
    lens = DECODE_LENS[batch]
    queries = [(r, [n - 1 if r else max(n - 60, 0)]) for r, n in enumerate(lens)]
    args, _ = _indexer_case(
        "fp8_e4m3", torch.bfloat16, 8, 64, lens, queries, seed=10 * DECODE_SPECS.index(spec) + batch
    )
    knobs = DecodeKnobs.parse(spec)
    got = indexer_logits_paged(*args, "fp8_e4m3", w_scale=0.7, backend="triton", knobs=knobs)
    ref = indexer_logits_paged_ref(*args, "fp8_e4m3", w_scale=0.7)
    assert got.shape == ref.shape == (batch, max(lens))
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)) and torch.all(got[~fin] == float("-inf"))
    assert (got[fin] - ref[fin]).abs().max() <= 1e-5 * ref[fin].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_decode_tma_glm_shape_and_fp32_q(dtype):
    """The TMA kernel at the GLM-5.3 indexer shape (32 heads x 128 dims: 66 rows of 128 bytes a page), with
    fp32 queries too (fp32 operands), matches the reference; a max_len past every context fills -inf."""
    lens = [193, 65, 700]
    args, _ = _indexer_case("fp8_e4m3", dtype, 32, 128, lens, [(0, [192]), (1, [64]), (2, [699])], seed=5)
    knobs = DecodeKnobs(tma=1, block_n=128)
    got = indexer_logits_paged(*args, "fp8_e4m3", max_len=800, backend="triton", knobs=knobs)
    ref = indexer_logits_paged_ref(*args, "fp8_e4m3", max_len=800)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)) and torch.all(got[~fin] == float("-inf"))
    assert (got[fin] - ref[fin]).abs().max() <= 1e-5 * ref[fin].abs().max()


def test_indexer_decode_tma_knob_falls_back_for_dense_pools():
    """tma=1 on a dense (bf16) pool runs the gather kernel: same results as the default launch."""
    heads, dim, lens, queries = INDEXER_CASES["decode_ragged"]
    args, _ = _indexer_case("auto", torch.bfloat16, heads, dim, lens, queries, seed=9)
    got = indexer_logits_paged(*args, "auto", backend="triton", knobs=DecodeKnobs(tma=1))
    assert torch.equal(got, indexer_logits_paged(*args, "auto", backend="triton"))


def test_decode_knobs_parse_and_validate():
    k = DecodeKnobs.parse("tma=1, stages=4,per_sm=2")
    assert k == DecodeKnobs(tma=1, stages=4, per_sm=2) and DecodeKnobs.parse(k.spec()) == k
    assert DecodeKnobs.parse("") == DecodeKnobs() and DecodeKnobs.parse("waves=2", base=k).waves == 2
    for bad in (
        "tma=2",
        "sc_ahead=2",
        "block_n=48",
        "block_n=8",
        "warps=3",
        "stages=-1",
        "nope=1",
        "splits=-1",
    ):
        with pytest.raises(KernelInputError):
            DecodeKnobs.parse(bad)


def test_dense_kinds_are_the_config_tables_dtype_names():
    """A dense kind is any name `longctx.config`'s dtype table gives (`half`, `float` were unknown kinds here,
    as `fp8` was to `longctx plan`)."""
    assert kvl.mla_row_bytes(512, 64, "half") == kvl.mla_row_bytes(512, 64, "float16") == 1152
    assert kvl.index_row_bytes(128, "float") == 512 and not kvl.is_fp8("fp32")
    assert kvl.alloc_mla_pool(64, 32, 8, "half", torch.float32, "cpu").dtype == torch.float16
    assert kvl.alloc_index_pool(64, 16, "float", torch.bfloat16, "cpu").dtype == torch.float32
