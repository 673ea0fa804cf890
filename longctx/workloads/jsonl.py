"""Results files as JSON lines, appended one row at a time so that an interrupted run keeps what it
finished and a rerun can resume from it."""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from longctx.errors import LongctxError


def read_rows(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a run killed mid-write) is ignored."""
    if not path.exists():
        return []
    rows = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def open_append(path: Path) -> TextIO:
    """Open a JSONL file for appending, first ending a torn last line so new rows stay whole."""
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        if torn:
            with path.open("a") as f:
                f.write("\n")
    return path.open("a")


@contextlib.contextmanager
def sole_writer(lock: Path, target: Path) -> Iterator[None]:
    """Hold the lock file `lock` while a run appends to `target`: two runs into one results file would
    both run everything neither had found done, and write it twice (the kernel drops the lock when the
    process ends, however it ends)."""
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LongctxError(
                f"another run is writing {target}; wait for it or give another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
