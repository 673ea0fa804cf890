"""A checkpoint's `generation_config.json`: the end-of-text tokens and the sampling defaults its authors ship.

transformers' `generate` starts from this file; so does vLLM's server (`--generation-config auto`, its default):
the sampling fields a request leaves out take the file's values, and its EOS ids end a generation too. longctx
does the same: the engine stops on the union of config.json's and this file's `eos_token_id`, and `longctx
serve` (unless `--generation-config none`) takes `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` and `max_new_tokens` (as the default `max_tokens`) from it for requests that do not set
them. Other fields (`do_sample`, `num_beams`, ...) are not read, as vLLM reads none of them either.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from longctx.errors import CheckpointError

FILE = "generation_config.json"
# field -> (type, lowest, highest, lowest excluded): what a request could send for it
_SAMPLING: dict[str, tuple[type, float, float, bool]] = {
    "temperature": (float, 0.0, 100.0, False),
    "top_p": (float, 0.0, 1.0, True),
    "top_k": (int, -1, 2**31 - 1, False),
    "min_p": (float, 0.0, 1.0, False),
    "repetition_penalty": (float, 0.0, 100.0, True),
    "max_new_tokens": (int, 1, 2**63 - 1, False),
}


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def sampling(self) -> dict[str, Any]:
        """The sampling defaults the file sets (the fields it leaves out are absent)."""
        return {k: v for k, v in asdict(self).items() if k in _SAMPLING and v is not None}


def load_generation_config(model_dir: str | Path) -> GenerationDefaults:
    """The defaults of `model_dir`'s generation_config.json (none without one); a CheckpointError (one line
    naming the file and field) for one that is not JSON or holds a value a request could not."""
    p = Path(model_dir) / FILE
    if not p.is_file():
        return GenerationDefaults()
    try:
        d = json.loads(p.read_bytes())
    except ValueError as e:
        raise CheckpointError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{p} is not a JSON object")
    out: dict[str, Any] = {}
    for name, (kind, lo, hi, open_lo) in _SAMPLING.items():
        v = d.get(name)
        if v is None:
            continue
        ok = isinstance(v, int | float) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
        if ok and isinstance(v, float) and not math.isfinite(v):
            ok = False
        if not ok or not (lo < v if open_lo else lo <= v) or v > hi:
            raise CheckpointError(f"{p}: {name} {v!r} is not a {kind.__name__} in its range")
        out[name] = kind(v)
    eos = d.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    if eos is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{p}: eos_token_id must be a token id or a list of them")
    return GenerationDefaults(**out, eos_token_ids=tuple(ids))
