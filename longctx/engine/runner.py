"""The engine's runner: what runs a step's plan on the model. `LocalRunner` for pp=1, tp=1 (the one
stage in the engine's own process), `longctx.stages.runtime.StageRuntime` otherwise (stage processes).

The engine drives either through `run` (a step and its tokens), `stats`, `release` and `close`, and a
`LocalRunner` also through `launch` / `resolve` (a step queued on the device, its tokens read back
later: overlapped decode). `build_runner` picks and builds one (for a `LocalRunner`: the model, its KV
pool, HiSparse's cache under a device-token cap, and its decode graphs); `device_fed` says when an
overlapped continuation can take its input tokens from the last step's samples still on the device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longctx.config import ModelConfig
from longctx.engine.cuda_graph import DecodeGraphs
from longctx.engine.plan import BatchPlan, BatchResult
from longctx.engine.sizing import PAGE_SIZE
from longctx.engine.worker import PendingRows, StageWorker, build_model, keeps_fp8
from longctx.kv_kinds import KVKinds
from longctx.kvstore.pool import PagedKVPool

if TYPE_CHECKING:
    from longctx.stages.runtime import StageRuntime


def device_fed(p: PendingRows) -> bool:
    """Whether a continuation of `p` can take its tokens from `p`'s device samples: every row
    sampled one token and none reads its logits back (logprobs) after the next replay."""
    return (
        p.toks is not None
        and len(p.last) == len(p.plan.rows)
        and all(r.logprobs is None for r in p.plan.rows)
    )


class LocalRunner:
    """pp=1, tp=1: the one stage runs in this process."""

    def __init__(self, worker: StageWorker, graphs: DecodeGraphs | None = None) -> None:
        self.worker = worker
        self.graphs = graphs

    def run(self, plan: BatchPlan) -> BatchResult:
        return self.resolve(self.launch(plan))

    def launch(self, plan: BatchPlan, tokens: torch.Tensor | None = None, sample: bool = True) -> PendingRows:
        """Queue the step on the device; its sampled tokens stay there until `resolve`. `tokens`:
        the rows' input tokens as a device tensor (the previous step's samples, not yet read).
        `sample=False` queues the forward and the logits only; `sample` draws the tokens later."""
        if self.graphs is not None and self.graphs.bucket(plan) is not None:
            return self.worker.finish_async(plan, None, self.graphs.run(plan, tokens), sample=sample)
        return self.worker.finish_async(plan, self.worker.forward(plan, tokens=tokens), sample=sample)

    def sample(self, pending: PendingRows, plan: BatchPlan) -> None:
        """Draw the tokens of a step launched with `sample=False`, its rows shaped as `plan` says (the
        same rows, with what each may draw now known)."""
        self.worker.sample_async(pending, plan)

    def resolve(self, pending: PendingRows) -> BatchResult:
        """Wait for a launched step and read its tokens back (the step's one host synchronisation)."""
        return BatchResult(pending.plan.step_id, self.worker.resolve(pending))

    def stats(self) -> dict[str, Any]:
        kv = self.worker.kv
        s = {"kv_bytes_device": kv.nbytes() if hasattr(kv, "nbytes") else 0}
        if hasattr(kv, "stats"):
            s.update(kv.stats())
        out: dict[str, Any] = {"stages": [s]}
        if self.graphs is not None:  # decode graphs: how often they were captured, replayed, dropped
            g = self.graphs
            out["cuda_graphs"] = {
                "buckets": len(g._graphs),
                "replays": g.replays,
                "recaptures": g.recaptures,
                "prep_s": g.prep_s,
                "launch_s": g.launch_s,
                # blocks of the layers captured on the side stream (longctx/model/overlap.py)
                "side_forks": g.side.forks if g.side is not None else 0,
            }
        out["token_wait_s"] = self.worker.token_wait_s
        return out

    def release(self, rids: list[str]) -> None:
        """Requests finished or aborted: the worker frees their penalty and per-request KV state."""
        self.worker.release(rids)

    def close(self) -> None:
        close = getattr(self.worker.kv, "close", None)
        if close is not None:
            close()


def build_runner(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_kinds: KVKinds,
    use_triton: bool,
    *,
    pp: int,
    tp: int,
    num_pages: int,
    prefill_form: str,
    cuda_graphs: bool | None,
    max_running: int,
    max_context: int,
    hisparse_device_tokens: int | None,
    layer_split: list[int] | None,
) -> LocalRunner | StageRuntime:
    """The engine's runner over `num_pages` KV pages: a `LocalRunner` for pp=1, tp=1, else the stage
    processes' `StageRuntime`."""
    if pp != 1 or tp != 1:
        from longctx.stages.runtime import StageRuntime

        return StageRuntime(
            model_dir,
            cfg,
            pp=pp,
            tp=tp,
            device=device,
            dtype=dtype,
            kv_kind=kv_kinds,
            num_pages=num_pages,
            use_triton=use_triton,
            prefill_form=prefill_form,
            hisparse_device_tokens=hisparse_device_tokens,
            layer_split=layer_split,
            max_context=max_context,
            max_running=max_running,
        )
    layers = range(cfg.num_hidden_layers)
    model = build_model(model_dir, cfg, layers, device, dtype, keeps_fp8(cfg, device))
    # one page more than the allocator hands out: padding rows of captured decode batches
    if hisparse_device_tokens:
        from longctx.hisparse.cache import HiSparseKVCache, preallocated_requests

        N = hisparse_device_tokens
        kv: Any = HiSparseKVCache(
            cfg,
            layers,
            num_pages + 1,
            kv_kinds,
            dtype,
            device,
            device_tokens=N,
            page_size=PAGE_SIZE,
            use_triton=use_triton,
            max_requests=preallocated_requests(max_running, num_pages, PAGE_SIZE, N, max_context),
            max_context=max_context,
        )
    else:
        kv = PagedKVPool(cfg, layers, num_pages + 1, kv_kinds, dtype, device, PAGE_SIZE)
    worker = StageWorker(model, kv, device, use_triton, prefill_form, PAGE_SIZE)
    if cuda_graphs is None:  # on by default on CUDA; LONGCTX_CUDA_GRAPHS=0 turns them off
        cuda_graphs = device.type == "cuda" and os.environ.get("LONGCTX_CUDA_GRAPHS", "1") != "0"
    graphs = None
    # the torch references read sizes back to the host, so on CUDA only the Triton path is captured
    # (on CPU nothing is captured: the static-buffer path runs as is)
    capturable = use_triton or device.type != "cuda"
    if cuda_graphs and capturable:
        graphs = DecodeGraphs(worker, max_context, dummy_page=num_pages, capture=device.type == "cuda")
    return LocalRunner(worker, graphs)
