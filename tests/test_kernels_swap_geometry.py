"""The row-copy kernels' launch knobs (kernels/swap.CopyKnobs): every setting copies exactly the
reference's bytes (Triton interpreter vs torch), for pages, single rows, row sizes the 8-byte word
does not divide, empty lists and the device-counted copies."""

from __future__ import annotations

import os

import pytest
import torch
from longctx.kernels.common import KernelInputError
from longctx.kernels.swap import (
    PAGE_KNOBS,
    ROW_KNOBS,
    CopyKnobs,
    copy_geometry,
    swap_in_gather,
    swap_in_gather_ref,
    swap_out_scatter,
    swap_out_scatter_ref,
)

from . import conftest_kernels  # noqa: F401  (sets TRITON_INTERPRET before triton kernels are built)

# Each knob away from its default at least once; on CPU num_sms is 4, so persist=k runs 4k programs
# that stride over more units than that.
SETTINGS = [
    CopyKnobs(),
    CopyKnobs(word=4, block=2048, tile=4096),
    CopyKnobs(word=2, block=64, tile=256, items=2),
    CopyKnobs(word=1, block=4096, tile=4096, warps=8),
    CopyKnobs(block=16, tile=64, items=4, warps=1),  # tiles narrower than a row
    CopyKnobs(items=1, tile=1024, persist=1),
    CopyKnobs(block=256, tile=1024, split=True),
    CopyKnobs(word=4, block=512, tile=512, items=1, warps=8, persist=2, split=True),
    CopyKnobs(cut=True),  # 656 x 16-byte items -> 41 pieces of 32 words
    CopyKnobs(word=4, block=64, tile=256, items=8, cut=True, persist=1),
    CopyKnobs(block=32, tile=64, cut=True, split=True),
]
IDS = [k.spec() for k in SETTINGS]

# (row bytes, rows per item): the 656-byte fp8 MLA row and pages of it (cut: 41 pieces), rows of
# 4-byte words (99 a item: never cut) and of bytes, and 160 x 8 (cut: 5 pieces)
CASES = [(656, 1), (656, 16), (132, 3), (52, 1), (7, 2), (160, 8)]


def _case(row_bytes: int, rpi: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (48 * rpi, row_bytes), dtype=torch.uint8, generator=g)
    n = 11
    src = torch.randperm(48, generator=g)[:n] * rpi + int(rpi > 1)  # runs off the page grid too
    src = src.clamp(max=47 * rpi)
    dst = torch.randperm(24, generator=g)[:n] * rpi
    return host, src, dst, torch.zeros(24 * rpi, row_bytes, dtype=torch.uint8)


@pytest.mark.parametrize("knobs", SETTINGS, ids=IDS)
def test_every_setting_copies_the_reference_bytes(knobs: CopyKnobs) -> None:
    for row_bytes, rpi in CASES:
        host, src, dst, dev = _case(row_bytes, rpi, row_bytes + rpi)
        a, b = dev.clone(), dev.clone()
        swap_in_gather(host, src, a, dst, rpi, backend="triton", knobs=knobs)
        swap_in_gather_ref(host, src, b, dst, rpi)
        assert torch.equal(a, b), (row_bytes, rpi)
        for i in range(src.shape[0]):
            s, d = int(src[i]), int(dst[i])
            assert torch.equal(a[d : d + rpi], host[s : s + rpi])
        swap_in_gather(host, src[:0], a, dst[:0], rpi, backend="triton", knobs=knobs)  # no-op
        assert torch.equal(a, b)
        h1, h2 = torch.zeros_like(host), torch.zeros_like(host)
        swap_out_scatter(h1, src, a, dst, rpi, backend="triton", knobs=knobs)
        swap_out_scatter_ref(h2, src, a, dst, rpi)
        assert torch.equal(h1, h2), (row_bytes, rpi)


