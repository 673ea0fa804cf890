"""The placement kernels and the sampler's Gumbel draw compile for an sm_90 GPU on this CPU machine
(bench/compile_check.py, in a subprocess without the interpreter): what the interpreted tests cannot see, a
kernel the compiler rejects, fails here and not in a device session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compile_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.compile_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_placement_kernels_compile_for_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton has no nvidia backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, not from an earlier run
    p = _compile_check(env)
    assert p.returncode == 0, p.stdout + p.stderr
    ok = [ln for ln in p.stdout.splitlines() if ln.startswith("ok ")]
    from bench.compile_check import variants

    assert len(ok) == len(variants()) >= 18 and any("'PHASE': 2" in ln for ln in ok)
    assert any("_lru_candidates_kernel" in ln and "'PAR': True" in ln for ln in ok)


def test_compile_check_refuses_the_interpreter() -> None:
    p = _compile_check({**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 2 and "TRITON_INTERPRET" in p.stdout
