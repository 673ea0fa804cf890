"""longctx: an inference engine for GLM-5.x / DeepSeek-V3.2-style models at 1,048,576 tokens."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncEngine", "Completion", "Engine", "SamplingParams", "__version__"]
_WHERE = {
    "Engine": "engine",
    "Completion": "engine",
    "AsyncEngine": "async_engine",
    "SamplingParams": "request",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import longctx` (and the CLI) does not pay for torch until it is needed.
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"longctx.engine.{_WHERE[name]}"), name)
    raise AttributeError(name)
