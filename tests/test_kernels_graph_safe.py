"""The decode-path kernel wrappers make no host sync and no pageable host->device copy, so a decode step
can be captured in a CUDA graph (bench/layer.py once failed with "Cannot copy between CPU and CUDA tensors
during CUDA graph capture": moe_align stored a Python scalar into a device tensor).

There is no GPU here, so each wrapper runs (Triton under the interpreter) inside a TorchDispatchMode that
records every aten op, and the test fails on the ops that mean a sync or a host->device copy on CUDA:
  * `_local_scalar_dense`: .item(), int(t), float(t), bool(t), .tolist(), a tensor used as a Python int;
  * `lift_fresh` / `lift_fresh_copy`: torch.tensor(...) of Python data, or `t[i] = 3` (a CPU scalar tensor
    copied into the device tensor: on CUDA a pageable H2D copy plus a stream sync);
  * data-dependent output shapes (nonzero, unique, masked_select, repeat_interleave without output_size),
    which sync to size their outputs.
The Triton interpreter's own argument copies (empty/set_/copy_) are allowed: on the GPU they do not exist.
"""

from __future__ import annotations

import os
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels import kv_layout as kvl
from longctx.kernels.fp8_gemm import act_quant, fp8_block_linear, quant_block_fp8_ref
from longctx.kernels.gemv import GemvConfig, gemv
from longctx.kernels.indexer import indexer_logits_paged
from longctx.kernels.kv_fused import ln_rope_write_index_k, norm_rope_write_mla_kv
from longctx.kernels.moe import moe_align, moe_combine, moe_experts, moe_router
from longctx.kernels.sparse_mla import sparse_mla
from longctx.kernels.topk import topk_indices
from torch.utils._python_dispatch import TorchDispatchMode

_FORBIDDEN = (
    "aten._local_scalar_dense",
    "aten.item",
    "aten.lift_fresh",
    "aten.lift_fresh_copy",
    "aten.nonzero",
    "aten._unique",
    "aten.unique",
    "aten.masked_select",
    "aten.is_nonzero",
    "aten.equal",
)


