"""FP8 (e4m3) block quantisation of 2-D weights, as DeepSeek-V3/V3.2 and GLM FP8 checkpoints store them.

Layout: a weight `w` [out, in] is stored as `w_fp8` (float8_e4m3fn, same shape) plus
`scale_inv` (float32, [ceil(out/bo), ceil(in/bi)]), one scale per (bo x bi) tile; the edge tiles
may be ragged. Dequantisation is DeepSeek's `weight_dequant`: w = w_fp8.float() * scale_inv of
the element's tile. ("scale_inv" because the activation-side kernels divide by it.)
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)


def _expand(scale: torch.Tensor, shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    # [ceil(M/bm), ceil(N/bn)] -> [M, N], each scale repeated over its tile.
    bm, bn = block
    return scale.repeat_interleave(bm, dim=0)[: shape[0]].repeat_interleave(bn, dim=1)[:, : shape[1]]


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight to float8_e4m3fn with one float32 scale per block.

    Each tile is scaled so its largest magnitude maps to 448 (all-zero tiles get scale 1).
    Returns `(w_fp8, scale_inv)` with `w ~= w_fp8.float() * scale_inv` tile-wise.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block wants a 2-D weight, got shape {tuple(w.shape)}")
    bm, bn = block
    m, n = w.shape
    gm, gn = -(-m // bm), -(-n // bn)
    wf = w.detach().float()
    padded = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=w.device)
    padded[:m, :n] = wf
    tiles = padded.view(gm, bm, gn, bn)  # [gm, bm, gn, bn]
    amax = tiles.abs().amax(dim=(1, 3))  # [gm, gn]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(gm * bm, gn * bn)[:m, :n].contiguous(), scale.contiguous()


def dequantize_fp8_block(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_fp8_block`: `w_fp8.float() * scale_inv` per tile, cast to `dtype`."""
    if w_fp8.dim() != 2:
        raise ValueError(f"dequantize_fp8_block wants a 2-D weight, got shape {tuple(w_fp8.shape)}")
    want = (-(-w_fp8.shape[0] // block[0]), -(-w_fp8.shape[1] // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not fit weight {tuple(w_fp8.shape)} "
            f"with block {tuple(block)}: expected {want}"
        )
    w = w_fp8.float() * _expand(scale_inv.float(), w_fp8.shape, block)
    return w.to(dtype)
