"""The suite's heaviest-first file order (tests/conftest.py, tests/file_seconds.py)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

from .conftest import heaviest_files_first
from .file_seconds import RECORD, load, main, parse


def test_durations_lines_sum_per_file(tmp_path):
    lines = [
        "1.50s call     tests/test_a.py::test_one[x-1]",
        "0.50s setup    tests/test_a.py::test_one[x-1]",
        "3.00s call     tests/test_b.py::Cls::test_two",
        "0.10s teardown tests/test_b.py::Cls::test_two",
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)",
        "=== 3 passed in 5.00s ===",
    ]
    assert parse(lines) == {"test_b.py": 3.1, "test_a.py": 2.0}
    log = tmp_path / "d.log"
    log.write_text("nothing timed\n")
    assert main([str(log)]) == 1 and main([]) == 2


def test_items_go_longest_file_first_and_keep_their_order_within_a_file():
    seconds = {
        "test_a.py": 20.0,
        "test_b.py": 50.0,
        "test_c.py": 1.0,
        "test_gone.py": 10.0,
        "test_old.py": 0.5,
    }
    names = ["test_a.py", "test_b.py", "test_c.py", "test_new.py"]
    items = [SimpleNamespace(path=Path("tests") / n, i=i) for n in names for i in range(3)]
    random.Random(int.from_bytes(random.randbytes(2), "little")).shuffle(items)
    before = {n: [it.i for it in items if it.path.name == n] for n in names}
    heaviest_files_first(items, seconds)
    order = list(dict.fromkeys(it.path.name for it in items))
    assert order == ["test_b.py", "test_a.py", "test_new.py", "test_c.py"]  # unrecorded: the median, 10
    assert {n: [it.i for it in items if it.path.name == n] for n in names} == before


def test_the_record_names_this_suites_files():
    record = load()
    here = {p.name for p in RECORD.parent.glob("test_*.py")}
    assert record and set(record) <= here and len(record) >= len(here) // 2
