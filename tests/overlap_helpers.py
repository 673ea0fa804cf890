"""A stand-in side stream for CPU tests of the layers' fork / join path (`longctx/model/overlap.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from longctx.model.overlap import SideStream


class InlineSide(SideStream):
    """A side stream that runs its blocks in place and is active without a capture, so the layers' fork /
    join path runs on CPU. It checks the shape of the calls: a fork is joined before the next one."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.joins = 0
        self.open = False

    def active(self) -> bool:
        return True

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        assert not self.open, "a fork before the last one was joined"
        self.forks += 1
        self.open = True
        yield

    def join(self) -> None:
        assert self.open, "a join without a fork"
        self.open = False
        self.joins += 1
