"""Zero-copy gather of scattered KV rows from registered host memory into device pool slots.

HiSparse keeps every token's KV in a host pool (an mmap'd /dev/shm file registered with
`cudaHostRegister`, or a torch pinned tensor) and a hot subset on the GPU. After the indexer picks
its top-k, the misses are copied host -> device by ONE kernel that dereferences the host memory
directly over PCIe, instead of one cudaMemcpy per row (which runs at ~5 GB/s for 64-token pages
against ~55 GB/s for one bulk copy).

How a kernel reads host memory: registered and cudaHostAlloc'd memory is mapped into the device
address space (on 64-bit Linux with UVA the device address is the host address itself, unless
`cudaDevAttrCanUseHostPointerForRegisteredMem` is 0). Triton's launcher resolves every pointer
argument with `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, tensor.data_ptr())`,
which returns that device alias for registered host memory (and fails with "cpu tensor?" for
unregistered memory), so passing the CPU tensor that views the registered region as a kernel
argument is all it takes; `pin_memory=True` tensors and `torch.cuda.cudart().cudaHostRegister`'d
ones both qualify (`tensor.is_pinned()` is True for both, which the wrapper checks).

Item model: item i copies `rows_per_item` consecutive rows starting at host row `src_rows[i]` to
device rows starting at `dst_rows[i]`. Token misses use rows_per_item=1; a whole 64-token page
is one item with rows_per_item=64 and `src_rows = page * 64`. Rows are bytes: any pool dtype
works, moved as the widest word (8, 4, 2 or 1 bytes) dividing the row size. Row ranges must be
in bounds (the kernel does not check) and destinations distinct.
"""

from __future__ import annotations

import contextlib

import torch

from .common import check, jit, next_pow2, tl, use_triton


def _word_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dt
    return torch.uint8


