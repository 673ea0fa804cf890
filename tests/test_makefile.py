"""`make serve`'s default model: the trained retrieval model where its weights are in the tree, else the
random tiny model, written to models/tiny if missing (`make -n`: the commands, nothing run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(cwd: Path, *args: str) -> list[str]:
    # (under `make test` the environment says this is a sub-make: it would print its directory and
    # inherit the outer make's variables)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MODEL")}
    p = subprocess.run(
        ["make", "--no-print-directory", "-n", "serve", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_make_serve_serves_the_trained_model() -> None:
    lines = _dry_run(ROOT)
    assert lines[-1].endswith(
        "longctx serve --model models-shipped/retrieval-wip --host 127.0.0.1 --port 8000"
    )
    assert not any("init-model" in x for x in lines)
    assert (ROOT / "models-shipped" / "retrieval-wip" / "model.safetensors").is_file()


def test_make_serve_without_the_trained_weights_writes_the_tiny_model(tmp_path: Path) -> None:
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    lines = _dry_run(tmp_path)
    assert lines[-2].endswith("longctx init-model --config configs/tiny.json --out models/tiny --seed 0")
    assert lines[-1].endswith("longctx serve --model models/tiny --host 127.0.0.1 --port 8000")
    # and an explicit MODEL / PORT win
    assert _dry_run(ROOT, "MODEL=models/tiny", "PORT=9000")[-1].endswith(
        "--model models/tiny --host 127.0.0.1 --port 9000"
    )
