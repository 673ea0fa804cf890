"""The checkout's kernels/ directory (the package longctx.kernels) never shadows another top-level
`kernels`: transformers installs and imports Hugging Face's, and from the repository root, where
`python -m` and pytest put the checkout first on sys.path, that import must still reach it."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _requirement_names(requirements: list[str] | None) -> set[str]:
    """Normalised distribution names of `requirements` that hold without an extra."""
    return {
        re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower()
        for r in requirements or []
        if not re.search(r"\bextra\s*==", r)
    }


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """Each third-party module longctx/ and kernels/ import comes with `pip install longctx` (a
    [project] dependency, or one of theirs) or its `triton` extra: `longctx ruler --base-url` imported
    httpx, which only the test extra installed."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"]) | _requirement_names(
        project["optional-dependencies"]["triton"]
    )
    installed, todo = set(declared), list(declared)
    while todo:  # (what the declared ones bring with them, as installed here)
        try:
            needs = _requirement_names(importlib.metadata.requires(todo.pop()))
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += sorted(needs - installed)
        installed |= needs
    dists = importlib.metadata.packages_distributions()
    missing = set()
    for path in [*(ROOT / "longctx").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - {"longctx", "kernels", "__future__"}:
                if top in sys.stdlib_module_names:
                    continue
                found = {re.sub(r"[-_.]+", "-", d).lower() for d in dists.get(top, [top])}
                if not found & installed:
                    missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, f"imported but not installed with longctx: {sorted(missing)}"
