"""Picks a kernel or its torch reference. Model code calls `op("indexer", "indexer_logits_paged", ctx)`."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from functools import cache
from typing import Any


@cache
def _lookup(module: str, name: str, triton: bool) -> Callable[..., Any]:
    mod = importlib.import_module(f"longctx.kernels.{module}")
    if not triton:
        return getattr(mod, f"{name}_ref")
    fn = getattr(mod, name)
    # the wrapper picks its implementation from `backend`; the engine has already decided
    if "backend" in inspect.signature(fn).parameters:
        return functools.partial(fn, backend="triton")
    return fn


def op(module: str, name: str, use_triton: bool) -> Callable[..., Any]:
    return _lookup(module, name, bool(use_triton))
