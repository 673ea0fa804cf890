"""Imported first by the kernel test modules: run the Triton kernels under the CPU interpreter.

Triton fixes every jit function's mode (compiled or interpreted) when `@triton.jit` runs,
including its own `tl.sum`, `tl.cumsum`, ... at `import triton`. So `TRITON_INTERPRET=1` must be
set before anything imports triton (tests/conftest.py does that for the whole session); this
module sets it too, for running a kernel test file on its own, and fails loudly if triton was
already imported in compiled mode. Not a `conftest.py` (the lead owns that file).
"""

from __future__ import annotations

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set; kernel tests need the interpreter"
    )
os.environ["TRITON_INTERPRET"] = "1"
