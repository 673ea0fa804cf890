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
            bracket = _bracket(pat, i)
            if bracket is None:
                out.append(re.escape(c))  # no closing bracket: a literal '['
            else:
                out.append(bracket[0])
                i = bracket[1]
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


# POSIX classes inside a bracket, as git's wildmatch reads them (ASCII, the C locale)
_CLASSES = {
    "alnum": "0-9A-Za-z",
    "alpha": "A-Za-z",
    "blank": " \t",
    "cntrl": "\x00-\x1f\x7f",
    "digit": "0-9",
    "graph": "!-~",
    "lower": "a-z",
    "print": " -~",
    "punct": "!-/:-@\\[-`{-~",
    "space": " \t\n\r\x0b\x0c",
    "upper": "A-Z",
    "xdigit": "0-9A-Fa-f",
}
_NOTHING = "(?!)"  # a regex that matches nothing


def _bracket(pat: str, start: int) -> tuple[str, int] | None:
    """The bracket expression opening at `pat[start]` ('[') as a regex, and the index of its ']'; None when
    it never closes (the '[' is then a literal character, as fnmatch(3) has it). Read as git's wildmatch
    reads one: '!' or '^' negates, a ']' first is a member, '\\' escapes, 'a-z' is a range (one running
    backwards, 'z-a', holds its first character only), '[:alpha:]' is a class (an unknown one makes the
    pattern match nothing); it never matches '/'."""
    n = len(pat)
    j = start + 1
    negate = j < n and pat[j] in "!^"
    if negate:
        j += 1
    members: list[str] = []
    nothing = False
    first = True
    while j < n and (first or pat[j] != "]"):
        first = False
        if pat.startswith("[:", j):
            end = pat.find("]", j + 2)
            if end > j + 2 and pat[end - 1] == ":":  # (else the '[' is a member)
                cls = _CLASSES.get(pat[j + 2 : end - 1])
                if cls is None:
                    nothing = True
                else:
                    members.append(cls)
                j = end + 1
                continue
        ch = pat[j]
        if ch == "\\" and j + 1 < n:
            j += 1
            ch = pat[j]
        j += 1
        if j + 1 < n and pat[j] == "-" and pat[j + 1] != "]":
            hi = pat[j + 1]
            j += 2
            if hi == "\\" and j < n:
                hi = pat[j]
                j += 1
            # (one running backwards holds its first character only, as in git)
            members.append(f"{re.escape(ch)}-{re.escape(hi)}" if ch <= hi else re.escape(ch))
            continue
        members.append(re.escape(ch))
    if j >= n:
        return None
    if nothing:
        return _NOTHING, j
    if not members:
        return ("[^/]" if negate else _NOTHING), j
    return ("(?!/)[" + ("^" if negate else "") + "".join(members) + "]"), j


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


def walk_files(root: str | Path, unreadable: list[str] | None = None) -> tuple[list[str], int]:
    """(files not ignored, number of ignored entries) under root by .gitignore rules, sorted. The
    directories that cannot be listed (no read permission) are appended to `unreadable` ("dir/", "./"
    for the root), as git warns of them and goes on."""
    root = Path(root)

    def cannot_list(e: OSError) -> None:
        if unreadable is not None and e.filename is not None:
            rel = Path(e.filename).relative_to(root).as_posix()
            unreadable.append(f"{rel}/")

    base_rules: list[Rule] = []
    exclude = root / ".git" / "info" / "exclude"
    if exclude.is_file():
        base_rules += parse_gitignore(exclude.read_text(errors="replace"))
    files: list[str] = []
    ignored = 0
    rules_of: dict[str, list[Rule]] = {}
    for dirpath, dirnames, filenames in os.walk(root, onerror=cannot_list):
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
            if f == ".git":
                continue  # a worktree's or submodule's link to its repository ("gitdir: ..."): git lists none
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if is_ignored(rel, False, rules):
                ignored += 1
            else:
                files.append(rel)
    return sorted(files), ignored


# git's warning for a directory it cannot list (dir.c), which it leaves out and goes on; the path is the
# work tree's, with its trailing slash
_GIT_UNLISTED = re.compile(r"^warning: could not open directory '(.*)': ", re.MULTILINE)


def git_files(root: str | Path, unreadable: list[str] | None = None) -> list[str] | None:
    """Files git would commit under root (tracked + untracked-not-ignored), or None if not a git tree.
    The untracked directories git could not list (no read permission; it warns and goes on) are
    appended to `unreadable`, as `walk_files` does."""
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
            env={**os.environ, "LC_ALL": "C"},  # (its warnings in English, to be read)
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    names = [p for p in res.stdout.decode("utf-8", errors="surrogateescape").split("\0") if p]
    if unreadable is not None:
        warned = res.stderr.decode("utf-8", errors="surrogateescape")
        unreadable += [d if d.endswith("/") else f"{d}/" for d in _GIT_UNLISTED.findall(warned)]
    return sorted({p for p in names if (Path(root) / p).is_file()})


def list_files(
    root: str | Path, use_git: bool | None = None, unreadable: list[str] | None = None
) -> tuple[list[str], int | None, str]:
    """(files, ignored count or None when unknown, method) for a repository root.

    use_git: None tries git and falls back to the rules; False always uses the rules. `unreadable`
    gathers the directories that could not be listed (`walk_files`, `git_files`).
    """
    if use_git is not False:
        files = git_files(root, unreadable)
        if files is not None:
            return files, None, "git"
        if use_git:
            from longctx.errors import LongctxError

            raise LongctxError(f"{root} is not a git work tree")
    files, ignored = walk_files(root, unreadable)
    return files, ignored, "gitignore"
