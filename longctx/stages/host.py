"""A stage's host KV pool: one /dev/shm file per stage per node, shared by the stage's TP ranks.

`open_stage_host_pool` runs the lifecycle of `longctx.kvstore.host_pool` over the stage's gloo
group: TP rank 0 creates the file (O_EXCL, 0600, fresh name) and broadcasts the name, every other
rank maps it, barrier, rank 0 unlinks it (the mappings stay; nothing outlives a crash), and on
CUDA every rank registers its mapping with cudaHostRegister.

`HostBackedKV` wraps the stage's device KV cache: after a layer writes its new rows, TP rank 0
copies exactly those rows (the plan's slot mapping) device -> host. On CUDA the copy runs on a
side stream (off the critical path) and `end_step` waits for it; on CPU it is a plain copy. Other
ranks read the host rows only after the step's barrier (`end_step(barrier=True)`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from longctx.kernels.swap import swap_out_scatter
from longctx.kvstore.host_pool import HostKVLayout, HostKVSpec, HostPool
from longctx.model.context import ForwardContext


def open_stage_host_pool(
    spec: HostKVSpec,
    stage: int,
    tp_rank: int,
    src_rank: int,
    group: Any,
    cuda: bool,
) -> HostKVLayout:
    """Create (TP rank 0) or attach (others) the stage's pool; returns it bound to `spec`.

    `group` is the stage's gloo group (None when tp == 1), `src_rank` the global rank of TP rank 0.
    """
    name: list[str | None] = [None]
    pool: HostPool | None = None
    if tp_rank == 0:
        pool, name[0] = HostPool.create(spec.nbytes, tag=f"s{stage}")
    try:
        if group is not None:
            dist.broadcast_object_list(name, src=src_rank, group=group)
        if pool is None:
            assert name[0] is not None
            pool = HostPool.attach(name[0], spec.nbytes)
        if group is not None:
            dist.barrier(group=group)
        if tp_rank == 0:
            pool.unlink()
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    if cuda:
        pool.register_cuda()
    return HostKVLayout(pool, spec)


class HostBackedKV:
    """A device `KVCache` whose new MLA rows TP rank 0 also writes to the stage's host pool.

    Everything else (pools, resolve, attributes such as `kind`) is the wrapped cache's.
    """

    def __init__(self, inner: Any, layout: HostKVLayout, writer: bool, use_triton: bool) -> None:
        self.inner, self.layout, self.writer = inner, layout, writer
        self.backend = "triton" if use_triton else "torch"
        self.backup_bytes = 0
        self._stream: Any = None
        self._host = {i: layout.layer_view(i) for i in range(layout.spec.layer_start, layout.spec.layer_end)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def after_write(self, layer: int, ctx: ForwardContext) -> None:
        self.inner.after_write(layer, ctx)
        if not self.writer:
            return
        dev = self.inner.mla_pool(layer)
        dev = dev.view(torch.uint8).view(dev.shape[0], -1)  # [slots, row bytes]
        host = self._host[layer]
        slots = ctx.slot_mapping
        if dev.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(dev.device)
            self._stream.wait_stream(torch.cuda.current_stream(dev.device))
            with torch.cuda.stream(self._stream):
                swap_out_scatter(host, slots, dev, slots, backend=self.backend)
            slots.record_stream(self._stream)
        else:
            swap_out_scatter(host, slots, dev, slots, backend="torch")
        self.backup_bytes += slots.numel() * host.shape[1]

    def end_step(self, group: Any = None) -> None:
        """The step's rows are on the host (writer) and, with `group`, every rank knows it."""
        if self._stream is not None:
            self._stream.synchronize()
        if group is not None:
            dist.barrier(group=group)

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.inner.stats()) if hasattr(self.inner, "stats") else {}
        s["host_backup_bytes"] = self.backup_bytes
        return s

    def nbytes(self) -> int:
        return int(self.inner.nbytes()) if hasattr(self.inner, "nbytes") else 0

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
        self._host = {}
        self.layout.pool.close()
