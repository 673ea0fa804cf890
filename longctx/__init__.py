"""longctx: an inference engine for GLM-5.x / DeepSeek-V3.2-style models at 1,048,576 tokens."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "Completion", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import longctx` (and the CLI) does not pay for torch until it is needed.
    if name in ("Engine", "Completion"):
        from longctx.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
