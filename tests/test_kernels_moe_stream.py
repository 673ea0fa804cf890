"""kernels/moe_stream (the persistent fp8 weight stream of the routed experts) vs `moe_experts_ref`
under the Triton interpreter, on fresh random inputs. Tolerance as test_kernels_mla_moe's bf16 one:
2e-2 * max|ref| + 1e-2 (the "fp16" form differs from the reference only in summation order and the
bf16 rounding of the intermediate; the "fp8" form's two-term e4m3 split of x keeps ~8 significant
bits, bf16's precision)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch
from longctx.kernels.common import KernelInputError
from longctx.kernels.fp8_gemm import quant_block_fp8_ref
from longctx.kernels.moe import moe_experts, moe_experts_ref
from longctx.kernels.moe_stream import BM, StreamConfig, experts_stream, parse_config, pick_splits, supports


def _fp8_experts(e: int, hd: int, inter: int, gen: torch.Generator):
    (wgu, sgu) = quant_block_fp8_ref(torch.randn(e, 2 * inter, hd, generator=gen) / math.sqrt(hd))
    (wd, sd) = quant_block_fp8_ref(torch.randn(e, hd, inter, generator=gen) / math.sqrt(inter))
    return wgu, wd, sgu, sd


def _ids(t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token (a router never picks one twice), expert 0 in every token (shared by
    all of them), one ignored slot (-1) and one id >= E when t > 1."""
    ids = torch.stack(
        [
            torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(e - 1, generator=gen)[: k - 1]])
            for _ in range(t)
        ]
    )
    if t > 1:
        ids[-1, -1] = -1
        ids[1, 1] = e + 3
    return ids


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    out, ref = out.float(), ref.float()
    tol = 2e-2 * ref.abs().max().item() + 1e-2
    err = (out - ref).abs().max().item()
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize(
    "t,k,hd,inter,xdtype,cfg",
    [
        (1, 8, 384, 128, torch.bfloat16, StreamConfig()),  # batch 1: every expert one pair
        (1, 4, 384, 384, torch.bfloat16, StreamConfig(mma="fp8", bn_gate_up=128, bn_down=32)),
        (3, 4, 128, 384, torch.float32, StreamConfig(programs_per_sm=0, splits_down=2)),
        (3, 4, 384, 128, torch.bfloat16, StreamConfig(mma="fp8", programs_per_sm=1)),
        (8, 8, 384, 384, torch.bfloat16, StreamConfig(bn_gate_up=32, bn_down=128, splits_down=3)),
        (8, 4, 128, 384, torch.bfloat16, StreamConfig(mma="fp8", bn_gate_up=16, bn_down=16)),
    ],
)
def test_moe_stream_matches_ref(t, k, hd, inter, xdtype, cfg):
    gen = torch.Generator().manual_seed(t * 100 + k + hd + inter)
    e = 10
    wgu, wd, sgu, sd = _fp8_experts(e, hd, inter, gen)
    x = torch.randn(t, hd, generator=gen).to(xdtype)
    ids = _ids(t, k, e, gen)
    w = torch.rand(t, k, generator=gen)
    shared = torch.randn(t, hd, generator=gen).to(xdtype)
    y = moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, shared=shared, backend="triton", stream=cfg)
    assert y.dtype == xdtype and y.shape == (t, hd)
    _close(y, moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd, shared=shared), f"stream {cfg}")


def test_moe_stream_expert_over_one_group_and_dispatch(monkeypatch):
    """An expert with more pairs than one program serves (BM) gets several leaders; the default
    dispatch takes the stream path only up to STREAM_MAX_PAIRS pairs and only for fp8 on 128-blocks."""
    from longctx.kernels import moe as moe_mod

    gen = torch.Generator().manual_seed(7)
    t, k, e, hd, inter = BM + 3, 2, 4, 128, 128
    wgu, wd, sgu, sd = _fp8_experts(e, hd, inter, gen)
    x = torch.randn(t, hd, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.zeros(t, dtype=torch.long), torch.randint(1, e, (t,), generator=gen)], dim=1)
    w = torch.rand(t, k, generator=gen)
    ref = moe_experts_ref(x, ids, w, wgu, wd, "silu", sgu, sd)
    calls = []

    def spy(*a, **kw):
        calls.append(1)
        return experts_stream(*a, **kw)

    monkeypatch.setattr(moe_mod, "experts_stream", spy)
    monkeypatch.setattr(moe_mod, "STREAM_MAX_PAIRS", t * k)
    _close(moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend="triton"), ref, "stream")
    assert calls == [1]
    monkeypatch.setattr(moe_mod, "STREAM_MAX_PAIRS", t * k - 1)
    _close(moe_experts(x, ids, w, wgu, wd, "silu", sgu, sd, backend="triton"), ref, "grouped")
    assert calls == [1]


def test_moe_stream_rejects_and_knobs():
    assert supports(6144, 2048, True) and not supports(6144, 2048, False) and not supports(200, 128, True)
    gen = torch.Generator().manual_seed(1)
    wgu, wd, sgu, sd = _fp8_experts(3, 128, 128, gen)
    x = torch.randn(1, 128, generator=gen)
    ids, w = torch.tensor([[0, 2]]), torch.rand(1, 2, generator=gen)
    with pytest.raises(KernelInputError):
        experts_stream(x, ids, w, wgu, wd, sgu, sd, StreamConfig(bn_down=48))
    with pytest.raises(KernelInputError):
        experts_stream(x, ids, w, wgu, wd, sgu[:, :1].contiguous(), sd)
    with pytest.raises(KernelInputError):
        experts_stream(x, ids, w, wgu.float(), wd, sgu, sd)
    cfg = parse_config("mma=fp8,splits_down=none,bn_down=32", StreamConfig(splits_down=4))
    assert cfg == StreamConfig(mma="fp8", bn_down=32)
    with pytest.raises(KernelInputError):
        parse_config("mma=int4", StreamConfig())
    # batch 1 at GLM-5.3: 8 experts x 96 row tiles already give 264 programs ~3 tiles each
    assert pick_splits(8, 96, 2048, 264) == 1 and pick_splits(8, 6, 2048, 264) == 11
    assert pick_splits(1, 1, 256, 1000) == 2
