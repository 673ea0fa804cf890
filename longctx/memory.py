"""Room checks: refuse what this machine cannot hold before any of it is allocated or written.

Sizes a user gives (a KV pool's pages, a checkpoint's config) failed at their first oversized
allocation with a traceback, or took the machine's memory a page at a time; `check_room` turns
that into one line naming the setting, the bytes it needs and the bytes there are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from longctx.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch and psutil are imported inside functions: `longctx --help` imports init-model, which imports this.


def available_memory(device: torch.device | None = None) -> int:
    """Bytes a new allocation can take now: a CUDA device's free memory, else the host's available RAM
    (MemAvailable: free pages and the page cache the kernel can drop)."""
    if device is not None and device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return int(psutil.virtual_memory().available)


def check_room(subject: str, need: int, what: str, have: int) -> None:
    """ConfigError "`subject` needs at least N GB of `what`, M GB available" when `need` > `have`."""
    if need > have:
        raise ConfigError(
            f"{subject} needs at least {need / 1e9:,.1f} GB of {what}, {have / 1e9:,.1f} GB available"
        )


def check_parts(subject: str, parts: dict[str, int], what: str, have: int) -> None:
    """`check_room` of the sum of `parts`, saying what it is made of: ConfigError "`subject`: the weights
    (X GB) and the KV cache (Y GB) need at least Z GB of `what`, M GB available"."""
    need = sum(parts.values())
    if need > have:
        made_of = " and ".join(f"{name} ({n / 1e9:,.1f} GB)" for name, n in parts.items())
        raise ConfigError(
            f"{subject}: {made_of} need at least {need / 1e9:,.1f} GB of {what}, {have / 1e9:,.1f} GB available"
        )
