"""Each Triton kernel against its torch reference on the GPU, each case in its own process.

A kernel that faults (misaligned address, illegal access) poisons the CUDA context, so every case
runs in a fresh subprocess with CUDA_LAUNCH_BLOCKING=1 and reports ok / max error / the exception.

    python -m bench.gpu_kernel_check [--only NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp(min=1e-12)) if fin.any() else 0.0


def _pool(ctx: int, batch: int, dim: int, kind: str, dev: str):
    from longctx.kernels.kv_layout import alloc_index_pool, write_index_k_ref

    pages = -(-ctx // 64)
    pool = alloc_index_pool(batch * pages * 64, dim, kind, torch.bfloat16, dev).zero_()
    write_index_k_ref(
        pool,
        torch.arange(pool.shape[0], device=dev),
        torch.randn(pool.shape[0], dim, device=dev, dtype=torch.bfloat16),
        kind,
    )
    pt = torch.arange(batch * pages, dtype=torch.int32, device=dev).view(batch, pages)
    return pool, pt


def case_kv_write(kind: str) -> float:
    """Bytes should match the reference exactly; report the dequantised error if they do not."""
    from longctx.kernels.kv_layout import alloc_mla_pool, read_mla_kv_ref, write_mla_kv, write_mla_kv_ref

    a = alloc_mla_pool(5000, 512, 64, kind, torch.bfloat16, "cuda").zero_()
    b = a.clone()
    slots = torch.randperm(5000, device="cuda")[:3000]
    lat, rope = torch.randn(3000, 512, device="cuda"), torch.randn(3000, 64, device="cuda")
    write_mla_kv(a, slots, lat, rope, kind, backend="triton")
    write_mla_kv_ref(b, slots, lat, rope, kind)
    if torch.equal(a, b):
        return 0.0
    diff = (a != b).any(0).nonzero().flatten().tolist()
    print(f"bytes differ in {int((a != b).sum())} places, columns {diff[:8]}...", file=sys.stderr)
    la, ra = read_mla_kv_ref(a, slots, kind, torch.float32, 512)
    return max(rel(la, lat), rel(ra, rope))


def case_index_write() -> float:
    from longctx.kernels.kv_layout import alloc_index_pool, read_index_k_ref, write_index_k

    a = alloc_index_pool(5120, 128, "fp8", torch.bfloat16, "cuda").zero_()  # whole pages
    slots = torch.randperm(5120, device="cuda")[:3000]
    k = torch.randn(3000, 128, device="cuda")
    write_index_k(a, slots, k, "fp8", backend="triton")
    return rel(read_index_k_ref(a, slots, "fp8", torch.float32), k)


def case_indexer(kind: str, ctx: int, batch: int) -> float:
    from longctx.kernels.indexer import indexer_logits_paged, indexer_logits_paged_ref

    pool, pt = _pool(ctx, batch, 128, kind, "cuda")
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(batch, 32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    args = (
        q,
        w,
        pool,
        pt,
        sl,
        torch.arange(batch, dtype=torch.int32, device="cuda"),
        torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda"),
        kind,
        ctx,
    )
    return rel(indexer_logits_paged(*args, backend="triton"), indexer_logits_paged_ref(*args))


def _ragged_case(lens: list[int], tq_per: int, kind: str, wide_q: bool = False):
    """Requests of `lens` keys on scattered pages, `tq_per` queries each at their last positions."""
    from longctx.kernels.kv_layout import alloc_index_pool, write_index_k

    b = len(lens)
    p = -(-max(lens) // 64)
    pt = torch.randperm(b * p + 5, device="cuda")[: b * p].view(b, p).int()
    pool = alloc_index_pool((b * p + 5) * 64, 128, kind, torch.bfloat16, "cuda").zero_()
    for r, n in enumerate(lens):
        t = torch.arange(n, device="cuda")
        write_index_k(pool, pt[r, t // 64].long() * 64 + t % 64, torch.randn(n, 128, device="cuda"), kind)
    q_seq = torch.arange(b, dtype=torch.int32, device="cuda").repeat_interleave(tq_per)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_pos = (sl.long()[q_seq] - 1 - torch.arange(tq_per, device="cuda").repeat(b) * 37).clamp_min(0)
    q = torch.randn(b * tq_per, 32, 128, device="cuda")
    if wide_q:  # heads of very different magnitude: the fp16 operands are scaled per head
        q = q * torch.logspace(-30, 30, 32, base=2.0, device="cuda")[None, :, None]
    w = torch.rand(b * tq_per, 32, device="cuda") * (32 * 128) ** -0.5
    return (q.bfloat16(), w, pool, pt, sl, q_seq, q_pos, kind, max(lens) + 3)


def case_indexer_decode(kind: str, knobs: dict, wide_q: bool = False) -> float:
    """The decode kernel on a ragged batch (contexts not whole pages, one query before its end,
    more columns than keys), with the bench's knobs."""
    from longctx.kernels.indexer import indexer_logits_paged, indexer_logits_paged_ref

    args = _ragged_case([70_001, 1, 64, 129, 5_000, 33_333, 100_000, 777], 1, kind, wide_q)
    args[6][5] -= 1000  # a decode query before its request's end: later keys masked
    return rel(indexer_logits_paged(*args, backend="triton", **knobs), indexer_logits_paged_ref(*args))


def case_indexer_prefill(kind: str) -> float:
    """The prefill kernel (several queries per request) on the page-major fp8 layout."""
    from longctx.kernels.indexer import indexer_logits_paged, indexer_logits_paged_ref

    args = _ragged_case([3_000, 10_001], 40, kind)
    return rel(indexer_logits_paged(*args, backend="triton"), indexer_logits_paged_ref(*args))


def case_indexer_topk_fused() -> float:
    """The fused prefill indexer + top-k over the page-major fp8 keys: 0 when the indices match."""
    from longctx.kernels.indexer_topk import indexer_topk_paged, indexer_topk_paged_ref

    q, w, pool, pt, sl, qs, qp, kind, _ = _ragged_case([20_000, 12_345], 64, "fp8")
    info: dict = {}
    got = indexer_topk_paged(q, w, pool, pt, sl, qs, qp, kind, 2048, backend="triton", stats=info)
    ref = indexer_topk_paged_ref(q, w, pool, pt, sl, qs, qp, kind, 2048)
    print(info, file=sys.stderr)
    return float((got != ref).float().mean())


