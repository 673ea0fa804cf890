"""`longctx init-model`: write a random checkpoint in transformers' on-disk layout.

The directory holds config.json, generation_config.json, tokenizer.json + tokenizer_config.json
and safetensors with per-expert Hugging Face names (`expected_weights`), so both longctx and
transformers' `from_pretrained` load it. Tensors are generated one at a time, each from its own
generator seeded by (seed, name), so memory stays at one shard and a tensor's values do not
depend on sharding, dtype choice of other tensors, or which layers are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx.checkpoint.layout import (
    SCALE_SUFFIX,
    Shape,
    expected_weights,
    is_fp8_weight,
    keeps_fp32,
    scale_shape,
)
from longctx.config import DTYPE_NAMES, ModelConfig, dtype_arg, dtype_name, resolve_config
from longctx.errors import CheckpointError, ConfigError
from longctx.memory import available_memory, check_room
from longctx.paths import nearest_existing
from longctx.seeds import seed_arg

if TYPE_CHECKING:
    import torch

# torch and safetensors are imported inside functions: `longctx --help` imports this module.
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
INDEX_FILE = "model.safetensors.index.json"  # the same names as longctx.checkpoint.loader
SINGLE_FILE = "model.safetensors"
_WRITTEN = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE)


def _generator(seed: int, name: str) -> torch.Generator:
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def random_tensor(name: str, shape: Shape, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    """The float32 value init-model writes for `name`.

    Linears: normal(0, std). Norm weights 1 + 0.1*randn, the indexer LayerNorm bias 0.1*randn and
    the router's e_score_correction_bias 0.05*randn: all deliberately non-trivial, so a consumer
    that forgets a norm scale, bias or correction term gets different numbers.
    """
    import torch

    x = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * x
    if name.endswith("k_norm.bias"):
        return 0.1 * x
    if name.endswith("e_score_correction_bias"):
        return 0.05 * x
    return std * x


def _stored_bytes(name: str, shape: Shape, dtype: torch.dtype, block: tuple[int, int] | None) -> int:
    n = math.prod(shape)
    if block is not None and is_fp8_weight(name):
        sm, sn = scale_shape(shape, block)
        return n + 4 * sm * sn
    if keeps_fp32(name):
        return 4 * n
    return n * dtype.itemsize


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    # Greedy in checkpoint order, so a stage's layers sit in few consecutive shards. A tensor
    # larger than max_bytes gets a shard of its own.
    shards: list[list[str]] = [[]]
    used = 0
    for name, b in sizes.items():
        if shards[-1] and used + b > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += b
    return shards


def _check_room(out: Path, sizes: dict[str, int], shards: list[list[str]], numel: int, freed: int) -> None:
    """Refuse a checkpoint this machine cannot hold before writing any of it (a huge config was a
    traceback at the first tensor too large to allocate, or a full disk hours in). In memory at once: at
    least the largest shard and the float32 values of the largest tensor (`numel` elements); on disk all
    of it, where the replaced files' `freed` bytes come back."""
    import shutil

    memory = max(sum(sizes[n] for n in shard) for shard in shards) + 4 * numel
    disk_dir = nearest_existing(out)
    check_room("this checkpoint", memory, "memory", available_memory())
    free = shutil.disk_usage(disk_dir).free + freed
    check_room("this checkpoint", sum(sizes.values()), f"disk space in {disk_dir}", free)


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    g: dict[str, Any] = {"_from_model_config": True, "eos_token_id": cfg.eos_token_id}
    if cfg.bos_token_id is not None:
        g["bos_token_id"] = cfg.bos_token_id
    if cfg.pad_token_id is not None:
        g["pad_token_id"] = cfg.pad_token_id
    return g


