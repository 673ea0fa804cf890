"""Swap-in with a device-side item count: HiSparse knows how many rows missed only on the device.

`longctx.kernels.swap.swap_in_gather` takes a host-side item count; passing the padded item list
instead would copy every padding item over PCIe, and reading the count with `.item()` would stall
the host once per layer. `swap_in_counted` launches a grid for the padded list and lets programs
past the device count return at once, so the decode hot path never waits for the GPU (and can be
captured in a CUDA graph). The Triton kernel also runs on CPU under the interpreter
(`TRITON_INTERPRET=1`), which is how CI checks that path; with the torch backend it reads the count
and calls `swap_in_gather`'s reference, which is exact.
"""

from __future__ import annotations

import contextlib

import torch

from longctx.kernels.common import check, jit, tl, triton_interpret
from longctx.kernels.swap import CopyGeometry, CopyKnobs, copy_geometry, copy_units, swap_in_gather


def _copy_geometry(host_pool: torch.Tensor, dst_pool: torch.Tensor, knobs: CopyKnobs | None) -> CopyGeometry:
    """Checks both pools and returns the row-copy launch shape (`kernels.swap.copy_geometry`)."""
    check(
        host_pool.device == dst_pool.device or host_pool.is_pinned(),
        "host_pool must be registered/pinned host memory or on dst_pool's device",
    )
    check(host_pool.shape[1] == dst_pool.shape[1] and host_pool.dtype == dst_pool.dtype, "pools differ")
    return copy_geometry(host_pool, dst_pool, 1, knobs)


def swap_in_counted(
    host_pool: torch.Tensor,
    src_rows: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_rows: torch.Tensor,
    count: torch.Tensor,
    use_triton: bool,
    knobs: CopyKnobs | None = None,
) -> None:
    """host_pool[src_rows[i]] -> dst_pool[dst_rows[i]] for i < count (one row per item).

    host_pool: [num_rows, row] in registered / pinned host memory, or a tensor on dst_pool's device
    (on CUDA: a device alias of registered host memory); dst_pool: [num_slots, row] on the device; src_rows, dst_rows: int64 [n] on dst_pool's device; count:
    int64 0-d tensor on dst_pool's device, 0 <= count <= n. Asynchronous on CUDA. `knobs`: the
    launch geometry (default `kernels.swap.ROW_KNOBS`).
    """
    check(count.dim() == 0 and count.dtype == torch.int64, "count must be a 0-d int64 tensor")
    n = src_rows.shape[0]
    if n == 0:
        return
    if not (use_triton and (dst_pool.device.type == "cuda" or triton_interpret())):
        k = int(count)
        backend = "triton" if use_triton else "torch"
        swap_in_gather(host_pool, src_rows[:k], dst_pool, dst_rows[:k], backend=backend, knobs=knobs)
        return
    g = _copy_geometry(host_pool, dst_pool, knobs)
    with torch.cuda.device(dst_pool.device) if dst_pool.is_cuda else contextlib.nullcontext():
        _copy_rows_counted_kernel[(g.grid(n, dst_pool.device),)](
            host_pool.view(torch.uint8).view(g.word), src_rows, dst_pool.view(torch.uint8).view(g.word),
            dst_rows, count, ROW_W=g.row_w, ITEM_W=g.item_w, PIECES=g.pieces, SPAN_W=g.span_w,
            ITEMS=g.items, BLOCK_W=g.block_w, num_warps=g.warps,
        )  # fmt: skip


@jit
def _copy_rows_counted_kernel(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, count_ptr,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, PIECES: tl.constexpr, SPAN_W: tl.constexpr,
    ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # The same copy as kernels/swap.py's _copy_rows_kernel, with the item count read on the device
    # (programs past it have no unit and return at once).
    copy_units(
        src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, tl.program_id(0), tl.num_programs(0),
        tl.load(count_ptr), ROW_W, ITEM_W, PIECES, SPAN_W, ITEMS, BLOCK_W,
    )  # fmt: skip


def swap_in_rows_counted(
    host_pool: torch.Tensor,
    src_rows: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_rows: torch.Tensor,
    counts: torch.Tensor,
    use_triton: bool,
    knobs: CopyKnobs | None = None,
) -> None:
    """Per batch row b: host_pool[src_rows[b, i]] -> dst_pool[dst_rows[b, i]] for i < counts[b].

    The copy lists `lru_place` compacts per (row, layer) (one layer's column of them): src_rows,
    dst_rows int64 [B, M] with unit stride along M, counts int64 [B], all on dst_pool's device.
    Pools as in `swap_in_counted`. One launch over [B, M] whose programs past their row's count
    return at once; nothing is read back on the host (on the Triton path). Asynchronous on CUDA.
    """
    check(src_rows.dim() == 2 and src_rows.shape == dst_rows.shape, "src_rows / dst_rows: [B, M]")
    check(src_rows.stride(1) == 1 and dst_rows.stride(1) == 1, "rows must be contiguous along M")
    check(counts.shape == (src_rows.shape[0],) and counts.dtype == torch.int64, "counts: int64 [B]")
    B, n = src_rows.shape
    if B == 0 or n == 0:
        return
    if not (use_triton and (dst_pool.device.type == "cuda" or triton_interpret())):
        m = torch.arange(n, device=counts.device) < counts[:, None]
        backend = "triton" if use_triton else "torch"
        swap_in_gather(host_pool, src_rows[m], dst_pool, dst_rows[m], backend=backend, knobs=knobs)
        return
    g = _copy_geometry(host_pool, dst_pool, knobs)
    with torch.cuda.device(dst_pool.device) if dst_pool.is_cuda else contextlib.nullcontext():
        _copy_rows_counted_2d_kernel[(g.grid(n, dst_pool.device, share=B), B)](
            host_pool.view(torch.uint8).view(g.word), src_rows, src_rows.stride(0),
            dst_pool.view(torch.uint8).view(g.word), dst_rows, dst_rows.stride(0), counts, counts.stride(0),
            ROW_W=g.row_w, ITEM_W=g.item_w, PIECES=g.pieces, SPAN_W=g.span_w, ITEMS=g.items,
            BLOCK_W=g.block_w, num_warps=g.warps,
        )  # fmt: skip


@jit
def _copy_rows_counted_2d_kernel(
    src_ptr, src_rows_ptr, stride_s, dst_ptr, dst_rows_ptr, stride_d, count_ptr, stride_c,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, PIECES: tl.constexpr, SPAN_W: tl.constexpr,
    ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # _copy_rows_counted_kernel with one item list and count per batch row (grid axis 1).
    b = tl.program_id(1).to(tl.int64)
    copy_units(
        src_ptr, src_rows_ptr + b * stride_s, dst_ptr, dst_rows_ptr + b * stride_d, tl.program_id(0),
        tl.num_programs(0), tl.load(count_ptr + b * stride_c), ROW_W, ITEM_W, PIECES, SPAN_W, ITEMS, BLOCK_W,
    )  # fmt: skip
