"""Speed of one training step (`longctx.train.loop.train_step`: forward, backward, clip, AdamW, router
bias), dense and sparse stage, at several row lengths with the same tokens per step, for the trainer
as it is ("new") and as it was before its MoE and top-k selection lost their host syncs ("old":
`ReferenceTrainCausalLM`, the per-expert loop of `moe_experts_ref`, a selection loop over rows and
the masked sparse attention) and, with `--impls mask,gather`, the trainer with one form of its sparse
attention at every row length: the masked O(S^2) form (every key, the selection as a mask) or the
gathered O(S * top-k) one (the default, "auto", picks by length); `fused` is the gathered form with
the top-k selection made by the engine's fused indexer + top-k kernel (`--select fused`; its fp32
products as three TF32 tensor-core ones, the trainer's default, or exact with `fused_ieee`). Sparse
points also time one full layer's selection alone (`select s`). On a GPU each point also reports the
peak memory the step allocated.

The weights are the shipped WIP checkpoint's (trained routing: a fresh init sends most tokens to a
few experts, which flatters the old per-expert loop); rows come from the real data pipeline
(`make_batch`), and `data ms` is what one DataLoader worker spends building a batch on this host
(the trainer runs 4 on the GPU). Beside the wall time of `--steps` steps it counts, in one more
forward + backward, the aten ops (~ kernel launches on a GPU) and those of them that make the host
wait for the GPU (`.item()`, `nonzero`, `unique`, `bincount`, boolean-mask indexing): a step of this
9.7M-parameter model keeps the H200 busy only while the host runs ahead of it, so those counts are
the CPU's view of a GPU step. CPU timings are not: the CPU is bound by arithmetic, where the dense
MoE spends 4x the routed FLOPs.

    python -m bench.train_speed [--device auto] [--lengths 512,2048,8192] [--tokens 32768]
        [--steps 5] [--impls new,old] [--stages dense,sparse] [--weights DIR] [--out DIR]
    python -m bench.train_speed --device cpu --quick     # tiny config, random init: a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.config import ModelConfig  # noqa: E402
from longctx.model.indexer import local_window_bound  # noqa: E402
from longctx.model.moe import MoE  # noqa: E402
from longctx.model.ops import op  # noqa: E402
from longctx.train.checkpoint import load_model_weights  # noqa: E402
from longctx.train.data import Batch, DataConfig, make_batch  # noqa: E402
from longctx.train.loop import (  # noqa: E402
    NEVER,
    TrainConfig,
    build_optimizer,
    compute_loss,
    resolve_device,
    train_step,
)
from longctx.train.model import _SELECT_ELEMS, TrainCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WIP = ROOT / "models-shipped" / "retrieval-wip"


class ReferenceTrainCausalLM(TrainCausalLM):
    """The trainer's model before the sync-free MoE, the batched selection and the gathered sparse
    attention (same function): per-expert MoE loop, per-row selection, masked dense attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.sparse_attention = "mask"

    @torch.no_grad()
    def _select(
        self, qi: torch.Tensor, ki: torch.Tensor, wi: torch.Tensor, topk: int, shift: int = 0
    ) -> torch.Tensor:
        B, S, Hi, D = qi.shape
        topk_fn = op("topk", "topk_indices", False)
        pos = torch.arange(S, device=qi.device)
        bound = local_window_bound(pos, shift)
        out = torch.empty(B, S, topk, dtype=torch.long, device=qi.device)
        step = max(1, _SELECT_ELEMS // (Hi * S))
        for b in range(B):
            for s0 in range(0, S, step):
                s1 = min(S, s0 + step)
                sc = torch.relu(qi[b, s0:s1].reshape(-1, D) @ ki[b].T).view(s1 - s0, Hi, S)
                logits = (sc * wi[b, s0:s1, :, None]).sum(1)
                logits.masked_fill_(pos[None, :] > bound[s0:s1, None], float("-inf"))
                out[b, s0:s1] = topk_fn(logits, topk, bound[s0:s1] + 1)
        return out

    def _moe(self, moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        with torch.autocast(device_type=x.device.type, enabled=False):
            ids, w = op("moe", "moe_router", False)(
                x.float(), moe.gate.weight, moe.gate.e_score_correction_bias, c.num_experts_per_tok,
                c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
            )  # fmt: skip
        y = op("moe", "moe_experts", False)(
            x, ids, w, moe.experts.gate_up_proj, moe.experts.down_proj, "silu"
        )
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(x)
        return y, torch.bincount(ids.flatten(), minlength=c.n_routed_experts).detach()


# aten ops that launch nothing on a GPU (views, metadata, allocation)
_FREE = {
    "view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "t",
    "transpose", "permute", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias",
    "reshape", "view_as", "resolve_conj", "resolve_neg", "unfold", "empty_like", "sym_size",
    "sym_stride", "sym_numel", "dim", "size", "stride", "detach_", "is_same_size", "contiguous",
}  # fmt: skip
# ops whose CUDA kernels read a result back to the host (output sizes or values it decides on)
_SYNC = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "bincount",
         "masked_select", "repeat_interleave"}  # fmt: skip
_INDEX = {"index", "index_put", "index_put_", "_index_put_impl_"}  # boolean indices run a nonzero


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name not in _FREE:
            self.ops[name] += 1
        boolean_index = name in _INDEX and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ())
        )
        if name in _SYNC or boolean_index:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_select(model: TrainCausalLM, mcfg: ModelConfig, batch: Batch, device: torch.device) -> float:
    """Seconds of one full layer's top-k selection for the batch's shape, as the model makes it
    (`select_form`; random fp32 indexer queries, keys and weights; median of 3 after one warm-up):
    times the full layers, it is the selection's share of a sparse step."""
    B, S = batch.ids.shape
    g = torch.Generator(device=device).manual_seed(0)
    Hi, D = mcfg.index_n_heads, mcfg.index_head_dim
    qi = torch.randn(B, S, Hi, D, generator=g, device=device)
    ki = torch.randn(B, S, D, generator=g, device=device)
    wi = torch.rand(B, S, Hi, generator=g, device=device)
    times = []
    for i in range(4):
        _sync(device)
        t0 = time.perf_counter()
        model._selection(qi, ki, wi, mcfg.index_topk)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def measure(
    impl: str,
    mcfg: ModelConfig,
    weights: str | None,
    batch: Batch,
    sparse: bool,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    """Seconds per step (median of `steps`, after two warm-up steps); aten ops and syncs of one forward +
    backward."""
    model = (ReferenceTrainCausalLM if impl == "old" else TrainCausalLM)(mcfg)
    if impl in ("mask", "gather"):  # the trainer with one form of the sparse attention at every length
        model.sparse_attention = impl
    if impl in ("fused", "fused_ieee"):  # gathered attention over the engine's fused indexer + top-k
        model.sparse_attention, model.select_form = "gather", "fused"
        model.select_dot = "ieee" if impl == "fused_ieee" else "tf32x3"
    if weights:
        load_model_weights(model, weights, torch.device("cpu"))
    else:
        model.init_weights(0)
    model.to(device).train()
    cfg = TrainConfig(dense_warmup_steps=0 if sparse else NEVER, warmup_steps=1)
    opt = build_optimizer(model, cfg, device)
    if device.type == "cuda" and impl != "old":
        batch = batch.pin_memory()  # as the trainer's DataLoader now delivers it
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(2):
        train_step(model, opt, batch, cfg, i, device)
    times = []
    for i in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        train_step(model, opt, batch, cfg, 2 + i, device)
        _sync(device)
        times.append(time.perf_counter() - t0)
    with _Count() as count:  # the model's part: off the GPU, AdamW runs per parameter and reads .item()s
        loss, _, _ = compute_loss(model, batch, cfg, 2 + steps, device)
        loss.backward()
    _sync(device)
    s = sorted(times)[len(times) // 2]
    select_s = _time_select(model, mcfg, batch, device) if sparse and impl != "old" else None
    return {
        "s_per_step": s,
        "select_s": select_s,
        "tokens_per_s": batch.ids.numel() / s,
        "ops": sum(count.ops.values()),
        "syncs": sum(count.syncs.values()),
        "sync_ops": dict(count.syncs),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--config", default=str(ROOT / "configs" / "retrieval.json"))
    # trained routing: a fresh init sends most tokens to a few experts, which flatters the old MoE loop
    ap.add_argument("--weights", default=str(WIP), help="checkpoint to start from ('' : random init)")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per point")
    ap.add_argument(
        "--impls",
        default="new,old",
        help="new (the trainer: sparse attention 'auto'), old (before the sync-free step), mask / "
        "gather (the trainer with that form of the sparse attention at every length), fused (gather, "
        "with the selection by the engine's fused indexer + top-k kernel, tf32x3 products), fused_ieee (the "
        "same with exact fp32 products)",
    )
    ap.add_argument("--stages", default="dense,sparse")
    ap.add_argument("--quick", action="store_true", help="tiny config, 512-token rows, 1024 a step")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.config, args.lengths, args.weights = str(ROOT / "configs" / "tiny.json"), "512", ""
        args.tokens, args.steps = 1024, 1
    device = resolve_device(args.device)
    if device.type == "cuda":  # as the trainer sets them
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    mcfg = ModelConfig.from_json(args.config)
    impls = args.impls.split(",")
    bad = [i for i in impls if i not in ("new", "old", "mask", "gather", "fused", "fused_ieee")]
    if bad:
        print(f"train_speed: unknown --impls {bad}: new, old, mask, gather, fused, fused_ieee")
        return 2
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "config": args.config,
        "weights": args.weights or "random init",
        "tokens_per_step": args.tokens,
        "rows": [],
    }
    lines = [
        "| stage | S | B | data ms | "
        + " | ".join(f"{i} s/step | {i} tok/s | {i} ops | {i} syncs | {i} select s" for i in impls)
        + (" | new / old |" if {"new", "old"} <= set(impls) else " |"),
        "|---|---|---|---|" + "---|---|---|---|---|" * len(impls) + ("---|" if {"new", "old"} <= set(impls) else ""),
    ]  # fmt: skip
    for stage in args.stages.split(","):
        for S in map(int, args.lengths.split(",")):
            data = DataConfig(tokens_per_step=args.tokens, curriculum=((0, S),))
            t0 = time.perf_counter()
            batch = make_batch(data, 0)
            row: dict[str, Any] = {"stage": stage, "seq_len": S, "batch": batch.ids.shape[0]}
            row["data_ms"] = (time.perf_counter() - t0) * 1e3
            for impl in impls:
                try:
                    row[impl] = measure(
                        impl, mcfg, args.weights, batch, stage == "sparse", args.steps, device
                    )
                except (RuntimeError, ValueError) as e:  # out of memory, a kernel out of resources: say so
                    row[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                    print(f"train_speed: {impl} at {S}: {row[impl]['error']}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            res["rows"].append(row)
            cells = [
                "failed | - | - | - | -"
                if "error" in row[i]
                else f"{row[i]['s_per_step']:.4f} | {row[i]['tokens_per_s']:,.0f} | {row[i]['ops']} | "
                f"{row[i]['syncs']} | " + ("-" if row[i]["select_s"] is None else f"{row[i]['select_s']:.4f}")
                for i in impls
            ]
            ratio = (
                f" | {row['old']['s_per_step'] / row['new']['s_per_step']:.2f}x |"
                if {"new", "old"} <= set(impls) and not any("error" in row[i] for i in ("new", "old"))
                else " |"
            )
            lines.append(
                f"| {stage} | {S} | {row['batch']} | {row['data_ms']:.0f} | " + " | ".join(cells) + ratio
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(f"\n{res['device']}, torch {res['torch']}, {args.tokens} tokens a step\n{table}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "gpu" if device.type == "cuda" else "cpu"
        (args.out / f"train-speed-{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.out / f"train-speed-{tag}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