def init_random_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    fp8: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    std: float = 0.02,
    force: bool = False,
) -> Path:
    """Write a random checkpoint of `cfg` into `out_dir` and return the directory.

    `dtype` (default `cfg.torch_dtype`) is the storage dtype of all tensors except the router
    (always float32) and, with `fp8`, the quantised linear weights (float8_e4m3fn + float32
    `<name>_scale_inv` block scales, `quantization_config` in config.json). Shards hold at most
    `max_shard_bytes` (plus one oversized tensor at worst); one shard is written as
    `model.safetensors`, several with `model.safetensors.index.json`. A non-empty `out_dir` is
    refused unless `force`, which replaces the files a checkpoint consists of.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from longctx.checkpoint.fp8 import DEFAULT_BLOCK, FP8_DTYPE, quantize_fp8_block
    from longctx.checkpoint.tokenizer import save_tokenizer

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out} is not empty (use --force to overwrite)")
    # --force replaces only what a checkpoint consists of: stale shards would be read
    stale = [
        p
        for p in (out.iterdir() if out.exists() else ())
        if p.is_file() and (p.suffix == ".safetensors" or p.name in _WRITTEN)
    ]

    name = dtype_name(dtype if dtype is not None else cfg.torch_dtype)
    dt = getattr(torch, name)
    block: tuple[int, int] | None = (cfg.quant_block or DEFAULT_BLOCK) if fp8 else None
    disk_cfg = dataclasses.replace(cfg, quant_block=block, torch_dtype=name)

    want = expected_weights(cfg)
    sizes = {n: _stored_bytes(n, s, dt, block) for n, s in want.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    _check_room(out, sizes, shards, max(map(math.prod, want.values())), sum(p.stat().st_size for p in stale))
    for p in stale:
        p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    bar = tqdm(
        total=sum(sizes.values()),
        unit="B",
        unit_scale=True,
        desc="init-model",
        disable=not sys.stderr.isatty(),
    )
    with bar:
        for file, members in zip(names, shards):
            tensors: dict[str, torch.Tensor] = {}
            for name in members:
                w = random_tensor(name, want[name], seed, std)
                if block is not None and is_fp8_weight(name):
                    q, s = quantize_fp8_block(w, block)
                    assert q.dtype == FP8_DTYPE
                    tensors[name], tensors[name + SCALE_SUFFIX] = q, s
                    weight_map[name + SCALE_SUFFIX] = file
                else:
                    tensors[name] = w if keeps_fp32(name) else w.to(dt)
                weight_map[name] = file
                bar.update(sizes[name])
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    (out / "config.json").write_text(json.dumps(disk_cfg.to_hf_dict(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2) + "\n")
    save_tokenizer(cfg, out)
    return out


# ---- CLI ---------------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "init-model",
        help="write a random checkpoint (config, tokenizer, safetensors) for a model config",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--config", required=True, help="config.json path, model dir, or a name in configs/ (e.g. tiny)"
    )
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    p.add_argument("--seed", default="0", metavar="N", help="seed of the random weights (default 0)")
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=DTYPE_NAMES,
        default=None,
        help="storage dtype, or a short name of one: bf16, fp16, half, fp32, float (default: the config's)",
    )
    p.add_argument(
        "--fp8", action="store_true", help="store linear weights as fp8 e4m3 with 128x128 block scales"
    )
    p.add_argument(
        "--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES, help="bytes per safetensors shard"
    )
    p.add_argument("--init-std", type=float, default=0.02, help="std of the linear weights")
    p.add_argument("--force", action="store_true", help="overwrite the checkpoint files in a non-empty --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config)
    # read as `ruler --seed` reads its (`x` was argparse's usage error; any integer would do here: one range
    # for every seed a user gives)
    seed = seed_arg("seed", args.seed)
    if args.max_shard_bytes <= 0:
        raise ConfigError.about("max_shard_bytes", args.max_shard_bytes, "must be positive")
    if not (math.isfinite(args.init_std) and args.init_std >= 0):  # (nan wrote a checkpoint of NaN weights)
        raise ConfigError.about("init_std", args.init_std, "must be a finite number >= 0")
    out = init_random_checkpoint(
        cfg,
        args.out,
        seed=seed,
        dtype=args.dtype,
        fp8=args.fp8,
        max_shard_bytes=args.max_shard_bytes,
        std=args.init_std,
        force=args.force,
    )
    from longctx.checkpoint.loader import validate_checkpoint

    s = validate_checkpoint(out)
    fp8 = f", {s.num_fp8} fp8 weights" if s.num_fp8 else ""
    print(
        f"wrote {out}: {s.num_tensors} tensors, {s.num_params / 1e6:.2f}M params{fp8}, {len(s.files)} file(s)"
    )
    return 0