def case_indexer_topk_small_k(ctx: int, k: int) -> float:
    """The fused indexer + top-k at a long context with a small k (the retrieval model's 256 at 1M,
    --long-topk's 32 at 128K: a sampled threshold's margin lets ~4-13k keys through, more than the
    old fixed 4k candidates): the share of mismatched rows plus the share of queries that took the
    unfused fallback (0 expected; the seventeenth session's 128K top-32 training step sent 58%)."""
    from longctx.kernels.indexer_topk import indexer_topk_paged, indexer_topk_paged_ref

    q, w, pool, pt, sl, qs, qp, kind, _ = _ragged_case([ctx], 256, "fp8")
    info: dict = {}
    got = indexer_topk_paged(q, w, pool, pt, sl, qs, qp, kind, k, backend="triton", stats=info)
    ref = indexer_topk_paged_ref(q, w, pool, pt, sl, qs, qp, kind, k)
    print(info, file=sys.stderr)
    return float((got != ref).any(1).float().mean()) + info["fallback_queries"] / q.shape[0]


def case_train_select_fused(rows: int, S: int, k: int = 256, dot: str = "tf32x3") -> float:
    """The trainer's fused selection (`TrainCausalLM._select_fused`: the fused kernel over the keys as a
    dense fp32 pool, the retrieval model's 8 x 64 indexer, top-k: the model's 256, or --long-topk's 32)
    against its chunked selection on random fp32 inputs: the share of selected positions that differ
    (near-ties only; `dot`: the fused kernel's fp32 products, the trainer's tf32x3 or exact ieee)."""
    from longctx.config import ModelConfig
    from longctx.train.model import TrainCausalLM, selection_mask

    m = TrainCausalLM(ModelConfig.from_json(ROOT / "configs" / "retrieval.json"))
    m.select_form, m.select_dot = "fused", dot
    g = torch.Generator(device="cuda").manual_seed(S)
    qi = torch.randn(rows, S, 8, 64, generator=g, device="cuda")
    ki = torch.randn(rows, S, 64, generator=g, device="cuda")
    wi = torch.rand(rows, S, 8, generator=g, device="cuda")
    got, want = m._select_fused(qi, ki, wi, k), m._select(qi, ki, wi, k)
    if m.select_dot != dot:  # (the trainer's fallback took exact products: this case did not run)
        raise RuntimeError(f"fp32_dot {dot} did not run on this GPU")
    # compared in blocks of query rows: whole [S, S] masks at 128K are 17 GB each (the seventeenth
    # session's plan sent this case out of memory, and the session trained with exact products for it)
    got, want = got.flatten(0, 1), want.flatten(0, 1)
    diff = total = 0
    for r0 in range(0, got.shape[0], 2048):
        a, b = selection_mask(got[r0 : r0 + 2048], S), selection_mask(want[r0 : r0 + 2048], S)
        diff += int((a != b).sum())
        total += int(b.sum())
    return diff / max(total, 1)


def case_topk(n: int, batch: int) -> float:
    from longctx.kernels.topk import topk_indices, topk_indices_ref

    x = torch.randn(batch, n, device="cuda")
    v = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    return (
        0.0 if torch.equal(topk_indices(x, 2048, v, backend="triton"), topk_indices_ref(x, 2048, v)) else 1.0
    )


def case_gumbel(batch: int, vocab: int, ids: bool) -> float:
    """The seeded Gumbel-max draw against its torch reference: the fraction of rows drawing another token
    (Triton's fp32 log is not torch's, so a near-tie at a row's top may go the other way)."""
    from longctx.kernels import gumbel
    from longctx.kernels.gumbel import gumbel_argmax, gumbel_argmax_ref

    gumbel.PICK_KERNEL_CUDA = True  # (the draw's second kernel too: a process per case)
    x = torch.randn(batch, vocab, device="cuda") * 3
    keys = torch.randint(0, 2**62, (batch,), device="cuda")
    order = torch.argsort(x, dim=1, descending=True) if ids else None
    xs = x.gather(1, order) if ids else x
    got = gumbel_argmax(xs, keys, order, backend="triton")
    want = gumbel_argmax_ref(xs, keys, order)
    return float((got != want).float().mean())


def case_gumbel_t(batch: int, vocab: int, dtype: str) -> float:
    """The Gumbel-max draw scaling raw logits itself (`temperature=`) against the reference over
    `scale_logits_ref`'s rows: the fraction of rows drawing another token. Rows: ordinary, with NaNs, with
    +inf tokens, all -inf, all NaN, a temperature that overflows them to +inf."""
    from longctx.kernels import gumbel
    from longctx.kernels.gumbel import gumbel_argmax, gumbel_argmax_ref, scale_logits_ref

    gumbel.PICK_KERNEL_CUDA = True  # (the draw's second kernel too: a process per case)
    x = (torch.randn(batch, vocab, device="cuda") * 3).to(getattr(torch, dtype))
    t = torch.rand(batch, device="cuda") + 0.2
    x[0, ::97] = float("nan")
    if batch > 4:
        x[1, ::5000] = float("inf")
        x[2] = float("-inf")
        x[3] = float("nan")
        t[4] = 1e-38
    keys = torch.randint(0, 2**62, (batch,), device="cuda")
    got = gumbel_argmax(x, keys, temperature=t, backend="triton")
    want = gumbel_argmax_ref(scale_logits_ref(x, t[:, None]), keys)
    return float((got != want).float().mean())