def copy_geometry(
    src: torch.Tensor, dst: torch.Tensor, rows_per_item: int = 1
) -> tuple[torch.dtype, int, int, int]:
    """The row-copy kernels' launch shape for rows of `src` -> `dst`: the widest word both pools'
    rows are aligned to, a row's width in words, words per tile and items per program (~2-8K words
    in flight per program: enough outstanding PCIe reads per SM without spilling)."""
    row_bytes = src.shape[1] * src.element_size()
    word = _word_dtype(row_bytes, src, dst)
    row_w = row_bytes // word.itemsize
    block_w = min(next_pow2(row_w * rows_per_item), 1024)
    return word, row_w, block_w, max(1, min(16, 2048 // block_w))


def _check(
    src_pool: torch.Tensor,
    src_rows: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_rows: torch.Tensor,
    rows_per_item: int,
) -> None:
    for name, p in (("source pool", src_pool), ("destination pool", dst_pool)):
        check(p.dim() == 2 and p.is_contiguous(), f"{name} must be a contiguous 2-D [rows, row] tensor")
    check(
        src_pool.dtype == dst_pool.dtype and src_pool.shape[1] == dst_pool.shape[1],
        "pools must share dtype and row width",
    )
    for name, r in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        check(r.dim() == 1 and r.dtype == torch.int64, f"{name} must be int64 [n]")
    check(src_rows.shape == dst_rows.shape, "src_rows and dst_rows must have the same length")
    check(isinstance(rows_per_item, int) and rows_per_item >= 1, "rows_per_item must be a positive int")


def _expand(rows: torch.Tensor, rows_per_item: int) -> torch.Tensor:
    if rows_per_item == 1:
        return rows
    return (rows[:, None] + torch.arange(rows_per_item, device=rows.device)).flatten()


def swap_in_gather_ref(
    host_pool: torch.Tensor,
    src_rows: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_rows: torch.Tensor,
    rows_per_item: int = 1,
) -> None:
    """Reference: index_select on the host, one bulk copy, index_put on the device."""
    _check(host_pool, src_rows, dst_pool, dst_rows, rows_per_item)
    rows = host_pool.index_select(0, _expand(src_rows, rows_per_item).to(host_pool.device))
    dst_pool[_expand(dst_rows, rows_per_item)] = rows.to(dst_pool.device, non_blocking=rows.is_pinned())


def swap_in_gather(
    host_pool: torch.Tensor,
    src_rows: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_rows: torch.Tensor,
    rows_per_item: int = 1,
    *,
    backend: str = "auto",
) -> None:
    """Copy n items of `rows_per_item` rows: host_pool[src_rows[i] + j] -> dst_pool[dst_rows[i] + j].

    host_pool: [num_rows, row] CPU tensor in registered / pinned memory (or a device tensor);
    dst_pool: [num_slots, row] on the device, same dtype and row width; src_rows, dst_rows: int64
    [n] on dst_pool's device. Runs on the current stream, asynchronously.
    """
    _check(host_pool, src_rows, dst_pool, dst_rows, rows_per_item)
    check(
        src_rows.device == dst_pool.device and dst_rows.device == dst_pool.device,
        "src_rows/dst_rows must be on dst_pool's device",
    )
    if not use_triton(backend, dst_pool.device):
        swap_in_gather_ref(host_pool, src_rows, dst_pool, dst_rows, rows_per_item)
        return
    if dst_pool.device.type == "cuda" and host_pool.device.type == "cpu":
        check(host_pool.is_pinned(), "host_pool must be pinned or cudaHostRegister'ed to be read by a kernel")
    _launch(host_pool, src_rows, dst_pool, dst_rows, rows_per_item)


def swap_out_scatter_ref(
    host_pool: torch.Tensor,
    host_rows: torch.Tensor,
    src_pool: torch.Tensor,
    src_rows: torch.Tensor,
    rows_per_item: int = 1,
) -> None:
    """Reference of `swap_out_scatter`."""
    _check(src_pool, src_rows, host_pool, host_rows, rows_per_item)
    rows = src_pool[_expand(src_rows, rows_per_item)].to(host_pool.device)
    host_pool[_expand(host_rows, rows_per_item).to(host_pool.device)] = rows


def swap_out_scatter(
    host_pool: torch.Tensor,
    host_rows: torch.Tensor,
    src_pool: torch.Tensor,
    src_rows: torch.Tensor,
    rows_per_item: int = 1,
    *,
    backend: str = "auto",
) -> None:
    """The reverse copy (device -> registered host), e.g. the D2H backup of freshly written KV:
    src_pool[src_rows[i] + j] -> host_pool[host_rows[i] + j]. Same layout rules as `swap_in_gather`.
    Asynchronous: synchronise the stream before the host reads the rows.
    """
    _check(src_pool, src_rows, host_pool, host_rows, rows_per_item)
    check(
        src_rows.device == src_pool.device and host_rows.device == src_pool.device,
        "src_rows/host_rows must be on src_pool's device",
    )
    if not use_triton(backend, src_pool.device):
        swap_out_scatter_ref(host_pool, host_rows, src_pool, src_rows, rows_per_item)
        return
    if src_pool.device.type == "cuda" and host_pool.device.type == "cpu":
        check(
            host_pool.is_pinned(), "host_pool must be pinned or cudaHostRegister'ed to be written by a kernel"
        )
    _launch(src_pool, src_rows, host_pool, host_rows, rows_per_item)


def _launch(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, rows_per_item: int
) -> None:
    n = src_rows.shape[0]
    if n == 0:
        return
    word, row_w, block_w, items = copy_geometry(src, dst, rows_per_item)
    item_w = row_w * rows_per_item
    grid = ((n + items - 1) // items,)
    kernel_dev = dst.device if dst.device.type == "cuda" else src.device
    with torch.cuda.device(kernel_dev) if kernel_dev.type == "cuda" else contextlib.nullcontext():
        _copy_rows_kernel[grid](
            src.view(torch.uint8).view(word), src_rows, dst.view(torch.uint8).view(word), dst_rows, n,
            ROW_W=row_w, ITEM_W=item_w, ITEMS=items, BLOCK_W=block_w, num_warps=4,
        )  # fmt: skip


@jit
def _copy_rows_kernel(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, n,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # ROW_W is constexpr so the compiler sees row * ROW_W's alignment and emits wide (up to
    # 16-byte) loads; ITEMS items per program keep many PCIe reads in flight at once.
    copy_items(
        src_ptr,
        src_rows_ptr,
        dst_ptr,
        dst_rows_ptr,
        tl.program_id(0) * ITEMS,
        n,
        ROW_W,
        ITEM_W,
        ITEMS,
        BLOCK_W,
    )


@jit
def copy_items(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, i0, n,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Items [i0, i0 + ITEMS) below n of the row lists: ITEM_W words from src row src_rows[i]
    (counted in ROW_W-word rows) to dst row dst_rows[i]. The body of every row-copy kernel (swap-in,
    backup, HiSparse's counted copies)."""
    it = i0 + tl.arange(0, ITEMS)
    im = it < n
    s = tl.load(src_rows_ptr + it, mask=im, other=0).to(tl.int64) * ROW_W
    d = tl.load(dst_rows_ptr + it, mask=im, other=0).to(tl.int64) * ROW_W
    for w0 in range(0, ITEM_W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = im[:, None] & (w < ITEM_W)[None, :]
        v = tl.load(src_ptr + s[:, None] + w[None, :], mask=m)
        tl.store(dst_ptr + d[:, None] + w[None, :], v, mask=m)
