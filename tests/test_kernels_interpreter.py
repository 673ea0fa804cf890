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


@jit
def _scale_kernel(x_ptr, o_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=m, other=0) * s, mask=m)


def test_the_interpreters_overflow_checks_are_dead_and_skipped(monkeypatch):
    """kernels/common.py turns off the interpreter's int32 overflow checks, which it builds for every int op
    and then drops (`device_assert` does nothing without `debug`): with them on an overflowing product still
    passes, and with them off the same launch gives the same wrapped values, as the compiled kernel would."""
    import dataclasses

    from triton.runtime import interpreter as ti

    assert common.INTERPRETER_SKIPS_OVERFLOW_CHECKS
    opts = ti.interpreter_builder.options
    assert not opts.sanitize_overflow and not opts.debug
    n = int(torch.randint(3, 16, ()).item())
    x = torch.randint(1 << 20, 1 << 21, (n,), dtype=torch.int32)
    want = (x.long() * (1 << 12)).to(torch.int32)  # every product overflows int32 and wraps
    outs = []
    for checks in (True, False):
        monkeypatch.setattr(
            ti.interpreter_builder, "options", dataclasses.replace(opts, sanitize_overflow=checks)
        )
        out = torch.empty_like(x)
        _scale_kernel[(1,)](x, out, 1 << 12, n, BLOCK=16)
        outs.append(out)
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)