def case_penalise(rows: int, vocab: int, dtype: str) -> float:
    """The penalties pass against its torch reference on the GPU: 0 when every value is the same bit for
    bit (NaN where NaN), else the largest difference (inf where only one side is infinite). Rows of
    several slots, unpenalised rows between them, -inf / +inf / NaN logits."""
    from longctx.kernels.penalties import penalise, penalise_ref

    x = (torch.randn(rows, vocab, device="cuda") * 5).to(getattr(torch, dtype))
    x[0, ::97] = float("nan")
    x[-1, ::1001] = float("-inf")
    x[-1, 5::3001] = float("inf")
    slots = 4
    slot = torch.randint(-1, slots, (rows,), device="cuda", dtype=torch.int32)
    slot[-1] = 0
    counts = torch.randint(1, 5, (slots, vocab), device="cuda") * (
        torch.rand(slots, vocab, device="cuda") < 0.2
    )
    prompt = (torch.rand(slots, vocab, device="cuda") < 0.1).to(torch.uint8)
    rep = torch.rand(rows, device="cuda") * 2 + 0.25
    rep[::3] = 1.0
    freq, pres = torch.randn(rows, device="cuda"), torch.randn(rows, device="cuda")
    args = (x, slot, counts.to(torch.int32), prompt, rep, freq, pres)
    got, want = penalise(*args, backend="triton"), penalise_ref(*args)
    if torch.equal(got.nan_to_num(0.0, 1.0, -1.0), want.nan_to_num(0.0, 1.0, -1.0)) and torch.equal(
        got.isnan(), want.isnan()
    ):
        return 0.0
    return float((got - want).abs().nan_to_num(float("inf")).max())


def case_topk_window(n: int, batch: int, k: int, window: int) -> float:
    """The decode step's top-k with `index_local_window` (the write pass stores the window): rows before
    and after k + window, at the retrieval model's 192 + 64."""
    from longctx.kernels.topk import topk_indices, topk_indices_ref

    g = torch.Generator(device="cuda").manual_seed(n + batch)
    x = torch.randn(batch, n, device="cuda", generator=g)
    pos = torch.randint(0, n, (batch,), device="cuda", generator=g)
    pos[0], pos[1] = k + window - 1, k + window  # every key selected / the first top-k row
    v = (pos - window).clamp(min=0) + 1
    got = topk_indices(x, k, v, window, pos, backend="triton")
    return 0.0 if torch.equal(got, topk_indices_ref(x, k, v, window, pos)) else 1.0


def case_swap(rpi: int) -> float:
    from longctx.kernels.swap import swap_in_gather, swap_in_gather_ref

    host = torch.randint(0, 255, (4096 * rpi, 656), dtype=torch.uint8).pin_memory()
    src = torch.randperm(4096, device="cuda")[:512] * rpi
    dst = torch.randperm(512, device="cuda") * rpi
    a = torch.zeros(512 * rpi, 656, dtype=torch.uint8, device="cuda")
    b = a.clone()
    swap_in_gather(host, src, a, dst, rpi, backend="triton")
    swap_in_gather_ref(host, src, b, dst, rpi)
    return 0.0 if torch.equal(a, b) else 1.0