class _Audit(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bad: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if name.startswith(_FORBIDDEN) or (
            name.startswith("aten.repeat_interleave") and (kwargs or {}).get("output_size") is None
        ):
            self.bad[name] += 1
        return func(*args, **(kwargs or {}))


def _audit(fn) -> Counter[str]:  # type: ignore[no-untyped-def]
    """Run fn under the audit. .tolist()/.numpy()/.cpu() of a CPU tensor dispatch no aten op, so they are
    wrapped for the duration (on CUDA each is a device->host copy and a sync)."""
    patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
    with _Audit() as a:

        def spy(name: str):  # type: ignore[no-untyped-def]
            def f(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                a.bad[f"Tensor.{name}"] += 1
                return patched[name](self, *args, **kwargs)

            return f

        try:
            for name in patched:
                setattr(torch.Tensor, name, spy(name))
            fn()
        finally:
            for name, orig in patched.items():
                setattr(torch.Tensor, name, orig)
    return a.bad


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _kv_writes() -> None:
    g = _gen()
    for kind in ("fp8_e4m3", "bf16"):
        pool = kvl.alloc_mla_pool(64, 64, 16, kind, torch.bfloat16, "cpu")
        slots = torch.tensor([3, 9])
        lat, rope = torch.randn(2, 64, generator=g), torch.randn(2, 16, generator=g)
        _audited("write_mla_kv", lambda: kvl.write_mla_kv(pool, slots, lat, rope, kind, backend="triton"))  # noqa: B023
        ipool = kvl.alloc_index_pool(64, 32, kind, torch.bfloat16, "cpu")
        k = torch.randn(2, 32, generator=g)
        _audited("write_index_k", lambda: kvl.write_index_k(ipool, slots, k, kind, backend="triton"))  # noqa: B023


def _audited(what: str, fn) -> None:  # type: ignore[no-untyped-def]
    bad = _audit(fn)
    assert not bad, f"{what}: host sync / host->device copy on the decode path: {dict(bad)}"


def test_kv_writes_graph_safe():
    _kv_writes()


@pytest.mark.parametrize("kind", ["fp8_e4m3", "bf16"])
def test_fused_kv_writes_graph_safe(kind):
    g = _gen()
    slots = torch.tensor([3, 9])
    pool = kvl.alloc_mla_pool(64, 64, 16, kind, torch.bfloat16, "cpu")
    ckv = torch.randn(2, 80, generator=g).bfloat16()
    cos, sin = torch.rand(2, 8, generator=g).bfloat16(), torch.rand(2, 8, generator=g).bfloat16()
    nw = torch.ones(64, dtype=torch.bfloat16)
    _audited(
        "norm_rope_write_mla_kv",
        lambda: norm_rope_write_mla_kv(pool, slots, ckv, nw, 1e-6, cos, sin, kind, backend="triton"),
    )
    ipool = kvl.alloc_index_pool(64, 32, kind, torch.bfloat16, "cpu")
    k = torch.randn(2, 32, generator=g).bfloat16()
    lw, lb = torch.ones(32, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.bfloat16)
    _audited(
        "ln_rope_write_index_k",
        lambda: ln_rope_write_index_k(
            ipool, slots, k, lw, lb, 1e-6, cos, sin, 16, True, kind, backend="triton"
        ),
    )


def test_indexer_and_topk_graph_safe():
    g = _gen()
    b, h, d, ctx = 2, 4, 32, 100
    pool = kvl.alloc_index_pool(4 * 64, d, "fp8_e4m3", torch.bfloat16, "cpu")
    kvl.write_index_k_ref(pool, torch.arange(4 * 64), torch.randn(4 * 64, d, generator=g), "fp8_e4m3")
    pt = torch.arange(4, dtype=torch.int32).view(b, 2)
    q = torch.randn(b, h, d, generator=g)
    w = torch.rand(b, h, generator=g)
    seq = torch.full((b,), ctx, dtype=torch.int32)
    q_seq = torch.arange(b, dtype=torch.int32)
    pos = torch.full((b,), ctx - 1, dtype=torch.int64)
    logits = []
    # max_len is passed (the host knows it); without it the wrapper must read seq_lens.max() (a sync)
    _audited(
        "indexer_logits_paged",
        lambda: logits.append(
            indexer_logits_paged(q, w, pool, pt, seq, q_seq, pos, "fp8_e4m3", ctx, backend="triton")
        ),
    )
    _audited("topk_indices", lambda: topk_indices(logits[0], 16, pos + 1, backend="triton"))


@pytest.mark.parametrize("tq", [1, 3])
def test_sparse_mla_graph_safe(tq):
    g = _gen()
    L, R, H, n = 64, 16, 4, 80
    pool = kvl.alloc_mla_pool(n, L, R, "fp8_e4m3", torch.bfloat16, "cpu")
    kvl.write_mla_kv_ref(
        pool, torch.arange(n), torch.randn(n, L, generator=g), torch.randn(n, R, generator=g), "fp8_e4m3"
    )
    ql = torch.randn(tq, H, L, generator=g).bfloat16()
    qr = torch.randn(tq, H, R, generator=g).bfloat16()
    idx = torch.randint(0, n, (tq, 48), generator=g, dtype=torch.int32)
    idx[:, -5:] = -1
    _audited("sparse_mla", lambda: sparse_mla(ql, qr, pool, idx, 0.1, "fp8_e4m3", True, backend="triton"))


def test_moe_graph_safe():
    g = _gen()
    t, hd, inter, e, k = 2, 64, 32, 8, 2
    x = torch.randn(t, hd, generator=g)
    gate_w = torch.randn(e, hd, generator=g)
    bias = torch.randn(e, generator=g)
    ids_w = []
    _audited(
        "moe_router",
        lambda: ids_w.append(moe_router(x, gate_w, bias, k, 4, 2, True, 2.5, backend="triton")),
    )
    valid = torch.tensor([True, False])
    _audited(
        "moe_router + valid",
        lambda: moe_router(x, gate_w, bias, k, 4, 2, True, 2.5, valid=valid, backend="triton"),
    )
    ids, w = ids_w[0]
    _audited("moe_align", lambda: moe_align(ids, e, 16))
    wgu = torch.randn(e, 2 * inter, hd, generator=g) / 8
    wd = torch.randn(e, hd, inter, generator=g) / 8
    _audited("moe_experts", lambda: moe_experts(x, ids, w, wgu, wd, "silu", backend="triton"))  # decode path
    _audited(
        "moe_experts grouped", lambda: moe_experts(x, ids, w, wgu, wd, "silu", backend="triton", decode=False)
    )
    shared, resid = torch.randn(t, hd, generator=g), torch.randn(t, hd, generator=g)
    _audited(
        "moe_experts + shared + residual",
        lambda: moe_experts(x, ids, w, wgu, wd, "silu", shared=shared, residual=resid, backend="triton"),
    )
    pairs = torch.randn(t, k, hd, generator=g)
    _audited("moe_combine", lambda: moe_combine(pairs, ids.masked_fill(ids == 3, -1), e, shared, resid))
    q_gu, s_gu = quant_block_fp8_ref(wgu)
    q_d, s_d = quant_block_fp8_ref(wd)
    _audited(
        "moe_experts fp8",
        lambda: moe_experts(x.bfloat16(), ids, w, q_gu, q_d, "silu", s_gu, s_d, backend="triton"),
    )


@pytest.mark.parametrize("qa", [False, True])
def test_fp8_linear_graph_safe(qa):
    g = _gen()
    q, s = quant_block_fp8_ref(torch.randn(96, 384, generator=g))
    x = torch.randn(1, 384, generator=g)
    _audited(
        "fp8_block_linear", lambda: fp8_block_linear(x, q, s, quantize_act=qa, backend="triton", split_k=3)
    )
    _audited("act_quant", lambda: act_quant(x, backend="triton"))


@pytest.mark.parametrize("dot", [False, True])
def test_gemv_graph_safe(dot):
    g = _gen()
    q, s = quant_block_fp8_ref(torch.randn(96, 384, generator=g))
    x = torch.randn(2, 384, generator=g)
    cfg = GemvConfig(bn=32, bk=128, dot=dot, splits=3)  # split-K: the partials and their sum too
    _audited("gemv fp8", lambda: gemv(x, q, s, backend="triton", config=cfg))
    _audited("gemv", lambda: gemv(x, torch.randn(96, 384, generator=g), backend="triton", config=cfg))


def test_audit_catches_syncs_and_scalar_stores():
    """The audit itself: the patterns it must flag are flagged."""
    t = torch.zeros(4, dtype=torch.long)
    assert _audit(lambda: t.max().item())
    assert _audit(lambda: int(t.sum()))
    assert _audit(lambda: t.tolist())
    assert _audit(lambda: t.__setitem__(2, 0))  # the old moe_align `blocks[e] = 0`
    assert _audit(lambda: torch.tensor([1, 2]))
    assert _audit(lambda: torch.nonzero(t))
    assert not _audit(lambda: torch.where(t > 0, t, 3) + 1)
