"""Pack Triton's kernel cache for the next device session: only what a cache hit loads.

A fresh GPU machine compiles every Triton kernel again in the first process that runs it (about two
minutes of a session's device time). `bench/session.sh collect` packs the cache so the next session can
carry it back. Most of the cache is intermediate IR (ttir, ttgir, llir, ptx, the source dump: 110 MB of a
session's cache), which a hit never reads; it needs each kernel's metadata json, its cubin, the launchers'
shared objects and the group file that lists them. Triton treats a group whose listed file is missing as
a miss, so the group files are rewritten without the IR entries rather than left pointing at them.

    python -m bench.triton_cache pack CACHE_DIR OUT.tgz [--arcname triton-cache]

Standard library only: `collect` runs it with the machine's python3 whatever PYTHON the lanes use.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

IR_SUFFIXES = (".ttir", ".ttgir", ".llir", ".ptx", ".source", ".amdgcn")


def pack(cache: Path, out: Path, arcname: str = "triton-cache") -> tuple[int, int]:
    """Write `cache` into the gzip tar `out` under `arcname`, without IR files and with each group file's
    IR entries dropped. Returns (files kept, files left out)."""
    kept = dropped = 0
    with tarfile.open(out, "w:gz") as tar:
        for f in sorted(p for p in cache.rglob("*") if p.is_file()):
            name = f"{arcname}/{f.relative_to(cache).as_posix()}"
            if f.suffix in IR_SUFFIXES:
                dropped += 1
                continue
            if f.name.startswith("__grp__") and f.suffix == ".json":
                try:
                    grp = json.loads(f.read_text())
                    paths = grp["child_paths"]
                except (ValueError, KeyError, TypeError):
                    dropped += 1  # (a corrupt group is a miss anyway)
                    continue
                grp["child_paths"] = {c: p for c, p in paths.items() if not c.endswith(IR_SUFFIXES)}
                data = json.dumps(grp).encode()
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.add(f, arcname=name, recursive=False)
            kept += 1
    return kept, dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.triton_cache", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack a cache directory without its intermediate IR")
    p.add_argument("cache", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--arcname", default="triton-cache")
    args = ap.parse_args(argv)
    if not args.cache.is_dir():
        print(f"triton_cache: {args.cache} is not a directory", file=sys.stderr)
        return 2
    kept, dropped = pack(args.cache, args.out, args.arcname)
    print(f"triton_cache: {kept} files packed into {args.out}, {dropped} left out (IR)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