def case_sparse_mla(kind: str, batch: int) -> float:
    from longctx.kernels.kv_layout import alloc_mla_pool, write_mla_kv_ref
    from longctx.kernels.sparse_mla import sparse_mla, sparse_mla_ref

    pool = alloc_mla_pool(1 << 16, 512, 64, kind, torch.bfloat16, "cuda").zero_()
    write_mla_kv_ref(
        pool,
        torch.arange(1 << 16, device="cuda"),
        torch.randn(1 << 16, 512, device="cuda"),
        torch.randn(1 << 16, 64, device="cuda"),
        kind,
    )
    ql = torch.randn(batch, 64, 512, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(batch, 64, 64, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 1 << 16, (batch, 2048), device="cuda", dtype=torch.int32)
    idx[:, -100:] = -1
    return rel(
        sparse_mla(ql, qr, pool, idx, 0.0625, kind, backend="triton"),
        sparse_mla_ref(ql, qr, pool, idx, 0.0625, kind),
    )


def case_moe(
    fp8: bool, t: int, hidden: int, inter: int, e: int, k: int = 2, decode: bool | None = None
) -> float:
    """moe_experts vs its reference: top-`k` of `e` experts; `decode` as moe_experts' (None: by T*k). With
    the decode path one slot is ignored (-1) and, when there are several tokens, an expert shared by all."""
    from longctx.kernels.fp8_gemm import quant_block_fp8_ref
    from longctx.kernels.moe import moe_experts, moe_experts_ref

    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    wgu = torch.randn(e, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    wd = torch.randn(e, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
    if decode:
        ids[-1, -1] = -1
        if t > 1:
            ids[:, 0] = torch.where((ids == 0).any(1), ids[:, 0], 0)  # expert 0 in every token
    w = torch.rand(t, k, device="cuda")
    sg = sd = None
    if fp8:
        q = [quant_block_fp8_ref(wgu[i]) for i in range(e)]
        r = [quant_block_fp8_ref(wd[i]) for i in range(e)]
        wgu, sg = torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])
        wd, sd = torch.stack([a for a, _ in r]), torch.stack([b for _, b in r])
    args = (x, ids, w, wgu, wd, "silu", sg, sd)
    return rel(moe_experts(*args, backend="triton", decode=decode), moe_experts_ref(*args))


def case_fp8_linear(t: int, n: int, k: int) -> float:
    from longctx.kernels.fp8_gemm import fp8_block_linear, fp8_block_linear_ref, quant_block_fp8_ref

    wq, s = quant_block_fp8_ref(torch.randn(n, k, device="cuda"))
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    return rel(
        fp8_block_linear(x, wq, s, torch.bfloat16, backend="triton"),
        fp8_block_linear_ref(x, wq, s, torch.bfloat16),
    )


def case_gemv(m: int, n: int, k: int, fp8: bool, dot: bool | None) -> float:
    """kernels.gemv vs its reference in bf16; `dot` forces the FMA (False) or tensor-core (True) form,
    None takes the default tiles and split-K."""
    from longctx.kernels.fp8_gemm import quant_block_fp8_ref
    from longctx.kernels.gemv import GemvConfig, gemv, gemv_ref

    w = torch.randn(n, k, device="cuda") / k**0.5
    if fp8:
        wq, s = quant_block_fp8_ref(w)
    else:
        wq, s = w.bfloat16(), None
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = (
        None if dot is None else GemvConfig(bn=64 if dot else 32, bk=128 if (fp8 or not dot) else 64, dot=dot)
    )
    return rel(gemv(x, wq, s, backend="triton", config=cfg), gemv_ref(x, wq, s))


def case_fp16_mma(kind: str, m: int, n: int, k: int) -> float:
    """bf16 x @ e4m3 weights through the fp16 MMA (`fp8_gemm.fp16_rows`) with fp32 output, rows of
    magnitude 1, 2^60, 2^-60 and 0: the largest error of a row relative to that row's float64 reference,
    which must stay at fp32 rounding (the bf16 MMA's), far under bf16's 2^-8."""
    from longctx.kernels.fp8_gemm import dequant_block_fp8_ref, fp8_block_linear, quant_block_fp8_ref
    from longctx.kernels.gemv import gemv

    wq, s = quant_block_fp8_ref(torch.randn(n, k, device="cuda") / k**0.5)
    mag = torch.tensor([1.0, 2.0**60, 2.0**-60, 0.0], device="cuda").repeat(m)[:m]
    x = (torch.randn(m, k, device="cuda") * mag[:, None]).bfloat16()
    fn = gemv if kind == "gemv" else fp8_block_linear
    out = fn(x, wq, s, torch.float32, backend="triton").double()
    ref = x.double() @ dequant_block_fp8_ref(wq, s).double().T
    scale = ref.abs().amax(dim=1, keepdim=True)
    return ((out - ref).abs() / torch.where(scale > 0, scale, 1.0)).max().item()


def case_norm(add: bool) -> float:
    from longctx.kernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

    x = torch.randn(7, 6144, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(6144, device="cuda", dtype=torch.bfloat16)
    if add:
        (y, h), (yr, hr) = add_rms_norm(x, r, w, 1e-5, backend="triton"), add_rms_norm_ref(x, r, w, 1e-5)
        return max(rel(y, yr), rel(h, hr))
    return rel(rms_norm(x[:, :512], w[:512], 1e-6, backend="triton"), rms_norm_ref(x[:, :512], w[:512], 1e-6))


def case_rope(interleaved: bool) -> float:
    """Bit-exact on the GPU too (each op rounds to bf16 as torch's do)."""
    from longctx.kernels.rope import apply_rope, apply_rope_ref

    q = torch.randn(5, 64, 256, device="cuda", dtype=torch.bfloat16)[..., 192:]  # MLA q[..., nope:]
    f = torch.randint(0, 1 << 20, (5, 1), device="cuda").float() * torch.rand(32, device="cuda")
    cos, sin = f.cos().bfloat16(), f.sin().bfloat16()
    k = torch.randn(5, 32, 128, device="cuda", dtype=torch.bfloat16)  # indexer q: rope on the first 64
    a = apply_rope(q, cos, sin, backend="triton")
    b = apply_rope(k, cos, sin, 64, interleaved, backend="triton")
    return float(
        not (
            torch.equal(a, apply_rope_ref(q, cos, sin))
            and torch.equal(b, apply_rope_ref(k, cos, sin, 64, interleaved))
        )
    )


def case_silu_mul() -> float:
    from longctx.kernels.activation import silu_mul, silu_mul_ref

    x = torch.randn(9, 2 * 2048, device="cuda", dtype=torch.bfloat16)
    return rel(silu_mul(x, backend="triton"), silu_mul_ref(x))


def case_router(t: int, masked: bool = False) -> float:
    """GLM-5's router (256 experts, 8 groups, top-4 groups, top-8; logits kernel + select kernel): same
    experts, same weights; with `masked`, every other row is padding (ids -1, weights 0 on both)."""
    from longctx.kernels.moe import moe_router, moe_router_ref

    h = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 6144, device="cuda") * 0.02
    bias = torch.randn(256, device="cuda") * 0.01
    args = (h, w, bias, 8, 8, 4, True, 2.5)
    valid = torch.arange(t, device="cuda") % 2 == 0 if masked else None
    ids, wt = moe_router(*args, valid=valid, backend="triton")
    rids, rwt = moe_router_ref(*args, valid=valid)
    a, b = ids.sort(-1), rids.sort(-1)
    if not torch.equal(a.values, b.values):
        return float("inf")
    return rel(wt.gather(1, a.indices), rwt.gather(1, b.indices))


def case_router_logits(t: int, e: int, hd: int) -> float:
    """The router's logits kernel (bf16 rows, fp32 weights, fp32 products) against an fp64 GEMM."""
    from longctx.kernels.moe import router_logits

    h = torch.randn(t, hd, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, hd, device="cuda") * 0.02
    return rel(router_logits(h, w), torch.nn.functional.linear(h.double(), w.double()))


def case_align(t: int, k: int, e: int) -> float:
    from longctx.kernels.moe import moe_align, moe_align_ref

    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
    (p, b), (pr, br) = moe_align(ids, e, 16), moe_align_ref(ids, e, 16)
    return float(not (torch.equal(p, pr) and torch.equal(b, br)))


def case_logical_rows() -> float:
    from longctx.kernels.kv_layout import logical_to_rows, logical_to_rows_ref

    table = torch.randperm(4 * 300, device="cuda", dtype=torch.int64).view(4, 300).int()
    pos = torch.randint(-1, 300 * 64, (8, 2048), device="cuda", dtype=torch.int32)
    seq = torch.randint(0, 4, (8,), device="cuda", dtype=torch.int32)
    return float(
        not torch.equal(
            logical_to_rows(pos, table, seq, backend="triton"), logical_to_rows_ref(pos, table, seq)
        )
    )


def case_moe_combine(t: int) -> float:
    """GLM-5's combine: top-8 slots (one ignored) + shared + residual, Hd 6144."""
    from longctx.kernels.moe import moe_combine, moe_combine_ref

    pairs = torch.randn(t, 8, 6144, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (t, 8), device="cuda")
    ids[:, 3] = -1
    sh, res = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16), torch.randn_like(pairs[:, 0])
    return rel(
        moe_combine(pairs, ids, 256, sh, res, backend="triton"), moe_combine_ref(pairs, ids, 256, sh, res)
    )


def case_moe_residual() -> float:
    """moe_experts with the shared experts' output and the residual added in its combine kernel."""
    from longctx.kernels.moe import moe_experts, moe_experts_ref

    t, hd, inter, e = 8, 6144, 2048, 16
    x = torch.randn(t, hd, device="cuda", dtype=torch.bfloat16)
    wgu = torch.randn(e, 2 * inter, hd, device="cuda", dtype=torch.bfloat16) * 0.05
    wd = torch.randn(e, hd, inter, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(e, device="cuda")[:2] for _ in range(t)])
    w = torch.rand(t, 2, device="cuda")
    sh, res = torch.randn_like(x), torch.randn_like(x) * 4
    args = (x, ids, w, wgu, wd, "silu")
    return rel(
        moe_experts(*args, shared=sh, residual=res, backend="triton"),
        moe_experts_ref(*args, shared=sh, residual=res),
    )


