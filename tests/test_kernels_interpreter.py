"""The CPU interpreter's device-function calls (kernels/common.py,
`_interpreter_device_calls_reuse_the_launch_patch`): a helper called from a kernel runs on the launch's
patch of `triton.language` instead of patching it again, with the same results, and the language is
itself again after the launch."""

from __future__ import annotations

import os

import pytest
import torch
from longctx.kernels import common
from longctx.kernels.common import HAS_TRITON, jit, tl, triton_interpret

pytestmark = [
    pytest.mark.skipif(not (HAS_TRITON and triton_interpret()), reason="needs TRITON_INTERPRET=1"),
    pytest.mark.skipif(
        os.environ.get("LONGCTX_INTERPRETER_FAST_CALLS") == "0", reason="LONGCTX_INTERPRETER_FAST_CALLS=0"
    ),
]


@jit
def _scaled(x, s):
    return x * s


@jit
def _helpers_kernel(x_ptr, o_ptr, n, REPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)  # Triton's own helper (its globals name tl.core)
    for i in range(REPS):
        acc += _scaled(x, i + 1.0)  # one of ours, per loop step
    tl.store(o_ptr + offs, tl.maximum(acc, 0.0), mask=m)


def test_helper_calls_reuse_the_launch_patch_and_compute_the_same(monkeypatch):
    from triton.runtime import interpreter as ti

    assert common.INTERPRETER_FAST_CALLS
    patches = []
    stock = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: patches.append(fn.__name__) or stock(fn))
    n, block, reps = int(torch.randint(20, 90, ()).item()), 16, 5
    x = torch.randn(n)
    out = torch.empty(n)
    grid = ((n + block - 1) // block,)
    _helpers_kernel[grid](x, out, n, REPS=reps, BLOCK=block)
    torch.testing.assert_close(out, (x * sum(range(1, reps + 1))).clamp(min=0.0), rtol=1e-6, atol=1e-6)
    # the launch patches once; tl.zeros at most once more (its module's tl.core), never _scaled
    assert patches.count("_helpers_kernel") == 1 and "_scaled" not in patches, patches
    assert len(patches) <= 2
    assert tl.core.is_builtin(tl.load)  # restored after the launch
