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

Launch geometry (`CopyKnobs` -> `CopyGeometry`): a program copies tiles of [items, block_w] words
(one tl.load, then one tl.store: a thread has tile / threads words in flight, issued as 16-byte
loads where the row width and pool bases allow). By default a program takes `items` items and
loops over their words; `cut` first cuts every item into equal power-of-two pieces (a page into 41
pieces of 1 KB) that tile without a ragged end, `split` gives every (items, block_w column) tile
its own unit, and `persist` caps the grid at `persist` programs per SM that stride over the units.
ROW_KNOBS (rows_per_item == 1: HiSparse's token misses) and PAGE_KNOBS (whole pages) are the
defaults; LONGCTX_SWAP_ROWS / LONGCTX_SWAP_PAGES ("word=8,block=1024,tile=2048,items=16,warps=4,
persist=0,split=0,cut=0", any subset) override them for a process. `python -m bench.swap_sweep`
times the settings on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch

from .common import check, jit, knobs_spec, next_pow2, num_sms, parse_knobs, tl, use_triton


@dataclass(frozen=True)
class CopyKnobs:
    """How the row-copy kernels tile a copy (never what they copy). Counts are in words of the
    copy's word size, so the defaults (the geometry before the knobs existed) move 8-16 KB per tile
    for 8-byte words: ~2-8K words in flight per program, enough outstanding PCIe reads per SM
    without spilling."""

    word: int = 8  # widest word in bytes (8, 4, 2, 1); narrower where the row size or a pool base is
    block: int = 1024  # words of one item per tile, at most
    tile: int = 2048  # words per tile, at most: items = tile // block_w (>= 1, <= `items`)
    items: int = 16  # items per tile, at most
    warps: int = 4
    persist: int = 0  # 0: one program per unit; k: min(units, k * SMs) programs striding over them
    split: bool = False  # a unit is (items, one block_w column) instead of (items, all their words)
    cut: bool = False  # items -> equal pieces: the largest power of two <= block dividing them, if >= 32

    def __post_init__(self) -> None:
        check(self.word in (1, 2, 4, 8), f"swap knob word must be 1, 2, 4 or 8 bytes ({self})")
        pow2 = (self.block, self.tile, self.items, self.warps)
        check(
            all(v >= 1 and v & (v - 1) == 0 for v in pow2), f"block/tile/items/warps: powers of two ({self})"
        )
        check(self.warps <= 32 and self.persist >= 0, f"bad swap knobs ({self})")

    def spec(self) -> str:
        """The LONGCTX_SWAP_ROWS / _PAGES string of these knobs."""
        return knobs_spec(self)

    @classmethod
    def parse(cls, spec: str, base: CopyKnobs | None = None) -> CopyKnobs:
        """`base` (default: the defaults) with the fields named in "name=int,..." replaced."""
        return parse_knobs(cls, spec, base, "swap knob")  # type: ignore[no-any-return]

    def plain(self) -> CopyKnobs:
        """The tile knobs alone (no persist / split / cut): for kernels that grid the copy themselves."""
        return dataclasses.replace(self, persist=0, split=False, cut=False)


# Both keep the launch the copies had before the knobs existed. H200 sweep (bench/swap_sweep.py,
# bench/results/swap-sweep-h200.md; 1 GiB of scattered pages or rows from a 4 GiB registered pool):
# every page setting read at 0.907-0.916 of pinned H2D, this one 0.913, cut into 1 KB pieces 0.915
# (no gain worth a launch shape the device->host backup was never timed with); single 656-byte rows
# read at 0.43 whatever the setting. The env overrides the fields it names, for a process (the sweep
# prints each setting's full spec).
ROW_KNOBS = CopyKnobs.parse(os.environ.get("LONGCTX_SWAP_ROWS", ""))
PAGE_KNOBS = CopyKnobs.parse(os.environ.get("LONGCTX_SWAP_PAGES", ""))


@dataclass(frozen=True)
class CopyGeometry:
    """One copy's launch shape: the word dtype both pools are viewed as, a row's width in words, the
    `pieces` an item is cut into and a piece's width `item_w` (the kernels copy pieces: one per item
    unless cut), a tile's [items, block_w] (in pieces, words), `span_w` words per unit (block_w when
    split, else the piece), warps and `persist` (programs per SM; 0: one per unit)."""

    word: torch.dtype
    row_w: int
    item_w: int
    pieces: int
    block_w: int
    items: int
    span_w: int
    warps: int
    persist: int

    def units(self, n: int) -> int:
        """Units of a copy of n items: groups of `items` pieces times columns."""
        groups = (n * self.pieces + self.items - 1) // self.items
        return groups * ((self.item_w + self.span_w - 1) // self.span_w)

    def grid(self, n: int, device: torch.device, share: int = 1) -> int:
        """Programs for n items (`share` launches side by side, e.g. batch rows, split the SMs)."""
        u = self.units(n)
        if self.persist == 0:
            return u
        return max(1, min(u, (self.persist * num_sms(device) + share - 1) // share))


def _word_dtype(row_bytes: int, max_word: int, *tensors: torch.Tensor) -> torch.dtype:
    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if size <= max_word and row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dt
    return torch.uint8


def copy_geometry(
    src: torch.Tensor, dst: torch.Tensor, rows_per_item: int = 1, knobs: CopyKnobs | None = None
) -> CopyGeometry:
    """The row-copy kernels' launch shape for items of `rows_per_item` rows of `src` -> `dst` under
    `knobs` (default ROW_KNOBS for single rows, PAGE_KNOBS for more): the widest word (up to
    knobs.word) both pools' rows are aligned to, and the tile and grid from the knobs."""
    k = knobs or (ROW_KNOBS if rows_per_item == 1 else PAGE_KNOBS)
    row_bytes = src.shape[1] * src.element_size()
    word = _word_dtype(row_bytes, k.word, src, dst)
    row_w = row_bytes // word.itemsize
    item_w, pieces = row_w * rows_per_item, 1
    piece = min(item_w & -item_w, k.block)
    if k.cut and piece >= min(item_w, 32):  # a 656-byte row x 64 page: 41 pieces of 128 words (1 KB)
        item_w, pieces = piece, item_w // piece
    block_w = min(next_pow2(item_w), k.block)
    items = max(1, min(k.items, k.tile // block_w))
    span_w = block_w if k.split else item_w
    return CopyGeometry(word, row_w, item_w, pieces, block_w, items, span_w, k.warps, k.persist)


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
    knobs: CopyKnobs | None = None,
) -> None:
    """Copy n items of `rows_per_item` rows: host_pool[src_rows[i] + j] -> dst_pool[dst_rows[i] + j].

    host_pool: [num_rows, row] CPU tensor in registered / pinned memory (or a device tensor);
    dst_pool: [num_slots, row] on the device, same dtype and row width; src_rows, dst_rows: int64
    [n] on dst_pool's device. Runs on the current stream, asynchronously. `knobs`: the Triton
    launch geometry (default ROW_KNOBS / PAGE_KNOBS); every setting copies the same bytes.
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
    _launch(host_pool, src_rows, dst_pool, dst_rows, rows_per_item, knobs)


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
    knobs: CopyKnobs | None = None,
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
    _launch(src_pool, src_rows, host_pool, host_rows, rows_per_item, knobs)


def _launch(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    rows_per_item: int,
    knobs: CopyKnobs | None,
) -> None:
    n = src_rows.shape[0]
    if n == 0:
        return
    g = copy_geometry(src, dst, rows_per_item, knobs)
    kernel_dev = dst.device if dst.device.type == "cuda" else src.device
    with torch.cuda.device(kernel_dev) if kernel_dev.type == "cuda" else contextlib.nullcontext():
        _copy_rows_kernel[(g.grid(n, kernel_dev),)](
            src.view(torch.uint8).view(g.word), src_rows, dst.view(torch.uint8).view(g.word), dst_rows, n,
            ROW_W=g.row_w, ITEM_W=g.item_w, PIECES=g.pieces, SPAN_W=g.span_w, ITEMS=g.items,
            BLOCK_W=g.block_w, num_warps=g.warps,
        )  # fmt: skip


@jit
def _copy_rows_kernel(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, n,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, PIECES: tl.constexpr, SPAN_W: tl.constexpr,
    ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # ROW_W is constexpr so the compiler sees row * ROW_W's alignment and emits wide (up to
    # 16-byte) loads; ITEMS pieces per tile keep many PCIe reads in flight at once.
    copy_units(
        src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, tl.program_id(0), tl.num_programs(0), n,
        ROW_W, ITEM_W, PIECES, SPAN_W, ITEMS, BLOCK_W,
    )  # fmt: skip


@jit
def copy_units(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, u0, u_step, n,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, PIECES: tl.constexpr, SPAN_W: tl.constexpr,
    ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Units u0, u0 + u_step, ... of the copy of items [0, n), each cut into PIECES pieces of ITEM_W
    words (see `copy_span`): unit u is pieces [g * ITEMS, +ITEMS) x words [c * SPAN_W, +SPAN_W) of
    them, g = u // columns, c = u % columns, so programs side by side read neighbouring spans.
    `CopyGeometry.units` counts them."""
    N_COL: tl.constexpr = (ITEM_W + SPAN_W - 1) // SPAN_W
    for u in range(u0, tl.cdiv(n * PIECES, ITEMS) * N_COL, u_step):
        copy_span(
            src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, (u // N_COL) * ITEMS, n, (u % N_COL) * SPAN_W,
            ROW_W, ITEM_W, PIECES, SPAN_W, ITEMS, BLOCK_W,
        )  # fmt: skip


@jit
def copy_items(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, i0, n,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Items [i0, i0 + ITEMS) below n of the row lists: ITEM_W words from src row src_rows[i]
    (counted in ROW_W-word rows) to dst row dst_rows[i]. The body of every row-copy kernel (swap-in,
    backup, HiSparse's counted copies)."""
    copy_span(
        src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, i0, n, 0, ROW_W, ITEM_W, 1, ITEM_W, ITEMS, BLOCK_W
    )


@jit
def copy_span(
    src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, p0, n, c0,
    ROW_W: tl.constexpr, ITEM_W: tl.constexpr, PIECES: tl.constexpr, SPAN_W: tl.constexpr,
    ITEMS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Words [c0, c0 + SPAN_W) (those below ITEM_W) of pieces [p0, p0 + ITEMS) below n * PIECES;
    piece p is words [(p % PIECES) * ITEM_W, +ITEM_W) of item p // PIECES (src row src_rows[item],
    in ROW_W-word rows, to dst row dst_rows[item]). [ITEMS, BLOCK_W] tiles: all of a tile's loads
    are issued before its stores."""
    it = p0 + tl.arange(0, ITEMS)
    im = it < n * PIECES
    item = it // PIECES
    off = (it % PIECES).to(tl.int64) * ITEM_W
    s = tl.load(src_rows_ptr + item, mask=im, other=0).to(tl.int64) * ROW_W + off
    d = tl.load(dst_rows_ptr + item, mask=im, other=0).to(tl.int64) * ROW_W + off
    for w0 in range(0, SPAN_W, BLOCK_W):
        w = c0 + w0 + tl.arange(0, BLOCK_W)
        m = im[:, None] & (w < ITEM_W)[None, :]
        v = tl.load(src_ptr + s[:, None] + w[None, :], mask=m)
        tl.store(dst_ptr + d[:, None] + w[None, :], v, mask=m)
