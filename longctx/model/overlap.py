"""A second CUDA stream for the independent parts of a decode layer, forked inside a captured graph.

At batch 1 most kernels of a decode step are too small to fill the GPU (a 576 x 2048 GEMM, a top-k
over one row, an MoE of four experts), so two chains that do not depend on each other can run side
by side:
- a full layer's indexer (wq_b, its key's norm, rope and write, the logits, the top-k) and the new
  token's MLA row (kv_a_layernorm, rope, the write) beside the query's path (q_b_proj, rope, the absorbed
  W_UK): they read only the layer's input projections, and the sparse attention after them needs all of
  them. (Under HiSparse the row's write stays on the main stream: `after_write` copies it at once.);
- an MoE layer's shared experts beside the router and the routed experts: the combine that sums
  the routed slots waits for them (`moe_experts(join=...)`).

Only while a CUDA graph is being captured (`torch.cuda.is_current_stream_capturing()`): there the
fork and the join become edges of the graph and every allocation of the side stream comes from the
graph's pool, whose blocks the replay never hands to anything else. Eager passes (prefill, the
graphs' warm-up, shapes outside the buckets, CPU) run everything in order on one stream, so a graph
replay equals an eager step, which the GPU check compares.

The rule that keeps the capture race-free: every tensor the side stream reads stays referenced
until the join (the callers hold them in locals), and what it makes is consumed on the main stream
only after the join; the next fork waits for everything the main stream queued before it.

`LONGCTX_SIDE_STREAM=0` keeps the layers on one stream (A/B benches).

`LONGCTX_SIDE_PRIORITY=1` gives the side stream the device's highest stream priority. PyTorch instantiates
graphs with `cudaGraphInstantiateFlagUseNodePriority`, so a kernel captured on it keeps that priority in the
replay: when the query's path's GEMMs (q_b_proj, the routed experts) hold the SMs, the block scheduler hands
the next free SM to the side chain's waiting blocks first. That chain (the indexer's logits and top-k) is the
longer one on a full layer, but on the H200 it started no earlier with the priority than without
(bench/results/s59.md), so the default is the default priority.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENABLED = os.environ.get("LONGCTX_SIDE_STREAM", "1").strip() != "0"
HIGH_PRIORITY = os.environ.get("LONGCTX_SIDE_PRIORITY", "0").strip() not in ("", "0")


class SideStream:
    """The side stream of one device; `fork()` runs its block there when `active()`, else in place."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # a lower number is a higher priority; torch maps one below the range to the highest
            self.stream = torch.cuda.Stream(device, priority=-(1 << 10) if HIGH_PRIORITY else 0)
        self.forks = 0  # blocks run on the side stream (counted at capture: once per captured graph)

    def active(self) -> bool:
        return self.stream is not None and torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block on the side stream after everything the main stream queued so far."""
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.forks += 1
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """The main stream waits for what the side stream queued so far."""
        assert self.stream is not None
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def side_stream(device: torch.device) -> SideStream | None:
    """A side stream for a CUDA device's decode graphs (None on other devices or when switched off)."""
    return SideStream(device) if ENABLED and device.type == "cuda" else None
