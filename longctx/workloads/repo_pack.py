"""Pack a repository into one prompt: every text file with a header and numbered lines.

Layout (byte-cheap, since the default tokenizer spends one token per byte):

    Repository <name>. Each file starts with a line "=== <path> (lines 1-<n>) ===" and each of
    its lines is prefixed with its line number and "| ".

    === src/app.py (lines 1-3) ===
    1|     2| ...

Files come in path order. Skipped, with the reason reported: binaries (a NUL byte), non-UTF-8
text, files over `max_file_bytes`, symlinks, what is not a regular file (a FIFO, a socket, a
device), unreadable files, and — once the token budget is
spent — every file after the first that does not fit ("context full"). Ignored files (by git or
.gitignore) are not listed, only counted when that is cheap; nor are the files a caller excludes
(its own output).
"""

from __future__ import annotations

import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from longctx.workloads.gitignore import list_files
from longctx.workloads.tokens import TokenCounter


@dataclass(frozen=True)
class PackedFile:
    path: str
    lines: int
    tokens: int


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str  # binary | not utf-8 | too large | symlink | not a regular file | unreadable | context full


@dataclass(frozen=True)
class Pack:
    """A packed repository: the prompt text and the accounting of what went in and what did not."""

    text: str
    tokens: int
    budget: int
    files: tuple[PackedFile, ...]
    skipped: tuple[Skipped, ...]
    ignored: int | None  # entries excluded by ignore rules (None: not counted, git mode)
    method: str  # git | gitignore

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def skipped_by_reason(self) -> dict[str, int]:
        return dict(Counter(s.reason for s in self.skipped))

    def report(self, limit: int = 20) -> str:
        """What was left out and why, one line per file (at most `limit`), for the terminal."""
        if not self.skipped:
            return "all candidate files packed"
        lines = [
            f"left out {len(self.skipped)} files: "
            + ", ".join(f"{n} {r}" for r, n in self.skipped_by_reason().items())
        ]
        for s in self.skipped[:limit]:
            lines.append(f"  {s.path}: {s.reason}")
        if len(self.skipped) > limit:
            lines.append(f"  ... and {len(self.skipped) - limit} more")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "budget": self.budget,
            "method": self.method,
            "ignored": self.ignored,
            "files": [f.__dict__ for f in self.files],
            "skipped": [s.__dict__ for s in self.skipped],
        }


def preamble(name: str) -> str:
    return (
        f'Repository {name}. Each file starts with a line "=== <path> (lines 1-<n>) ===" and each '
        'of its lines is prefixed with its line number and "| ".\n\n'
    )


def format_file(path: str, text: str) -> str:
    """One file's block: a header with its path and line range, then numbered lines."""
    lines = text.splitlines()
    if not lines:
        return f"=== {path} (empty) ===\n\n"
    body = "".join(f"{i}| {line}\n" for i, line in enumerate(lines, 1))
    return f"=== {path} (lines 1-{len(lines)}) ===\n{body}\n"


_C_ESCAPES = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r"}


def shown_path(rel: str) -> str:
    """`rel` as the pack shows it: as it is, or, for a name a header line cannot hold (a newline or other
    control character in it, or bytes that are not UTF-8: os.fsdecode's surrogates), quoted as git quotes
    one (`"new\\nline.txt"`, `"caf\\351.txt"`)."""
    if not any(ord(c) < 0x20 or c == "\x7f" or "\udc80" <= c <= "\udcff" for c in rel):
        return rel
    out = []
    for c in rel:
        if c in _C_ESCAPES:
            out.append(_C_ESCAPES[c])
        elif c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or c == "\x7f":
            out.append(f"\\{ord(c):03o}")
        elif "\udc80" <= c <= "\udcff":  # (a byte that is not UTF-8)
            out.append(f"\\{ord(c) - 0xDC00:03o}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def read_text(path: Path, max_file_bytes: int) -> tuple[str | None, str | None]:
    """(text, None) for a packable file, or (None, reason). Only regular files are read: a FIFO would
    block the run forever and a device such as /dev/zero never ends (git lists neither)."""
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            return None, "symlink"
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_size > max_file_bytes:
            return None, "too large"
        with path.open("rb") as f:
            data = f.read(max_file_bytes + 1)  # (a file growing meanwhile is read no further)
    except OSError:
        return None, "unreadable"
    if len(data) > max_file_bytes:
        return None, "too large"
    if b"\0" in data:
        return None, "binary"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "not utf-8"


def pack_repo(
    root: str | Path,
    counter: TokenCounter,
    budget: int,
    max_file_bytes: int = 1 << 20,
    use_git: bool | None = None,
    exclude: Iterable[str | Path] = (),
) -> Pack:
    """Pack the files of `root` into at most `budget` tokens (counted with `counter`). The files `exclude`
    names are left out where `root` holds them, unlisted as ignored files are (a run's own output, which
    changes between the halves of a resumed run)."""
    root = Path(root)
    unlisted: list[str] = []  # (directories that could not be listed)
    files, ignored, method = list_files(root, use_git, unlisted)
    top = root.resolve()
    own = {
        p.relative_to(top).as_posix() for p in (Path(e).resolve() for e in exclude) if p.is_relative_to(top)
    }
    files = [rel for rel in files if rel not in own]
    head = preamble(shown_path(top.name))
    used = counter.count(head)
    blocks: list[str] = []
    packed: list[PackedFile] = []
    skipped = [Skipped(shown_path(d), "unreadable") for d in unlisted]
    full = False
    for rel in files:
        name = shown_path(rel)
        if full:
            skipped.append(Skipped(name, "context full"))
            continue
        text, reason = read_text(root / rel, max_file_bytes)
        if text is None:
            skipped.append(Skipped(name, reason or "unreadable"))
            continue
        block = format_file(name, text)
        n = counter.count(block)
        if used + n > budget:
            full = True  # stop here: later files would silently reorder the repository
            skipped.append(Skipped(name, "context full"))
            continue
        used += n
        blocks.append(block)
        packed.append(PackedFile(name, len(text.splitlines()), n))
    body = head + "".join(blocks)
    total = counter.count(body)
    # Per-block counts can differ from the whole by merges across block boundaries; trim to fit.
    while total > budget and packed:
        last = packed.pop()
        blocks.pop()
        skipped.append(Skipped(last.path, "context full"))
        body = head + "".join(blocks)
        total = counter.count(body)
    skipped.sort(key=lambda s: s.path)
    return Pack(body, total, budget, tuple(packed), tuple(skipped), ignored, method)
