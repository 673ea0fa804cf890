"""Single kernels of small-1m's 128K batch-1 decode step, each called a few times, for Nsight Compute to
read their counters (`ncu --clock-control none -k regex:NAME -s SKIP -c N python -m bench.ncu_decode --part
P`, SKIP the reference check's launches):

- `smla`: the sparse MLA heads kernel (64 heads, latent 512 + rope 64, top-2048 of an fp8 656-byte pool of
  --context tokens in random 64-token pages, q's rope rotated in the prologue) and its combine;
- `smla_uv`: the same attention as decode runs it at batch 1: its splits merged inside W_UV's per-head
  GEMV (`sparse_mla(out_proj=)`, `kernels.gemv.merge_head_gemv`; W_UV [64, 256, 512]);
- `topk`: the radix top-2048 of one --context-key row (histogram, count and write passes);
- `wuk`: the absorbed query q_nope [1, 64, 192] x W_UK (stored [64, 512, 192]): torch's batched GEMM, then
  `kernels.gemv.head_gemv` (`MLAttention` at decode);
- `router`: the MoE router's logits, select and align (16 experts, top-4, hidden 2048).

Every part first checks its kernel against the torch reference on the GPU, then calls it --calls times
(the first call compiles: skip it). `--device cpu` runs the same calls at toy sizes under the interpreter.

    python -m bench.ncu_decode --part smla [--context 131072] [--calls 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("smla", "smla_uv", "topk", "wuk", "router")


def _smla(dev: torch.device, context: int, calls: int, topk: int, uv: bool = False) -> None:
    from longctx.kernels.gemv import head_gemv_ref
    from longctx.kernels.kv_layout import alloc_mla_pool, write_mla_kv
    from longctx.kernels.rope import apply_rope, rope_cos_sin_ref
    from longctx.kernels.sparse_mla import sparse_mla, sparse_mla_ref

    heads, lat, rope, page = (64, 512, 64, 64) if dev.type == "cuda" else (16, 64, 16, 16)
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = alloc_mla_pool(context, lat, rope, "fp8_e4m3", torch.bfloat16, dev)
    write_mla_kv(
        pool, torch.arange(context, device=dev), torch.randn(context, lat, device=dev, generator=gen),
        torch.randn(context, rope, device=dev, generator=gen), "fp8_e4m3",
    )  # fmt: skip
    pages = torch.randperm(context // page, device=dev, generator=gen)
    pos = torch.randperm(context, device=dev, generator=gen)[:topk]
    idx = (pages[pos // page] * page + pos % page).to(torch.int32).view(1, topk)
    q_lat = torch.randn(1, heads, lat, device=dev, dtype=torch.bfloat16, generator=gen)
    q_pe = torch.randn(1, heads, rope, device=dev, dtype=torch.bfloat16, generator=gen)
    inv_freq = 1e6 ** (-torch.arange(0, rope, 2, device=dev).float() / rope)
    cos, sin = rope_cos_sin_ref(torch.tensor([context - 1], device=dev), inv_freq, 1.0, torch.bfloat16)
    scale = (192 + 64) ** -0.5
    w_uv = None
    if uv:  # MLAttention.w_uv [H, v_head, L]
        w_uv = torch.randn(heads, lat // 2, lat, device=dev, dtype=torch.bfloat16, generator=gen) * lat**-0.5

    def call() -> torch.Tensor:
        rot = (cos, sin, True)
        out = sparse_mla(
            q_lat, q_pe, pool, idx, scale, "fp8_e4m3", rotate=rot, backend="triton", out_proj=w_uv
        )
        assert isinstance(out, torch.Tensor)
        return out

    ref = sparse_mla_ref(q_lat, apply_rope(q_pe, cos, sin, backend="torch"), pool, idx, scale, "fp8_e4m3")
    assert isinstance(ref, torch.Tensor)
    if w_uv is not None:
        ref = head_gemv_ref(ref, w_uv)
    err = (call().float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    print(f"smla rel err {err:.3g}")
    assert err < 2e-2
    for _ in range(calls):
        call()


def _topk(dev: torch.device, context: int, calls: int, k: int) -> None:
    from longctx.kernels.topk import topk_indices, topk_indices_ref

    gen = torch.Generator(device=dev).manual_seed(1)
    logits = torch.randn(1, context, device=dev, generator=gen)
    vl = torch.tensor([context], device=dev, dtype=torch.int32)
    got = topk_indices(logits, k, vl, backend="triton")
    assert torch.equal(got, topk_indices_ref(logits, k, vl)), "topk differs from its reference"
    print("topk equal to the reference")
    for _ in range(calls):
        topk_indices(logits, k, vl, backend="triton")


def _wuk(dev: torch.device, calls: int) -> None:
    from longctx.kernels.gemv import head_gemv

    heads, nope, lat = (64, 192, 512) if dev.type == "cuda" else (4, 16, 32)
    gen = torch.Generator(device=dev).manual_seed(2)
    q = torch.randn(1, heads, nope, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(heads, lat, nope, device=dev, dtype=torch.bfloat16, generator=gen)  # MLAttention.w_uk
    ref = torch.einsum("thd,hld->thl", q.float(), w.float())
    err = (head_gemv(q, w, backend="triton").float() - ref).abs().max().item() / ref.abs().max().item()
    print(f"head_gemv rel err {err:.3g}")
    assert err < 1e-2
    for _ in range(calls):
        torch.einsum("thd,hld->thl", q, w)  # torch's batched GEMM (LONGCTX_HEAD_GEMV_MAX_T=0)
        head_gemv(q, w, backend="triton")


def _router(dev: torch.device, calls: int) -> None:
    from longctx.kernels.moe import moe_align, moe_router, moe_router_ref

    gen = torch.Generator(device=dev).manual_seed(3)
    hd = 2048 if dev.type == "cuda" else 64
    x = torch.randn(1, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(16, hd, device=dev, dtype=torch.bfloat16, generator=gen)
    bias = torch.zeros(16, device=dev)
    args = (x, w, bias, 4, 1, 1, True, 2.5)
    ids, _ = moe_router(*args, backend="triton")
    want, _ = moe_router_ref(*args)
    assert torch.equal(ids.sort(dim=1).values, want.sort(dim=1).values), "router ids differ"
    print("router ids equal to the reference")
    for _ in range(calls):
        ids, _ = moe_router(*args, backend="triton")
        moe_align(ids, 16, 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=PARTS, required=True)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    topk = 2048 if dev.type == "cuda" else 64
    if a.part in ("smla", "smla_uv"):
        _smla(dev, a.context, a.calls, topk, uv=a.part == "smla_uv")
    elif a.part == "topk":
        _topk(dev, a.context, a.calls, topk)
    elif a.part == "wuk":
        _wuk(dev, a.calls)
    else:
        _router(dev, a.calls)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
