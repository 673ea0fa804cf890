"""Seconds each test file takes, for `tests/conftest.py`'s heaviest-first order.

`make test` hands whole files to its two workers (`--dist loadfile --no-loadscope-reorder`) in collection
order, and the conftest orders the files by the seconds recorded in `file_seconds.json`, longest first, so
the long files start at once and the short ones fill the end of both workers' queues (pytest-xdist's own
order, by number of tests, started the one-test compile check last and left a worker idle ~5 minutes).

Refresh the record after tests move: `make test PYTEST_ARGS="--durations=0" | tee /tmp/d.log`, then
`python tests/file_seconds.py /tmp/d.log` (sums each file's setup, call and teardown times)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

RECORD = Path(__file__).with_name("file_seconds.json")
_LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+tests/([^:\s]+\.py)::")


def parse(lines: list[str]) -> dict[str, float]:
    """Seconds per test file name from pytest's `--durations=0` lines."""
    seconds: Counter[str] = Counter()
    for line in lines:
        m = _LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def load() -> dict[str, float]:
    try:
        return json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/file_seconds.py DURATIONS_LOG", file=sys.stderr)
        return 2
    seconds = parse(Path(argv[0]).read_text().splitlines())
    if not seconds:
        print(f"{argv[0]}: no --durations=0 lines", file=sys.stderr)
        return 1
    RECORD.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s -> {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
