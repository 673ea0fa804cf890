"""What the driver (the Engine's process) and the stage processes tell each other.

Driver -> every rank of every stage (in order, one inbox per rank): `RunPlan`, `Release`, `StatsRequest`
(TP rank 0 of each stage only), `Shutdown`. Ranks -> driver (one outbox): `Ready`, `Result` (last
stage, TP rank 0), `StageStats`, `Failed`. All are small frozen dataclasses, pickled; results carry
their logits pickled by value (`payload`), never as shared-memory tensor handles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longctx.config import ModelConfig
from longctx.engine.plan import BatchPlan
from longctx.kv_kinds import KVKinds


@dataclass(frozen=True)
class StageSpec:
    """Everything one stage process needs to build its shard and join the process groups."""

    model_dir: str
    cfg: ModelConfig
    pp: int
    tp: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]  # [start, stop)
    device: str  # "cpu" | "cuda" (the rank picks its local GPU)
    dtype: str  # torch dtype name, e.g. "float32"
    kv_kind: str | KVKinds  # the pools' kind per layer
    num_pages: int
    page_size: int
    use_triton: bool
    prefill_form: str
    hisparse_device_tokens: int | None
    store_host: str  # TCPStore of the rendezvous ("" when the process group already exists)
    store_port: int
    num_threads: int = 0  # torch intra-op threads on CPU (0: leave torch's default)
    # HiSparse: the longest request and how many run at once (its per-request tables are sized by them)
    max_context: int | None = None
    max_running: int = 1

    @property
    def rank(self) -> int:
        return self.stage * self.tp + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pp * self.tp


@dataclass(frozen=True)
class RunPlan:
    seq: int
    plan: BatchPlan


@dataclass(frozen=True)
class Release:
    """Requests that finished or were aborted: caches with per-request state (HiSparse) free it."""

    rids: tuple[str, ...]


@dataclass(frozen=True)
class StatsRequest:
    seq: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class Result:
    seq: int
    payload: bytes  # pickle of the BatchResult (tensors by value)


@dataclass(frozen=True)
class StageStats:
    seq: int
    stage: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    rank: int
    stage: int
    tp_rank: int
    message: str
    # the failure is a peer's loss seen on a collective (a consequence: another rank's report names the cause)
    consequence: bool = False
