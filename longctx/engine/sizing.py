"""Sizing an engine before anything is built: its device, its size arguments, its KV pages and the room
for them.

Everything here runs in `Engine.__init__` before a weight is read or a pool allocated, so a device this
machine lacks, a size that is not a positive integer, or a model and KV cache that cannot fit are one
line each instead of a traceback from deep in the load (or a host slowly filled page by page).
"""

from __future__ import annotations

import torch

from longctx.config import ModelConfig, is_int
from longctx.engine.worker import keeps_fp8
from longctx.errors import ConfigError
from longctx.kv_kinds import KVKinds, kv_bytes_per_token
from longctx.kvstore.pool import PagedKVPool, host_kv_spec
from longctx.memory import available_memory, check_parts, check_room
from longctx.model.params import loaded_weight_bytes

PAGE_SIZE = 64


def resolve_device(device: str) -> torch.device:
    """`auto` (CUDA when present), `cpu`, `cuda` or `cuda:N` of a device this machine has; ConfigError else."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):  # ('meta' failed as a checkpoint missing every tensor)
        raise ConfigError.about("device", repr(device), "must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError.about("device", repr(device), "CUDA is not available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError.about("device", repr(device), f"there are {torch.cuda.device_count()} CUDA devices")
    return dev


def check_sizes(sizes: dict[str, object], optional: dict[str, object]) -> None:
    """Each value a positive int (not a bool), those of `optional` None too; checked before anything is
    loaded (0 or -1 running slots left generate() waiting forever, a float page count failed deep in
    the pool's allocation, kv_pages=0 was read as the default)."""
    for name, v in {**sizes, **optional}.items():
        if not (is_int(v) and v >= 1) and not (v is None and name in optional):
            raise ConfigError.about(name, repr(v), "must be a positive integer")


def default_pages(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_kinds: KVKinds,
    max_context: int,
    pp: int = 1,
    tp: int = 1,
) -> int:
    """The KV pages an engine allocates when `kv_pages` is not given."""
    if device.type == "cuda":
        layers = range(cfg.num_hidden_layers)
        per_token = PagedKVPool.bytes_per_token(cfg, layers, kv_kinds, dtype)
        # weights are not loaded yet: half the free memory, and no more than 80% of what this GPU's
        # share of the weights leaves (weights past half the GPU were refused by the room check)
        free = available_memory(device)
        fp8 = keeps_fp8(cfg, device)
        share = loaded_weight_bytes(cfg, layers, dtype.itemsize, fp8, tp) // pp
        budget = max(0, min(free // 2, int((free - share) * 0.8)))
        return max(16, min(budget // (per_token * PAGE_SIZE), 2 * max_context // PAGE_SIZE + 64))
    # CPU: room for a few requests of a modest context
    return max(64, min(max_context, 1 << 16) * 2 // PAGE_SIZE)


def check_engine_room(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_kinds: KVKinds,
    *,
    num_pages: int,
    default: bool,
    pp: int,
    tp: int,
    max_running: int,
    max_context: int,
    hisparse_device_tokens: int | None,
    layer_split: list[int] | None = None,
) -> None:
    """Refuse a model and KV pools this machine cannot hold before any is loaded or allocated
    (kv_pages=10**9 died in the allocation with a traceback, or took the host's memory page by page;
    weights past a GPU's memory died mid-load). Counted, per TP rank of each stage (the split the
    stages will use): its share of the weights as they are loaded (`loaded_weight_bytes`: the model
    dtype, or block-fp8 with its scales on CUDA) and its device pool at num_pages + 1 pages (one pads
    captured batches): the stage's MLA rows and index keys (under HiSparse the index keys and the slot
    buffers: the MLA rows are in its host pool); and the host pools (HiSparse's; one per stage under
    pp or tp > 1); and on the last stage the sampler's penalties pools for max_running requests. A lower
    bound: activations, CUDA graphs and the allocator's slack come on top, so
    only what cannot fit at all is refused. `default`: num_pages is `default_pages`' (no kv_pages)."""
    N = hisparse_device_tokens
    slots = (num_pages + 1) * PAGE_SIZE
    n = cfg.num_hidden_layers
    if pp == 1:
        stages = [(0, n)]
    else:
        from longctx.stages.runtime import stage_layers

        stages = stage_layers(cfg, pp, tp, num_pages, PAGE_SIZE, layer_split)
    blocks = 0
    if N:
        from longctx.hisparse.cache import preallocated_requests

        blocks = preallocated_requests(max_running, num_pages, PAGE_SIZE, N, max_context)
    fp8 = keeps_fp8(cfg, device)
    ranks = []  # (weights, device KV, the sampler's state) of one TP rank of each stage
    for a, b in stages:
        mla, index = kv_bytes_per_token(cfg, range(a, b), kv_kinds, dtype)
        kv = slots * index + (1 + blocks * N) * mla if N else slots * (mla + index)
        # the last stage's penalties pools (`sampling.Penalties`: int32 counts and a uint8 prompt set over
        # the vocabulary per penalised request): up to twice max_running slots as they double, and the old
        # pools while one is copied
        sampler = 3 * max_running * cfg.vocab_size * 5 if b == n else 0
        ranks.append((loaded_weight_bytes(cfg, range(a, b), dtype.itemsize, fp8, tp), kv, sampler))
    world = pp * tp
    host = host_kv_spec(cfg, range(n), slots, kv_kinds, dtype).nbytes if N or world > 1 else 0
    cap = f" with hisparse_device_tokens={N}" if N else ""
    subject = f"the model does not fit{cap}" if default else f"kv_pages={num_pages}{cap}"
    kv_name = "the default KV cache" if default else "the KV cache"
    if device.type == "cuda":
        # the stage ranks' GPUs (and under torchrun their nodes) taken to be alike: the most loaded
        # rank against this GPU's free memory, a node's share of the host pools against its RAM
        weights, kv, sampler = max(ranks, key=sum)
    else:
        weights = tp * sum(w for w, _, _ in ranks)
        kv = tp * sum(k for _, k, _ in ranks) + host
        sampler = sum(x for _, _, x in ranks)
    parts = {"the weights": weights, kv_name: kv}
    if sampler:
        parts[f"the penalties' state of {max_running} requests"] = sampler
    if device.type == "cuda":
        per_gpu = " per GPU" if world > 1 else ""
        check_parts(subject, parts, f"GPU memory{per_gpu}", available_memory(device))
        nodes = -(-world // torch.cuda.device_count())
        check_room(f"{subject}: {kv_name}", host // nodes, "host memory", available_memory())
    else:
        check_parts(subject, parts, "memory", available_memory())
