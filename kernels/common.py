"""Backend dispatch shared by every kernel wrapper in `longctx.kernels`.

Each kernel module exposes a torch reference `<name>_ref` and a Triton implementation behind one
wrapper `<name>(..., backend="auto")`. `use_triton` decides which one runs:

- "torch":  always the reference (any device).
- "triton": always Triton; on CPU this needs the interpreter (`TRITON_INTERPRET=1` set before
            triton is imported), which is how CI tests the kernels.
- "auto":   Triton on CUDA when triton is importable, the reference everywhere else.

triton is an optional dependency, so kernels are decorated with `jit` from here: without triton it
leaves the function undecorated (it is then never called, since `use_triton` says False).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from longctx.errors import KernelInputError

try:  # optional dependency
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None
    HAS_TRITON = False

BACKENDS = ("auto", "torch", "triton")


def _interpreter_device_calls_reuse_the_launch_patch() -> bool:
    """Make the CPU interpreter's device-function calls cheap: the stock `InterpretedFunction.__call__`
    re-patches all of `triton.language` (every builtin of tl, tl.tensor, tl.math and tl.core, found by
    `inspect.getmembers`) on each call of a `@jit` helper from a kernel, although the kernel's launch
    (`GridExecutor`) patched them already and restores them when it ends. Our kernels call helpers per
    program and per loop step (`_dot`, `_load_kv`, ...), so that re-patching was ~36% of an interpreted
    engine run (cProfile of tests/test_hisparse_graphs.py's fork test: 216 of 595 s in `_patch_lang`).
    When every language module a helper's globals name (`tl`, or `tl.core` for Triton's own helpers such
    as `tl.zeros`) is patched already (its `load` is the interpreter's wrapper, not a builtin), the call
    runs the rewritten function directly; otherwise the stock call patches them as before. Returns
    whether it applied (an interpreter without that method, or none at all, is left as it is;
    LONGCTX_INTERPRETER_FAST_CALLS=0 keeps the stock call, for A/B runs)."""
    if not (HAS_TRITON and triton_interpret()) or os.environ.get("LONGCTX_INTERPRETER_FAST_CALLS") == "0":
        return False
    try:
        from triton.runtime import interpreter as ti
    except ImportError:  # pragma: no cover - a triton without the interpreter module
        return False
    stock = vars(ti.InterpretedFunction).get("__call__")
    if stock is None or getattr(stock, "_longctx", False) or not hasattr(ti.InterpretedFunction, "rewrite"):
        return False

    langs: dict[Any, tuple[Any, ...]] = {}  # a helper -> the language modules its globals name

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        mods = langs.get(self.fn)
        if mods is None:
            g = self.fn.__globals__.values()
            mods = langs[self.fn] = tuple(m for m in (tl, tl.core) if any(v is m for v in g))
        if not mods or any(tl.core.is_builtin(m.load) for m in mods):  # one of them is not patched
            return stock(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    call._longctx = True  # type: ignore[attr-defined]
    ti.InterpretedFunction.__call__ = call
    return True


def triton_interpret() -> bool:
    """True when Triton kernels run under the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


INTERPRETER_FAST_CALLS = _interpreter_device_calls_reuse_the_launch_patch()


def _interpreter_skips_dead_overflow_checks() -> bool:
    """Stop the CPU interpreter building integer-overflow checks it then throws away. With its default options
    (`sanitize_overflow=True`, `debug=False`) the interpreter redoes every int32 add, sub and mul of a kernel
    in int64 and compares the result with the type's bounds (~10 more interpreted ops per op), then hands the
    condition to `device_assert`, which returns at once unless `debug` is set, and nothing sets it. So the
    checks never fire, and they cost a third to a half of an interpreted engine run: the top-k of 48 queries
    over 130 keys takes 1.2 s without them and 3-4 s with them on a 2-core machine. Turned off only while
    `debug` is off (an interpreter that honours debug keeps them); results are the same, since the
    kernel's op is computed as before. Returns whether it applied."""
    if not (HAS_TRITON and triton_interpret()):
        return False
    try:
        from triton.runtime import interpreter as ti
    except ImportError:  # pragma: no cover - a triton without the interpreter module
        return False
    builder = getattr(ti, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(opts) or not getattr(opts, "sanitize_overflow", False):
        return False
    if getattr(opts, "debug", True):
        return False
    builder.options = dataclasses.replace(opts, sanitize_overflow=False)  # type: ignore[union-attr,type-var]
    return True


INTERPRETER_SKIPS_OVERFLOW_CHECKS = _interpreter_skips_dead_overflow_checks()


def use_triton(backend: str, device: torch.device | str) -> bool:
    """Whether a kernel wrapper should run its Triton implementation on `device`.

    Raises `KernelInputError` for an unknown backend, or for "triton" where it cannot run
    (triton not installed, or a CPU device without the interpreter).
    """
    if backend not in BACKENDS:
        raise KernelInputError.about("backend", repr(backend), f"must be one of {BACKENDS}")
    dev = torch.device(device)
    if backend == "torch":
        return False
    if backend == "auto":
        return HAS_TRITON and dev.type == "cuda"
    if not HAS_TRITON:
        raise KernelInputError.about("backend", repr(backend), "triton is not installed")
    if dev.type == "cpu" and not triton_interpret():
        raise KernelInputError.about(
            "backend", repr(backend), "on CPU needs TRITON_INTERPRET=1 set before importing triton"
        )
    return True


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` when triton is installed, else the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


# Programmatic dependent launch (Hopper and later): a kernel launched with `pdl(device)`'s keywords may
# be scheduled while the kernel before it in the stream (or CUDA graph) is still finishing, so its launch
# and CTA set-up overlap that kernel's tail. Every such kernel calls `pdl_wait(PDL)` before its first
# global load or store: it returns once the kernel before has completed and its writes are visible, so
# the result is the same as without PDL (and, each PDL kernel completing only after its own wait, reads
# of any earlier kernel's output stay ordered too). Kernels launched without the keywords are ordinary
# launches. LONGCTX_PDL=0 turns it off (for A/B runs); the interpreter and pre-Hopper GPUs never use it.
PDL_ENABLED = os.environ.get("LONGCTX_PDL", "1").strip() != "0"
# Tests set this to pass the keywords under the interpreter too (pdl_wait is then a no-op), which checks
# that every kernel launched with them takes the PDL parameter.
PDL_FORCE = False
# griddepcontrol exists on the GPU only: under the interpreter pdl_wait never emits it
_GDC = tl.constexpr(not triton_interpret()) if HAS_TRITON else False


def pdl(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter that calls `pdl_wait(PDL)`
    first: {"PDL": True, "launch_pdl": True} on a CUDA device of compute capability >= 9 unless
    LONGCTX_PDL=0, else {} (the kernel's default PDL=False, a plain launch)."""
    if PDL_FORCE:
        return {"PDL": True, "launch_pdl": True}
    if not PDL_ENABLED or device.type != "cuda" or triton_interpret():
        return {}
    return _pdl_keywords(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_keywords(index: int) -> dict[str, bool]:
    hopper = torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9  # (ROCm: no PDL)
    return {"PDL": True, "launch_pdl": True} if hopper else {}


@jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel's writes are visible, then let the next PDL kernel be
    scheduled (it waits the same way, so at most one kernel waits ahead). A no-op otherwise."""
    if PDL and _GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def num_sms(device: torch.device, cpu: int = 4) -> int:
    """The device's SM count (cached: get_device_properties per call costs host time on the decode
    path), or `cpu` for a CPU device (the interpreter: a few programs, so tests split work)."""
    if device.type != "cuda":
        return cpu
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_split(width: int, rows: int, block: int, device: torch.device, min_blocks: int) -> tuple[int, int]:
    """(programs a row, columns a program) for a kernel that reduces each of `rows` rows of `width` columns in
    `block`-column steps: enough programs a row to fill the SMs twice over at batch 1, each at least
    `min_blocks` blocks long; a program's columns are whole blocks."""
    s = max(1, min(-(-width // (min_blocks * block)), -(-2 * num_sms(device) // rows)))
    per = -(-width // s)
    chunk = -(-per // block) * block
    return -(-width // chunk), chunk


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check(cond: bool, msg: str) -> None:
    """Raise `KernelInputError(msg)` unless `cond` (wrappers validate inputs with this, not assert,
    so the checks survive `python -O`)."""
    if not cond:
        raise KernelInputError(msg)


@jit
def lse_weights(lse):
    """The weights of an attention's key splits from their log-sum-exps `lse` [S] (-inf: an empty split):
    softmax(lse), 0 for empty splits, all 0 when every split is empty. Returns (weights, max(lse), their
    unnormalised sum tot): the merged lse is `max + log(tot)` where tot > 0 (max is then finite), else max."""
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    tot = tl.sum(w, axis=0)
    return w / tl.where(tot > 0.0, tot, 1.0), m, tot


@jit
def round_as(x, like):
    """fp32 `x` rounded to the nearest value of `like`'s dtype (ties to even), still in fp32.

    Kernels that must reproduce torch's rounding of intermediate results (torch rounds every op's
    output to the tensor dtype) round with this instead of `.to(dt)`: the Triton interpreter
    converts fp32 -> bf16 by truncation, the GPU and torch to nearest even; exact integer ops agree
    everywhere. Finite inputs; fp32 passes through."""
    y = x
    if like.dtype == tl.bfloat16:
        u = x.to(tl.int32, bitcast=True)
        y = ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif like.dtype == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    return y


def knobs_spec(knobs: Any) -> str:
    """A launch-knob dataclass as its env-var string "name=int,..." (every field; bools as 0/1)."""
    return ",".join(f"{f.name}={int(getattr(knobs, f.name))}" for f in dataclasses.fields(knobs))


def knobs_diff(knobs: Any) -> str:
    """Only the fields that differ from the class's defaults, as "name=value,..." ("" for the defaults)."""
    base = type(knobs)()
    return ",".join(
        f"{f.name}={getattr(knobs, f.name)}"
        for f in dataclasses.fields(knobs)
        if getattr(knobs, f.name) != getattr(base, f.name)
    )


def parse_knobs(cls: type, spec: str, base: Any, what: str) -> Any:
    """`base` (default: cls()) with the fields named in "name=int,..." replaced; a bool field takes 0/1.
    The dataclass's own checks (its __post_init__) judge the values."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kv: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, val = (x.strip() for x in part.partition("="))
        check(name in fields and val.lstrip("-").isdigit(), f"bad {what} {part!r}")
        kv[name] = bool(int(val)) if fields[name].type in (bool, "bool") else int(val)
    return dataclasses.replace(base or cls(), **kv)
