"""Where a command will write: the output paths it was given, before anything is created."""

from __future__ import annotations

from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """`path` if it exists, else its nearest existing ancestor (made absolute: a relative path's `.` would
    name no place in a message), which may be a file. Commands create the missing directories in between,
    so this is where to ask whether `path` can be written and how much room it has."""
    return next(p for p in (path, *path.absolute().parents) if p.exists())
