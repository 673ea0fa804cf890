"""Results files as JSON lines, appended one row at a time so that an interrupted run keeps what it
finished and a rerun can resume from it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from longctx.errors import LongctxError


def read_rows(path: Path) -> list[dict]:
    """Rows (objects) of a JSONL file; a torn last line (a run killed mid-write) is ignored, as is any line
    that is no row: not JSON, not UTF-8 (a damaged file failed in the text decoder, a traceback), not an
    object."""
    if not path.exists():
        return []
    rows = []
    with path.open("rb") as f:
        for line in f:
            row = _row(line)
            if row is not None:
                rows.append(row)
    return rows


def _row(line: bytes) -> dict | None:
    """The row a JSONL line holds, or None for a line that holds none."""
    line = line.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except ValueError:  # (JSONDecodeError; UnicodeDecodeError: bytes that are not UTF-8)
        return None
    return row if isinstance(row, dict) else None


def has_rows(path: Path) -> bool:
    """Whether `read_rows(path)` would return any row, read only as far as the first one (a results file of
    a million rows is not parsed to learn it has one)."""
    if not path.exists():
        return False
    with path.open("rb") as f:  # (bytes: text mode would decode whole chunks past the row)
        return any(_row(line) is not None for line in f)


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


def settings_record(target: Path) -> Path:
    """The file beside a results file that records the settings its rows were written under."""
    return target.with_name(target.name + ".run.json")


# the settings as they take effect, from the settings as given (a record's or a run's): each key's value as the
# engine takes it (a flag left out: the model's own), for the keys it knows; the others as given
Effective = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def check_settings(target: Path, settings: dict[str, Any], effective: Effective | None = None) -> bool:
    """Whether a run under `settings` may append to `target`: True when its rows were written under the
    same ones (as their record says) or it has none; a LongctxError naming what differs when they were
    not, since a resumed run would mix rows of two models (or of two settings) in one file; False for rows
    without a record (written before records were kept), let through as unknown. Only the keys both
    hold are compared, so a record that names fewer settings still counts. With `effective`, a setting is
    compared as it takes effect (a flag equal to the model's own value is the flag left out, both ways), and
    one that differs is named with its values as given."""
    record = settings_record(target)
    if not has_rows(target):
        return True
    try:  # (a damaged record, not UTF-8 or not an object, is no record: it failed as a traceback)
        old = json.loads(record.read_bytes())
    except (FileNotFoundError, ValueError):  # (ValueError: JSONDecodeError, UnicodeDecodeError)
        return False
    if not isinstance(old, dict):
        return False
    now = json.loads(json.dumps(settings))  # (as the record holds them: tuples as lists)
    old_in_effect, now_in_effect = (_in_effect(s, effective) for s in (old, now))
    differ = [
        f"{k} {json.dumps(old[k])} (now {json.dumps(v)})"
        for k, v in now.items()
        if k in old and old_in_effect[k] != now_in_effect[k]
    ]
    if differ:
        raise LongctxError(
            f"{target} holds rows written with other settings: {', '.join(differ)}; give another --out "
            f"for this run (or remove {target} to start over)"
        )
    return True


def _in_effect(settings: dict[str, Any], effective: Effective | None) -> dict[str, Any]:
    """`settings` (as the record holds them) as they take effect: `effective`'s values, as JSON holds them,
    over those given."""
    if effective is None:
        return settings
    return {**settings, **json.loads(json.dumps(dict(effective(settings))))}


def claim_settings(
    target: Path, settings: dict[str, Any], command: str, effective: Effective | None = None
) -> None:
    """`check_settings`, then `record_settings`: what a run does under its lock before it appends to
    `target`. Rows without a record are resumed as this run's, said once on stderr (by `command`)."""
    if not check_settings(target, settings, effective):
        print(
            f"{command}: {target} does not record the model and settings its rows came from (written "
            "before records were kept); resuming it as this run's",
            file=sys.stderr,
        )
    record_settings(target, settings)


def record_settings(target: Path, settings: dict[str, Any]) -> None:
    """Record `settings` beside `target` (replaced whole: a run killed meanwhile leaves one record)."""
    write_whole(settings_record(target), json.dumps(settings, indent=2) + "\n")


def temp_file(path: Path) -> Path:
    """The file beside `path` that `write_whole` writes first."""
    return path.with_name(path.name + ".tmp")


def write_whole(path: Path, text: str) -> None:
    """Replace `path` with `text` through `temp_file(path)`, so a run killed meanwhile leaves the old file
    or the new one, never part of one."""
    tmp = temp_file(path)
    tmp.write_text(text)
    tmp.replace(path)
