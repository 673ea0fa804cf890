"""Seeds a user gives (training's and init-model's --seed, ruler's --seed, a request's seed): integers in
[0, 2**63), the HTTP server's int64 range.

torch's CPU generator keeps only the low 32 bits of its seed (mt19937 seeds from a uint32), so seeds equal
modulo 2**32 drew the same numbers on the CPU; a seed reaches a torch generator through `generator_seed`.
"""

from __future__ import annotations

from typing import TypeGuard

from longctx.config import int_text
from longctx.errors import UsageError

SEED_RANGE = "an integer in [0, 2**63)"  # (for messages)
MASK63 = 2**63 - 1
_MASK64 = 2**64 - 1


def is_seed(v: object) -> TypeGuard[int]:
    """An int (not a bool) in [0, 2**63)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MASK63


def seed_arg(name: str, text: str | None) -> int:
    """The seed flag of dest `name` given as `text` (ruler's and init-model's --seed): an integer as
    `int_text` reads one, in [0, 2**63); other text is refused with that range too, as a number out of it
    is."""
    try:
        seed = int_text(text)
    except ValueError:
        raise UsageError.about(name, repr(text), f"must be {SEED_RANGE}") from None
    if not is_seed(seed):
        raise UsageError.about(name, seed, f"must be {SEED_RANGE}")
    return seed


def generator_seed(seed: int) -> int:
    """`seed` (in [0, 2**64)) as a torch generator's seed whose low 32 bits depend on all of it: a seed below
    2**32 is itself (the streams it drew before), a larger one is mixed (splitmix64's finaliser, a bijection
    of 64-bit values) and kept below 2**63, so seeds equal modulo 2**32 draw different numbers on the CPU."""
    if seed < 2**32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & MASK63