@pytest.mark.parametrize("knobs", [SETTINGS[i] for i in (0, 2, 5, 7, 9)], ids=lambda k: k.spec())
def test_counted_copies_under_every_kind_of_setting(knobs: CopyKnobs) -> None:
    """The device-counted copies (one list; one list per batch row, strided) copy exactly count
    items whatever the grid: programs past the count, and persistent programs, copy nothing more."""
    from longctx.hisparse.gather import swap_in_counted, swap_in_rows_counted

    g = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (90, 656), dtype=torch.uint8, generator=g)
    src = torch.randint(0, 90, (3, 2, 21), generator=g)  # [B, layers, M]: rows of stride 42
    dst = torch.randperm(3 * 2 * 21, generator=g).view(3, 2, 21)
    counts = torch.tensor([[5, 0], [21, 3], [0, 17]])
    for k in range(2):
        a = torch.zeros(126, 656, dtype=torch.uint8)
        swap_in_rows_counted(host, src[:, k], a, dst[:, k], counts[:, k], True, knobs=knobs)
        want = torch.zeros_like(a)
        for r in range(3):
            n = int(counts[r, k])
            want[dst[r, k, :n]] = host[src[r, k, :n]]
        assert torch.equal(a, want)
    for c in (0, 1, 13, 21):
        a, want = torch.zeros(126, 656, dtype=torch.uint8), torch.zeros(126, 656, dtype=torch.uint8)
        swap_in_counted(host, src[1, 0], a, dst[1, 0], torch.tensor(c), True, knobs=knobs)
        want[dst[1, 0, :c]] = host[src[1, 0, :c]]
        assert torch.equal(a, want), c


def test_default_knobs_are_the_old_geometry() -> None:
    """Unset LONGCTX_SWAP_*: 656-byte rows as int64, pages in [2, 1024]-word tiles looping over the
    page, rows in [16, 128] tiles, 4 warps, one program per unit (the launch before the knobs)."""
    pool = torch.empty(64, 656, dtype=torch.uint8)
    page, row = copy_geometry(pool, pool, 64, CopyKnobs()), copy_geometry(pool, pool, 1, CopyKnobs())
    assert (page.word, page.row_w, page.block_w, page.items, page.span_w) == (torch.int64, 82, 1024, 2, 5248)
    row_shape = (row.word, row.block_w, row.items, row.span_w, row.warps, row.persist)
    assert row_shape == (torch.int64, 128, 16, 82, 4, 0)
    assert page.grid(2048, torch.device("cpu")) == 1024 and row.units(2048) == 128
    odd = torch.empty(64, 132, dtype=torch.uint8)  # 132-byte rows: 4-byte words
    assert copy_geometry(odd, odd, 1, CopyKnobs(word=8)).word == torch.int32
    split = copy_geometry(pool, pool, 64, CopyKnobs(split=True, persist=2))
    assert split.units(7) == 4 * 6 and split.grid(7, torch.device("cpu")) == 8  # 2 per (CPU) SM
    cut = copy_geometry(pool, pool, 64, CopyKnobs(cut=True))  # 41 pieces of 1 KB, 16 a tile
    assert (cut.pieces, cut.item_w, cut.block_w, cut.items, cut.units(10)) == (41, 128, 128, 16, 26)
    assert copy_geometry(odd, odd, 3, CopyKnobs(cut=True)).pieces == 1  # 99 words: no piece >= 32
    if not (os.environ.get("LONGCTX_SWAP_ROWS") or os.environ.get("LONGCTX_SWAP_PAGES")):
        assert (CopyKnobs(), CopyKnobs()) == (ROW_KNOBS, PAGE_KNOBS)  # the H200 sweep found no better one


def test_knob_specs_round_trip_and_bad_ones_are_refused() -> None:
    for k in SETTINGS:
        assert CopyKnobs.parse(k.spec()) == k
    want = CopyKnobs(items=2, persist=4, split=True)
    assert CopyKnobs.parse("persist=4, split=1", CopyKnobs(items=2)) == want
    assert CopyKnobs.parse("") == CopyKnobs()
    for bad in ("word=3", "block=1000", "warps=0", "persist=-1", "rows=2", "items", "tile=x"):
        with pytest.raises(KernelInputError):
            CopyKnobs.parse(bad)
