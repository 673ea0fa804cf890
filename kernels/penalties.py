"""Presence / frequency / repetition penalties over a batch of logit rows in one pass.

The sampler's last stage keeps, per penalised request, a slot in two device pools: the counts of the
tokens it has sampled so far (int32 [S, V]) and its prompt's token set (uint8 [S, V]). A row with slot
s >= 0 is penalised from its slot's pools; a row with slot -1 is copied as it is. Every row comes out in
float32, so the pass is also the copy the sampler draws from (the torch path's `.float().clone()` and
its ~15 small kernels over the penalised rows become one launch).

    penalise(x [R, V] float32 | bfloat16 | float16, slot [R] int32, counts [S, V] int32,
             prompt [S, V] uint8, rep [R], freq [R], pres [R] float32) -> [R, V] float32

Per penalised token, with c its count and seen = prompt or c > 0 (vLLM's order and rules):
    y = x / rep if x > 0 else x * rep     where seen and rep != 1 (else y = x)
    y = y - freq * c - pres * (c > 0)
The kernel rounds as torch's elementwise ops do (a correctly rounded quotient, no fused multiply-adds),
so it equals the reference bit for bit.
"""

from __future__ import annotations

import torch

from .common import check, jit, next_pow2, tl, use_triton

BLOCK = 2048


def penalise_ref(
    x: torch.Tensor,
    slot: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    rep: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
) -> torch.Tensor:
    """The torch form of `penalise`: the penalised rows gathered, penalised together and put back."""
    out = x.float().clone()
    at = torch.nonzero(slot >= 0)[:, 0]
    if not at.numel():
        return out
    s = slot.index_select(0, at).long()
    c = counts.index_select(0, s).float()
    rep, freq, pres = (v.index_select(0, at)[:, None] for v in (rep, freq, pres))
    sub = out.index_select(0, at)
    seen = (prompt.index_select(0, s) != 0) | (c > 0)
    hit = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen & (rep != 1.0), hit, sub)
    sub = sub - freq * c - pres * (c > 0).float()
    return out.index_copy_(0, at, sub)


@jit
def _penalise_kernel(
    lx_ptr,
    po_ptr,
    pslot_ptr,
    pcnt_ptr,
    pmask_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    V,
    sx,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < V
    xv = tl.load(lx_ptr + r * sx + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.load(pslot_ptr + r).to(tl.int64)
    if s >= 0:
        c = tl.load(pcnt_ptr + s * V + cols, mask=m, other=0).to(tl.float32)
        rep = tl.load(rep_ptr + r)
        freq = tl.load(freq_ptr + r)
        pres = tl.load(pres_ptr + r)
        if rep != 1.0:
            seen = (tl.load(pmask_ptr + s * V + cols, mask=m, other=0) != 0) | (c > 0)
            hit = tl.where(xv > 0, tl.math.div_rn(xv, rep), xv * rep)
            xv = tl.where(seen, hit, xv)
        xv = xv - freq * c  # (no fma: the launch turns fp fusion off, as torch's two kernels round twice)
        xv = xv - pres * tl.where(c > 0, 1.0, 0.0)
    tl.store(po_ptr + r * V + cols, xv, mask=m)


def penalise(
    x: torch.Tensor,
    slot: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    rep: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """`penalise_ref` in one launch: a program per (row, 2,048 columns)."""
    check(
        x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(1) == 1,
        f"penalise: x must be float [R, V] with unit column stride, got {x.dtype} {tuple(x.shape)}",
    )
    r, v = x.shape
    check(
        counts.dim() == 2 and counts.shape[1] == v and counts.dtype == torch.int32 and counts.is_contiguous(),
        f"penalise: counts must be contiguous int32 [S, {v}], got {counts.dtype} {tuple(counts.shape)}",
    )
    check(
        prompt.shape == counts.shape and prompt.dtype == torch.uint8 and prompt.is_contiguous(),
        f"penalise: prompt must be contiguous uint8 {tuple(counts.shape)}, got {prompt.dtype} {tuple(prompt.shape)}",
    )
    check(
        slot.shape == (r,) and slot.dtype == torch.int32,
        f"penalise: slot must be int32 [{r}], got {slot.dtype} {tuple(slot.shape)}",
    )
    for name, col in (("rep", rep), ("freq", freq), ("pres", pres)):
        check(
            col.shape == (r,) and col.dtype == torch.float32,
            f"penalise: {name} must be float32 [{r}], got {col.dtype} {tuple(col.shape)}",
        )
    check(
        all(t.device == x.device for t in (slot, counts, prompt, rep, freq, pres)),
        "penalise: every tensor must be on x's device",
    )
    if not use_triton(backend, x.device):
        return penalise_ref(x, slot, counts, prompt, rep, freq, pres)
    out = torch.empty(r, v, dtype=torch.float32, device=x.device)
    if not r or not v:
        return out
    block = min(BLOCK, next_pow2(v))
    _penalise_kernel[(r, -(-v // block))](
        x, out, slot.contiguous(), counts, prompt, rep.contiguous(), freq.contiguous(), pres.contiguous(), v,
        x.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