def case_indexer_raw_w() -> float:
    """The decode path's head weights: bf16 columns of the stacked projection, scaled in the kernel."""
    from longctx.kernels.indexer import indexer_logits_paged, indexer_logits_paged_ref

    pool, pt = _pool(5000, 2, 128, "fp8", "cuda")
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    xa = torch.randn(2, 2048 + 576 + 128 + 32, device="cuda", dtype=torch.bfloat16)
    w = xa[:, -32:]
    sl = torch.full((2,), 5000, dtype=torch.int32, device="cuda")
    qs = torch.arange(2, dtype=torch.int32, device="cuda")
    qp = (sl - 1).long()
    args = (q, w, pool, pt, sl, qs, qp, "fp8", 5000)
    s = 32**-0.5 * 128**-0.5
    return rel(
        indexer_logits_paged(*args, w_scale=s, backend="triton"), indexer_logits_paged_ref(*args, w_scale=s)
    )


def case_norm_rope_mla(kind: str) -> float:
    """Bytes equal to the three kernels it replaces (rms_norm, rope, write_mla_kv) on the GPU too."""
    from longctx.kernels.kv_fused import norm_rope_write_mla_kv
    from longctx.kernels.kv_layout import alloc_mla_pool, write_mla_kv
    from longctx.kernels.norm import rms_norm
    from longctx.kernels.rope import apply_rope

    t = 300
    ckv = torch.randn(t, 2048 + 576, device="cuda", dtype=torch.bfloat16)[:, 2048:]  # a slice of x_proj
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    f = torch.randint(0, 1 << 20, (t, 1), device="cuda").float() * torch.rand(32, device="cuda")
    cos, sin = f.cos().bfloat16(), f.sin().bfloat16()
    slots = torch.randperm(5000, device="cuda")[:t]
    a = alloc_mla_pool(5000, 512, 64, kind, torch.bfloat16, "cuda").zero_()
    b = a.clone()
    norm_rope_write_mla_kv(a, slots, ckv, w, 1e-6, cos, sin, kind, backend="triton")
    c = rms_norm(ckv[:, :512], w, 1e-6, backend="triton")
    write_mla_kv(b, slots, c, apply_rope(ckv[:, 512:], cos, sin, backend="triton"), kind, backend="triton")
    return float(not torch.equal(a, b))


def case_ln_rope_index(interleaved: bool) -> float:
    """The indexer key's LayerNorm + rope + fp8 write vs the reference, dequantised."""
    from longctx.kernels.kv_fused import ln_rope_write_index_k, ln_rope_write_index_k_ref
    from longctx.kernels.kv_layout import alloc_index_pool, read_index_k_ref

    t = 300
    k = torch.randn(t, 2048 + 128, device="cuda", dtype=torch.bfloat16)[:, 2048:]
    lw = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    lb = torch.randn(128, device="cuda", dtype=torch.bfloat16) * 0.1
    f = torch.randint(0, 1 << 20, (t, 1), device="cuda").float() * torch.rand(32, device="cuda")
    cos, sin = f.cos().bfloat16(), f.sin().bfloat16()
    slots = torch.randperm(5120, device="cuda")[:t]
    a = alloc_index_pool(5120, 128, "fp8", torch.bfloat16, "cuda").zero_()  # whole pages
    b = a.clone()
    ln_rope_write_index_k(a, slots, k, lw, lb, 1e-6, cos, sin, 64, interleaved, "fp8", backend="triton")
    ln_rope_write_index_k_ref(b, slots, k, lw, lb, 1e-6, cos, sin, 64, interleaved, "fp8")
    return rel(
        read_index_k_ref(a, slots, "fp8", torch.float32), read_index_k_ref(b, slots, "fp8", torch.float32)
    )


