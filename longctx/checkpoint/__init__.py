"""Checkpoints: the HF on-disk layout, lazy safetensors loading, FP8 block scales, tokenizer, init-model.

Attributes are imported on first use so `longctx --help` (which imports `init_random` to register
its subcommand) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointReader": "loader",
    "iter_weights": "loader",
    "validate_checkpoint": "loader",
    "expected_weights": "layout",
    "apply_chat_template": "chat_template",
    "load_chat_template": "chat_template",
    "make_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "init_random_checkpoint": "init_random",
    "quantize_fp8_block": "fp8",
    "dequantize_fp8_block": "fp8",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'longctx.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"longctx.checkpoint.{mod}"), name)
