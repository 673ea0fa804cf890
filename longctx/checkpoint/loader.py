"""Read safetensors checkpoints in transformers' layout, lazily, one stage's layers at a time.

`CheckpointReader` maps tensor names to files (single `model.safetensors`, or the shards named by
`model.safetensors.index.json`) and opens each file with safetensors' mmap on first use, so a
pipeline stage reads only the bytes of its own layers. `iter_weights` yields the tensors a layer
range needs (dequantising FP8 on the CPU unless asked not to); `validate_checkpoint` checks a
whole directory against its config from the safetensors headers alone (no tensor data read).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from longctx.checkpoint.fp8 import DEFAULT_BLOCK, FP8_DTYPE, dequantize_fp8_block
from longctx.checkpoint.layout import (
    SCALE_SUFFIX,
    Shape,
    expected_weights,
    keeps_fp32,
    layer_of,
    resolve_parts,
    scale_shape,
)
from longctx.config import ModelConfig
from longctx.errors import CheckpointError

__all__ = ["CheckpointReader", "CheckpointSummary", "expected_weights", "iter_weights", "validate_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FP8_STR = "F8_E4M3"  # safetensors' dtype string for float8_e4m3fn


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


class CheckpointReader:
    """Lazy name -> tensor access over a directory of safetensors files.

    Opening reads only the index (or each file's header when there is no index); tensor data is
    read on `get`. Errors are `CheckpointError`s naming the missing file or tensor.
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model directory not found: {self.dir}")
        self._handles: dict[str, Any] = {}
        index = self.dir / INDEX_FILE
        if index.exists():
            try:  # (bytes: a file that is not UTF-8 failed in read_text, a traceback)
                weight_map = json.loads(index.read_bytes())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:  # (JSONDecodeError, UnicodeDecodeError)
                raise CheckpointError(f"{index} is not a safetensors index: {_one_line(e)}") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):  # (a list or numbers failed as an AttributeError / TypeError, a traceback)
                raise CheckpointError(
                    f"{index} is not a safetensors index: weight_map must map tensor names to files"
                )
            for f in sorted(set(weight_map.values())):
                if not (self.dir / f).exists():
                    raise CheckpointError(f"shard {f} named by {INDEX_FILE} is missing from {self.dir}")
            self._where: dict[str, str] = dict(weight_map)
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"no safetensors weights in {self.dir} (expected {SINGLE_FILE} or {INDEX_FILE})"
                )
            self._where = {}
            for f in files:
                for k in self._open(f).keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    self._where.setdefault(k, f)

    # ---- access -------------------------------------------------------------------------------
    def _open(self, file: str) -> Any:
        h = self._handles.get(file)
        if h is None:
            try:
                h = safe_open(str(self.dir / file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types with long texts
                raise CheckpointError(f"cannot read {self.dir / file}: {_one_line(e)}") from None
            self._handles[file] = h
        return h

    def names(self) -> list[str]:
        """All tensor names in the checkpoint (index order, or file then header order)."""
        return list(self._where)

    def files(self) -> list[str]:
        return sorted(set(self._where.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str) -> Any:
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint is missing {name}")
        try:
            return self._open(file).get_slice(name)
        except CheckpointError:
            raise
        except Exception:
            raise CheckpointError(f"{file} does not hold {name}, though {INDEX_FILE} says it does") from None

    def shape(self, name: str) -> Shape:
        """Shape from the file header, without reading data."""
        return tuple(int(x) for x in self._slice(name).get_shape())

    def is_fp8(self, name: str) -> bool:
        return self._slice(name).get_dtype() == _FP8_STR

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (dtype unchanged), read from the mmapped file."""
        self._slice(name)  # the one-line errors for a missing name or shard entry
        return self._open(self._where[name]).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_shape(name: str, found: Shape, want: Shape) -> None:
    if tuple(found) != tuple(want):
        raise CheckpointError(
            f"{name} has shape {list(found)} in the checkpoint, expected {list(want)} from the config"
        )


def _scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def iter_weights(
    model_dir: str | Path | CheckpointReader,
    cfg: ModelConfig,
    layers: Iterable[int] | None = None,
    dtype: torch.dtype = torch.float32,
    keep_fp8: bool = False,
    embed: bool | None = None,
    head: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for the given decoder layers (default: all), on the CPU.

    Names and order are `expected_weights(cfg, layers, embed, head)`; `embed`/`head` default to
    whether the range includes the model's first/last layer. Tensors are cast to `dtype`, except
    the router's `mlp.gate.weight` and `e_score_correction_bias`, which stay float32 as in the
    reference. FP8 weights are dequantised with their `_scale_inv` block scales unless
    `keep_fp8`, which yields the float8_e4m3fn weight followed by `<name>_scale_inv` (float32).
    With `tie_word_embeddings`, `head` without `embed` also yields `lm_head.weight` (the embedding's
    tensor: a stage holding both shares one parameter, `CausalLM.tie_weights`).
    Shape or presence mismatches raise a one-line `CheckpointError`.
    """
    block: tuple[int, int] = cfg.quant_block or DEFAULT_BLOCK
    own = not isinstance(model_dir, CheckpointReader)
    r = model_dir if isinstance(model_dir, CheckpointReader) else CheckpointReader(model_dir)
    try:
        for name, shape in expected_weights(cfg, layers, embed, head).items():
            t = r.get(name)
            _check_shape(name, tuple(t.shape), shape)
            if t.dtype == FP8_DTYPE:
                sname = _scale_name(name)
                if sname not in r:
                    raise CheckpointError(f"{name} is fp8 but the checkpoint has no {sname}")
                s = r.get(sname)
                _check_shape(sname, tuple(s.shape), scale_shape(shape, block))
                if keep_fp8:
                    yield name, t
                    yield sname, s.float()
                    continue
                t = dequantize_fp8_block(t, s, block, dtype)
            yield name, t.to(torch.float32 if keeps_fp32(name) else dtype)
        _, want_embed, want_head = resolve_parts(cfg, layers, embed, head)
        if want_head and not want_embed and cfg.tie_word_embeddings:
            yield "lm_head.weight", r.get("model.embed_tokens.weight").to(dtype)
    finally:
        if own:
            r.close()


@dataclass(frozen=True)
class CheckpointSummary:
    """What `validate_checkpoint` found."""

    num_tensors: int  # expected tensors present (scales not counted)
    num_params: int
    num_fp8: int  # weights stored as float8_e4m3fn with block scales
    files: tuple[str, ...]


def _ignored(name: str, cfg: ModelConfig) -> bool:
    # Like transformers: MTP layers (index >= num_hidden_layers) and rotary buffers are not weights.
    layer = layer_of(name)
    if layer is not None and layer >= cfg.num_hidden_layers:
        return True
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def validate_checkpoint(model_dir: str | Path, cfg: ModelConfig | None = None) -> CheckpointSummary:
    """Check a model directory against its config from headers alone; raise a one-line error.

    Checks: config.json (when `cfg` is None), every shard the index names, every expected tensor
    present with the expected shape, fp8 weights have correctly shaped `_scale_inv` and a
    `quantization_config`, and no unexpected tensors (MTP layers are ignored, as transformers does).
    """
    d = Path(model_dir)
    if cfg is None:
        if not (d / "config.json").exists():
            raise CheckpointError(f"no config.json in {d}")
        cfg = ModelConfig.from_json(d)
    want = expected_weights(cfg)
    block: tuple[int, int] = cfg.quant_block or DEFAULT_BLOCK
    with CheckpointReader(d) as r:
        have = set(r.names())
        missing = [n for n in want if n not in have]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint is missing {missing[0]}{more}")
        fp8: set[str] = set()
        params = 0
        for name, shape in want.items():
            _check_shape(name, r.shape(name), shape)
            params += int(torch.Size(shape).numel())
            if r.is_fp8(name):
                sname = _scale_name(name)
                if cfg.quant_block is None:
                    raise CheckpointError(f"{name} is fp8 but config.json has no quantization_config")
                if sname not in have:
                    raise CheckpointError(f"{name} is fp8 but the checkpoint has no {sname}")
                _check_shape(sname, r.shape(sname), scale_shape(shape, block))
                fp8.add(sname)
        for name in r.names():
            if name not in want and name not in fp8 and not _ignored(name, cfg):
                raise CheckpointError(
                    f"checkpoint has unexpected tensor {name} (not in the {cfg.model_type} config)"
                )
        return CheckpointSummary(len(want), params, len(fp8), tuple(r.files()))