def _place_tables(n: int, batch: int, layers: int, P: int, dev: str) -> tuple:
    """Two copies of empty HiSparse tables (p2s, s2p, stamp) for `batch` rows x `layers` of n slots, their
    counters, the clock, the -1 sink value, the rows' blocks (the last row pads a captured batch: block
    0, nothing requested), their (block, layer) table rows and a page table."""
    tabs = [
        (torch.full((batch + 1, layers, P), -1, dtype=torch.int32, device=dev),
         torch.full((batch + 1, layers, n + 1), -1, dtype=torch.int64, device=dev),
         torch.full((batch + 1, layers, n + 1), -1, dtype=torch.int64, device=dev))
        for _ in range(2)
    ]  # fmt: skip
    accs = [torch.zeros(5, dtype=torch.int64, device=dev) for _ in range(2)]
    now = torch.zeros((), dtype=torch.int64, device=dev)
    minus1 = torch.full((), -1, dtype=torch.int32, device=dev)
    blk = torch.arange(1, batch + 1, device=dev)
    blk[-1] = 0 if batch > 1 else 1
    trow = blk[:, None] * layers + torch.arange(layers, device=dev)
    table = torch.arange(batch * (P // 64 + 1), dtype=torch.int32, device=dev).view(batch, -1)
    return tabs, accs, now, minus1, blk, trow, table


def _place_both(tabs: list, accs: list, pos: torch.Tensor, force: bool, state: tuple, kw: dict) -> tuple:
    """One placement of `pos` into both copies of `_place_tables`' tables, by the torch reference and
    by the kernel (with `kw`); (reference, kernel) placements when the tables, counters and outputs
    agree, else (None, None). state: (now, minus1, blk, trow, table, newest_from, n, P)."""
    from longctx.kernels.lru_place import lru_place, lru_place_ref

    now, minus1, blk, trow, table, nf, n, P = state
    outs = []
    for (p2s, s2p, st), acc, fn in zip(tabs, accs, (lru_place_ref, lru_place)):
        extra = {"backend": "triton", **kw} if fn is lru_place else {}
        outs.append(fn(
            p2s.view(-1), s2p.view(-1), st.view(-1), now, pos, trow * P, trow * (n + 1), 1 + (blk - 1) * n,
            nf, table, acc, n_slots=n, pos_len=P, page_size=64, force=force, minus1=minus1, **extra,
        ))  # fmt: skip
    a, b = outs
    same = all(torch.equal(x[..., :-1], y[..., :-1]) for x, y in zip(*tabs)) and torch.equal(*accs)
    same = same and all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("u", "src", "dst", "copy", "overflow")
    )
    return (a, b) if same else (None, None)


def case_place(n: int, batch: int, layers: int, repeat: bool = False, cand: bool = False) -> float:
    """A sequence of decode placements (M = 2048 top-k rows, ascending then -1 padded; a buffer
    filling up, then full with hits and evictions; a padding row) on copies of the same tables:
    0.0 if the kernel's tables, outputs and counters equal the torch reference's every step.
    repeat: every other step asks for the last step's positions again (all hits: the hit pass
    alone), every fourth one of those as a forced placement (its compacted copies).
    cand: the kernel takes its victims from `lru_candidates` made before each step's placement."""
    from longctx.kernels.lru_place import lru_candidates

    dev, M, P = "cuda", 2048, 131_073
    g = torch.Generator(device=dev).manual_seed(n + batch)
    tabs, accs, now, minus1, blk, trow, table = _place_tables(n, batch, layers, P, dev)
    steps = 3 * (n // M) + 6
    prev = None
    for step in range(steps):
        now += 1
        force = repeat and step % 8 == 7
        ctx = min(P - 1, 4 * M + step * 4 * M)
        sel = torch.rand(batch, ctx, generator=g, device=dev).topk(M, dim=1).indices
        pos = torch.where(torch.rand(batch, M, generator=g, device=dev) < 0.97, sel, -1).sort(dim=1).values
        pos = torch.where(pos < 0, ctx, pos).sort(dim=1).values  # ascending, then -1 padding
        pos = torch.where(pos == ctx, -1, pos)
        pos[-1] = -1 if batch > 1 else pos[-1]
        if repeat and step % 2 == 1:
            pos = prev
        prev = pos
        nf = torch.full((batch,), ctx - 64, dtype=torch.int64, device=dev)
        kw: dict = {}
        if cand:
            s2p, st = tabs[1][1], tabs[1][2]
            kw["cand"] = lru_candidates(
                s2p.view(-1), st.view(-1), now, trow * (n + 1), nf, n_slots=n, count=M, backend="triton"
            )
        a, b = _place_both(tabs, accs, pos.contiguous(), force, (now, minus1, blk, trow, table, nf, n, P), kw)
        same = a is not None and b.cnt is not None and torch.equal(b.cnt, a.copy.sum(-1))
        if not same:
            print(f"differs at step {step}", file=sys.stderr)
            return 1.0
    print(f"hits {int(accs[0][0])} misses {int(accs[0][1])}", file=sys.stderr)
    return 0.0


def case_place_keep(n: int, batch: int, layers: int) -> float:
    """Kept victim candidates over a decode-like sequence (the top-256 of a 100K context, three
    quarters of it from the positions selected before, the newest 64 positions protected and moving
    on by one a step, a buffer filling up and then evicting; a padding row): 0.0 if every step's
    candidates equal `lru_candidates_ref` on the tables as they are and the placements from them equal
    the reference's, with the kept lists both reused and made again."""
    from longctx.kernels import lru_place as lp

    dev, M, P, recent = "cuda", 256, 131_073, 64
    count = M + recent
    g = torch.Generator(device=dev).manual_seed(n + batch + 7)
    tabs, accs, now, minus1, blk, trow, table = _place_tables(n, batch, layers, P, dev)
    kept = lp.cand_keep_buffers((batch + 1) * layers, count, dev)
    hot = torch.randint(0, 100_000, (batch, 4 * M), generator=g, device=dev)
    reused = made = 0
    for step in range(n // (M // 4) + 40):
        now += 1
        ctx = 100_000 + step
        fresh = torch.randint(0, ctx - recent, (batch, M), generator=g, device=dev)
        old = hot.gather(1, torch.randint(0, hot.shape[1], (batch, M), generator=g, device=dev))
        pick = torch.where(torch.rand(batch, M, generator=g, device=dev) < 0.75, old, fresh)
        hot = torch.cat([hot[:, M // 4 :], fresh[:, : M // 4]], dim=1)
        pos = pick.sort(dim=1).values  # (duplicates allowed)
        if batch > 1:
            pos[-1] = -1
        nf = torch.full((batch,), ctx - recent, dtype=torch.int64, device=dev)
        newest = torch.arange(ctx - recent, ctx, device=dev).expand(batch, recent).contiguous()
        p2s, s2p, st = tabs[1]
        before = [t.clone() for t in kept]
        cand = lp.lru_candidates(
            s2p.view(-1), st.view(-1), now, trow * (n + 1), nf, n_slots=n, count=count, backend="triton",
            keep=lp.CandKeep(*kept, p2s.view(-1), trow * P),
        )  # fmt: skip
        want = lp.lru_candidates_ref(
            s2p.view(-1), st.view(-1), now, trow * (n + 1), nf, n_slots=n, count=count
        )
        if not torch.equal(cand, want):
            print(f"candidates differ at step {step}", file=sys.stderr)
            return 1.0
        planes = trow[: max(1, batch - 1)].flatten().tolist()  # (the padding row's aside)
        for pl in planes:
            same = all(torch.equal(x[pl], y[pl]) for x, y in zip(before, kept))
            reused += same
            made += not same
        for q, force in ((newest, True), (pos, False)):
            a, _ = _place_both(
                tabs, accs, q, force, (now, minus1, blk, trow, table, nf, n, P), {"cand": cand}
            )
            if a is None:
                print(f"placements differ at step {step}", file=sys.stderr)
                return 1.0
    print(
        f"kept lists reused {reused}, made {made}; hits {int(accs[0][0])} misses {int(accs[0][1])}",
        file=sys.stderr,
    )
    return 0.0 if reused and made else 1.0


def case_hisparse_step_rows(batch: int, layers: int) -> float:
    """kernels/hisparse_step.py's step_rows (a decode step's table offsets, newest positions and the
    clock tick, padding rows included): 0.0 if equal to its torch reference."""
    from longctx.kernels.hisparse_step import step_rows, step_rows_ref

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(batch)
    blk = torch.randint(0, 2 * batch, (batch,), generator=g, device=dev)
    seq = torch.randint(1, 100_000, (batch,), generator=g, device=dev).to(torch.int32)
    valid = torch.rand(batch, generator=g, device=dev) < 0.7
    kw = dict(n_layers=layers, n_slots=13_107, pos_len=131_073, recent=64, m=1)
    nows = [torch.zeros((), dtype=torch.int64, device=dev) for _ in range(2)]
    a = step_rows_ref(blk, seq, valid, nows[0], None, **kw)  # type: ignore[arg-type]
    b = step_rows(blk, seq, valid, nows[1], None, backend="triton", **kw)  # type: ignore[arg-type]
    same = torch.equal(*nows) and all(torch.equal(x, y) for x, y in zip(a, b))
    return 0.0 if same else 1.0


def case_hisparse_resolve_tail(batch: int) -> float:
    """kernels/hisparse_step.py's resolve_tail (top-k -> slot rows plus two counted copy lists of
    656-byte rows): 0.0 if the rows and the slot buffer equal its torch reference's."""
    from longctx.kernels.hisparse_step import resolve_tail, resolve_tail_ref

    dev, K, P, n = "cuda", 2048, 131_073, 13_107
    g = torch.Generator(device=dev).manual_seed(batch)
    p2s = torch.randint(-1, n, (batch * P,), generator=g, device=dev).to(torch.int32)
    q = torch.randint(-1, P - 1, (batch, K), generator=g, device=dev).to(torch.int32)
    at, base = torch.arange(batch, device=dev) * P, 1 + torch.arange(batch, device=dev) * n
    host = torch.randint(0, 255, (P, 656), generator=g, device=dev).to(torch.uint8)
    dst = torch.randperm(batch * n, generator=g, device=dev)[: 2 * batch * K].view(2, batch, K) + 1
    copies = [
        (torch.randint(0, P, (batch, K), generator=g, device=dev), dst[i],
         torch.randint(0, K + 1, (batch,), generator=g, device=dev))
        for i in range(2)
    ]  # fmt: skip
    copies[0][2].clamp_(max=1)  # the newest row: at most one
    pools = [torch.zeros(1 + batch * n, 656, dtype=torch.uint8, device=dev) for _ in range(2)]
    ra = resolve_tail_ref(q, p2s, at, base, host, pools[0], copies)
    rb = resolve_tail(q, p2s, at, base, host, pools[1], copies, backend="triton")
    return 0.0 if torch.equal(ra, rb) and torch.equal(*pools) else 1.0


CASES = {
    "kv_write_fp8": (case_kv_write, ("fp8",), 0.07),
    "index_write_fp8": (case_index_write, (), 0.07),
    "kv_write_bf16": (case_kv_write, ("bf16",), 0.0),
    "index_fp8_1k": (case_indexer, ("fp8", 1000, 2), 1e-3),
    "index_fp8_100k": (case_indexer, ("fp8", 100_000, 1), 1e-3),
    "index_bf16_1k": (case_indexer, ("bf16", 1000, 2), 1e-2),
    "index_fp8_decode_ragged": (case_indexer_decode, ("fp8", {}), 1e-5),
    "index_fp8_decode_wide_q": (case_indexer_decode, ("fp8", {}, True), 1e-5),
    "index_fp8_decode_bn64_s2": (case_indexer_decode, ("fp8", {"block_n": 64, "num_stages": 2}), 1e-5),
    "index_fp8_decode_bn256_w8": (case_indexer_decode, ("fp8", {"block_n": 256, "num_warps": 8}), 1e-5),
    "index_fp8_decode_splits7": (case_indexer_decode, ("fp8", {"splits": 7}), 1e-5),
    "index_bf16_decode_ragged": (case_indexer_decode, ("bf16", {}), 1e-2),
    "index_fp8_prefill": (case_indexer_prefill, ("fp8",), 1e-3),
    "index_topk_fused_fp8": (case_indexer_topk_fused, (), 1e-3),
    "index_topk_small_k_128k_k32": (case_indexer_topk_small_k, (131_072, 32), 1e-2),
    "index_topk_small_k_1m_k256": (case_indexer_topk_small_k, (1_048_576, 256), 1e-2),
    "train_select_fused_1x20000": (case_train_select_fused, (1, 20_000), 1e-3),
    "train_select_fused_2x9000": (case_train_select_fused, (2, 9_000), 1e-3),
    "train_select_fused_1x20000_k32": (case_train_select_fused, (1, 20_000, 32), 1e-3),
    "train_select_fused_1x20000_ieee": (case_train_select_fused, (1, 20_000, 256, "ieee"), 1e-3),
    "train_select_fused_1x131072_k32": (case_train_select_fused, (1, 131_072, 32), 1e-3),
    "topk_1m": (case_topk, (1 << 20, 1), 0.0),
    "topk_5k_b8": (case_topk, (5000, 8), 0.0),
    "topk_window_128k_b4": (case_topk_window, (131_072, 4, 192, 64), 0.0),
    "topk_window_5k_b8": (case_topk_window, (5000, 8, 192, 64), 0.0),
    "gumbel_b1_154k": (case_gumbel, (1, 154_880, False), 0.0),
    "gumbel_b32_154k": (case_gumbel, (32, 154_880, False), 0.04),
    "gumbel_ids_b8_5k": (case_gumbel, (8, 5000, True), 0.0),
    "gumbel_t_b1_154k": (case_gumbel_t, (1, 154_880, "float32"), 0.0),
    "gumbel_t_b32_154k_bf16": (case_gumbel_t, (32, 154_880, "bfloat16"), 0.04),
    "penalise_b1_154k": (case_penalise, (1, 154_880, "float32"), 0.0),
    "penalise_b32_154k": (case_penalise, (32, 154_880, "float32"), 0.0),
    "penalise_b8_154k_bf16": (case_penalise, (8, 154_880, "bfloat16"), 0.0),
    "swap_rows": (case_swap, (1,), 0.0),
    "swap_pages": (case_swap, (64,), 0.0),
    "mla_fp8_b1": (case_sparse_mla, ("fp8", 1), 2e-2),
    "mla_fp8_b64": (case_sparse_mla, ("fp8", 64), 2e-2),
    "mla_bf16_b8": (case_sparse_mla, ("bf16", 8), 2e-2),
    "moe_bf16_tiny": (case_moe, (False, 40, 64, 32, 8), 2e-2),
    "moe_bf16_glm": (case_moe, (False, 8, 6144, 2048, 16), 2e-2),
    "moe_fp8_glm": (case_moe, (True, 8, 6144, 2048, 16), 2e-2),
    "fp8_linear_b1": (case_fp8_linear, (1, 2048, 6144), 2e-2),
    "fp8_linear_b512": (case_fp8_linear, (512, 16384, 2048), 2e-2),
    "fp8_linear_fp16_rows_b8": (case_fp16_mma, ("fp8_linear", 8, 2048, 6200), 1e-5),
    "fp8_linear_fp16_rows_b40": (case_fp16_mma, ("fp8_linear", 40, 576, 7168), 1e-5),
    "gemv_fp8_fp16_rows_m16": (case_fp16_mma, ("gemv", 16, 1000, 6200), 1e-5),
    "moe_fp8_glm_b1": (case_moe, (True, 1, 6144, 2048, 16), 2e-2),
    "moe_grouped_fp8_glm": (case_moe, (True, 8, 6144, 2048, 16, 2, False), 2e-2),
    "moe_decode_fp8_glm_b1": (case_moe, (True, 1, 6144, 2048, 64, 8, True), 2e-2),
    "moe_decode_fp8_glm_b8": (case_moe, (True, 8, 6144, 2048, 64, 8, True), 2e-2),
    "moe_decode_bf16_glm_b3": (case_moe, (False, 3, 6144, 2048, 16, 8, True), 2e-2),
    "moe_decode_bf16_odd": (case_moe, (False, 5, 200, 136, 10, 8, True), 2e-2),
    "gemv_bf16_m1": (case_gemv, (1, 16384, 2048, False, None), 1e-2),
    "gemv_bf16_m8_odd": (case_gemv, (8, 1000, 2056, False, None), 1e-2),
    "gemv_bf16_m3_fma": (case_gemv, (3, 4096, 2048, False, False), 1e-2),
    "gemv_fp8_m1": (case_gemv, (1, 2048, 6144, True, None), 1e-2),
    "gemv_fp8_m16_odd": (case_gemv, (16, 576, 6200, True, None), 1e-2),
    "gemv_fp8_m1_fma": (case_gemv, (1, 24576, 6144, True, False), 1e-2),
    "gemv_fp8_m8_splitk": (case_gemv, (8, 32, 6144, True, True), 1e-2),
    "rms_norm": (case_norm, (False,), 1.6e-2),
    "add_rms_norm": (case_norm, (True,), 1.6e-2),
    "rope_interleaved": (case_rope, (True,), 0.0),
    "rope_half": (case_rope, (False,), 0.0),
    "silu_mul": (case_silu_mul, (), 1e-2),
    "router_glm_b1": (case_router, (1,), 1e-5),
    "router_glm_b64": (case_router, (64,), 1e-5),
    "router_glm_b64_valid": (case_router, (64, True), 1e-5),
    "router_logits_glm_b1": (case_router_logits, (1, 256, 6144), 1e-5),
    "router_logits_glm_b64": (case_router_logits, (64, 256, 6144), 1e-5),
    "router_logits_small_b1": (case_router_logits, (1, 16, 2048), 1e-5),
    "router_logits_odd_b33": (case_router_logits, (33, 24, 1000), 1e-5),
    "align_b1": (case_align, (1, 8, 256), 0.0),
    "align_b64": (case_align, (64, 4, 16), 0.0),
    "logical_to_rows": (case_logical_rows, (), 0.0),
    "moe_combine_b1": (case_moe_combine, (1,), 1e-2),
    "moe_combine_b64": (case_moe_combine, (64,), 1e-2),
    "moe_shared_residual": (case_moe_residual, (), 2e-2),
    "index_raw_w": (case_indexer_raw_w, (), 1e-3),
    "norm_rope_mla_fp8": (case_norm_rope_mla, ("fp8",), 0.0),
    "norm_rope_mla_bf16": (case_norm_rope_mla, ("bf16",), 0.0),
    "ln_rope_index_interleaved": (case_ln_rope_index, (True,), 0.13),
    "ln_rope_index_half": (case_ln_rope_index, (False,), 0.13),
    "place_13k_b1": (case_place, (13_107, 1, 3), 0.0),
    "place_13k_b8": (case_place, (13_107, 8, 3), 0.0),
    "place_105k_b1": (case_place, (104_857, 1, 2), 0.0),
    "place_105k_b8": (case_place, (104_857, 8, 2), 0.0),
    "place_allhit_13k_b1": (case_place, (13_107, 1, 3, True), 0.0),
    "place_cand_13k_b1": (case_place, (13_107, 1, 3, False, True), 0.0),
    "place_cand_13k_b8": (case_place, (13_107, 8, 3, True, True), 0.0),
    "place_cand_105k_b1": (case_place, (104_857, 1, 2, False, True), 0.0),
    "place_allhit_13k_b8": (case_place, (13_107, 8, 1, True), 0.0),
    "keep_cand_13k_b1": (case_place_keep, (13_107, 1, 3), 0.0),
    "keep_cand_13k_b4": (case_place_keep, (13_107, 4, 2), 0.0),
    "place_hisparse_step_rows": (case_hisparse_step_rows, (8, 6), 0.0),
    "place_hisparse_resolve_tail_b1": (case_hisparse_resolve_tail, (1,), 0.0),
    "place_hisparse_resolve_tail_b8": (case_hisparse_resolve_tail, (8,), 0.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.case:
        fn, a, _ = CASES[args.case]
        print(json.dumps({"err": fn(*a)}))
        return 0
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    names = [n for n in CASES if not args.only or args.only in n]
    res = {}
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for n in names:
        p = subprocess.run(
            [sys.executable, "-m", "bench.gpu_kernel_check", "--case", n],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        try:
            err = json.loads(p.stdout.strip().splitlines()[-1])["err"]
            r = {"ok": err <= CASES[n][2], "err": err}
        except Exception:  # noqa: BLE001
            tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-3:]
            r = {"ok": False, "error": " | ".join(tail)[-400:]}
        res[n] = r
        print(n, r, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-kernel-check.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
