"""Triton kernels and their torch references (installed as `longctx.kernels`)."""

import sys


def _stand_aside() -> None:
    """Hand a top-level `import kernels` to the installed distribution of that name, if there is one.

    This directory is the package `longctx.kernels`. It is found as a top-level `kernels` only when a
    checkout's root leads sys.path (`python -m ...` or pytest run there), and under that name it would
    shadow Hugging Face's `kernels`, which transformers (>= 5.2x) installs and imports. Nothing in longctx
    imports the top-level name, so the import is given to the other package; with none installed this
    module stays, empty, and reports no version.
    """
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds after this runs
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _stand_aside()
