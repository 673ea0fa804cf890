"""Which files of a repository to pack: git's view when it is a git work tree, else .gitignore rules.

In a git work tree `git ls-files --cached --others --exclude-standard` is the truth (tracked
files plus untracked ones no ignore rule excludes). Elsewhere (an exported tree, a tarball) the
same rules are applied in pure Python: every `.gitignore` from the root down (nested files
apply below their own directory), plus `.git/info/exclude`, with git's pattern syntax (`*`,
`?`, `[...]`, `**`, a leading or inner `/` anchoring the pattern, a trailing `/` for directories
only, `!` re-including, `\\` escaping) and git's precedence (the last matching line wins; deeper
files override shallower ones; nothing under an excluded directory can be re-included, because
git never looks inside it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    """One .gitignore line. `base` is its file's directory relative to the root ('' = root)."""

    base: str
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    pattern: str


def _translate(pat: str) -> str:
    """A gitignore glob (already anchored to its base directory) as a regular expression."""
    out = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            if pat.startswith("**", i):
                before_ok = i == 0 or pat[i - 1] == "/"
                after = pat[i + 2 : i + 3]
                if before_ok and after == "/":
                    out.append("(?:.*/)?")  # '**/': zero or more directories
                    i += 3
                    continue
                if before_ok and i + 2 == n:
                    out.append(".*")  # trailing '/**': everything inside
                    i += 2
                    continue
                out.append("[^/]*")  # any other '**' is a plain '*'
                i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pat[j] in "!^":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            while j < n and pat[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape(c))  # no closing bracket: a literal '['
            else:
                body = pat[i + 1 : j]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                body = body.replace("\\", "\\\\")
                out.append(f"(?!/)[{body}]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_gitignore(text: str, base: str = "") -> list[Rule]:
    """The rules of one .gitignore file whose directory is `base` (relative to the root)."""
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip("\n\r")
        if not line or line.startswith("#"):
            continue
        # Trailing spaces are ignored unless escaped with a backslash.
        stripped = line.rstrip(" ")
        if stripped.endswith("\\") and len(stripped) < len(line):
            stripped += " "
        line = stripped
        if not line:
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        dir_only = line.endswith("/") and not line.endswith("\\/")
        if dir_only:
            line = line.rstrip("/")
        if not line:
            continue
        if "/" in line:
            pat = line.lstrip("/") if line.startswith("/") else line  # anchored to `base`
        else:
            pat = "**/" + line  # a bare name matches at any depth
        rules.append(Rule(base, re.compile(_translate(pat)), negate, dir_only, raw))
    return rules


def is_ignored(rel: str, is_dir: bool, rules: list[Rule]) -> bool:
    """Git's verdict for `rel` (posix, relative to the root) under `rules` (shallow first)."""
    verdict = False
    for r in rules:
        if r.dir_only and not is_dir:
            continue
        if r.base:
            if not rel.startswith(r.base + "/"):
                continue
            sub = rel[len(r.base) + 1 :]
        else:
            sub = rel
        if r.regex.fullmatch(sub):
            verdict = not r.negate
    return verdict


def walk_files(root: str | Path) -> tuple[list[str], int]:
    """(files not ignored, number of ignored entries) under root by .gitignore rules, sorted."""
    root = Path(root)
    base_rules: list[Rule] = []
    exclude = root / ".git" / "info" / "exclude"
    if exclude.is_file():
        base_rules += parse_gitignore(exclude.read_text(errors="replace"))
    files: list[str] = []
    ignored = 0
    rules_of: dict[str, list[Rule]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        rules = list(rules_of[Path(rel_dir).parent.as_posix()] if rel_dir else base_rules)
        gi = Path(dirpath) / ".gitignore"
        if gi.is_file():
            rules += parse_gitignore(gi.read_text(errors="replace"), rel_dir)
        rules_of[rel_dir or "."] = rules
        keep = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if d == ".git":
                continue
            if os.path.islink(os.path.join(dirpath, d)):
                continue  # git records a symlink, it does not follow it
            if is_ignored(rel, True, rules):
                ignored += 1
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if is_ignored(rel, False, rules):
                ignored += 1
            else:
                files.append(rel)
    return sorted(files), ignored


def git_files(root: str | Path) -> list[str] | None:
    """Files git would commit under root (tracked + untracked-not-ignored), or None if not a git tree."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        probe = subprocess.run(
            [git, "-C", str(root), "rev-parse", "--is-inside-work-tree"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if probe.returncode != 0 or probe.stdout.strip() != "true":
            return None
        res = subprocess.run(
            [git, "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    names = [p for p in res.stdout.decode("utf-8", errors="surrogateescape").split("\0") if p]
    return sorted({p for p in names if (Path(root) / p).is_file()})


def list_files(root: str | Path, use_git: bool | None = None) -> tuple[list[str], int | None, str]:
    """(files, ignored count or None when unknown, method) for a repository root.

    use_git: None tries git and falls back to the rules; False always uses the rules.
    """
    if use_git is not False:
        files = git_files(root)
        if files is not None:
            return files, None, "git"
        if use_git:
            from longctx.errors import LongctxError

            raise LongctxError(f"{root} is not a git work tree")
    files, ignored = walk_files(root)
    return files, ignored, "gitignore"
