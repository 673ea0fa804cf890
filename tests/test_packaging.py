"""The checkout's kernels/ directory (the package longctx.kernels) never shadows another top-level
`kernels`: transformers installs and imports Hugging Face's, and from the repository root, where
`python -m` and pytest put the checkout first on sys.path, that import must still reach it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = (
    "import kernels, longctx.kernels as ours; "
    "print(kernels.__file__); print(ours.__file__); print(getattr(kernels, 'MARK', None))"
)


def _python(code: str, *flags: str, env: dict[str, str] | None = None, timeout: int = 120) -> list[str]:
    """Run `code` in a fresh interpreter from the repository root (so the checkout leads sys.path): its
    stdout lines; it must exit 0."""
    p = subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.splitlines()


def test_top_level_kernels_goes_to_the_installed_package(tmp_path: Path) -> None:
    mark = f"mark-{tmp_path.name}"
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("from kernels.sub import MARK\n")
    (other / "sub.py").write_text(f"MARK = {mark!r}\n")
    top, ours, got = _python(PROBE, env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    assert Path(top) == other / "__init__.py"
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert got == mark


def test_top_level_kernels_without_another_stays_empty() -> None:
    # -S: no site-packages, so only the checkout (first, as the cwd) and the standard library are searched;
    # longctx itself is then found from the checkout too.
    file, names = _python("import kernels; print(kernels.__file__); print(sorted(vars(kernels)))", "-S")
    assert Path(file) == ROOT / "kernels" / "__init__.py"
    assert "__version__" not in names and "CUDAProperties" not in names


def test_transformers_model_imports_from_the_checkout() -> None:
    # transformers >= 5.2x imports `kernels` while loading its model classes: the CI failure this guards.
    assert _python("from transformers import GlmMoeDsaForCausalLM; print('ok')", timeout=300) == ["ok"]
