"""Device kernels one decode step launches, counted on the CPU (no GPU needed).

At batch 1 a decode step of a many-layer MoE model costs what its kernel launches cost (~2.5 us
each on the H200 even inside a CUDA graph: bench/results/step-profile-*.json), so the count is the
figure to drive down between GPU sessions. The engine runs the Triton path under the interpreter;
every non-view aten op and every Triton kernel launch in one `Engine.step()` of a decode counts
once, by name, and by the model part (module) that launched it, with layer numbers folded
(`layers.*.self_attn.q_b_proj`); launches outside the model's modules (the engine, sampling, the
rotary tables) count under "(outside modules)". With `--graphs` the step goes through
`DecodeGraphs` (its static-buffer path runs uncaptured on the CPU) and only the region a CUDA graph
would capture and replay is counted (the input copies before a replay are not).

    python -m bench.launch_count [--config configs/tiny.json] [--batch 1] [--context 300] [--graphs]
        [--hisparse-device-tokens N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import scratch_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# aten ops that launch nothing on a GPU: views, metadata, allocation
_FREE = {
    "view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "t",
    "transpose", "permute", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias",
    "reshape", "view_as", "resolve_conj", "resolve_neg", "unfold", "empty_like", "is_nonzero",
    "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride",
    "promote_types", "result_type", "detach_", "is_same_size", "contiguous",
}  # fmt: skip


OUTSIDE = "(outside modules)"


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.parts: Counter[tuple[str, str]] = Counter()  # (model part, op)
        self.stack: list[str] = []  # qualified names of the modules running now
        self.paused = 0

    def add(self, op: str) -> None:
        self.ops[op] += 1
        self.parts[(self.stack[-1] if self.stack else OUTSIDE, op)] += 1

    def watch(self, model: torch.nn.Module) -> list:  # type: ignore[type-arg]
        """Hooks that keep `stack` on the module running now; returns their handles."""

        def enter(part: str) -> Callable[..., None]:
            return lambda *_: self.stack.append(part)  # type: ignore[func-returns-value]

        def leave(*_: object) -> None:  # a hook's non-None return would replace the output
            self.stack.pop()

        handles = []
        for name, m in model.named_modules():
            part = re.sub(r"\.\d+(?=\.|$)", ".*", name).removeprefix("model.") or "(model)"
            handles += [m.register_forward_pre_hook(enter(part)), m.register_forward_hook(leave)]
        return handles

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # `.to` to the dtype a tensor already has returns it: no kernel
        if not self.paused and name not in _FREE and not (name == "to" and args and out is args[0]):
            self.add("aten." + name)
        return out


def count_decode_step(
    config: Path, batch: int, context: int, hisparse_device_tokens: int | None = None, graphs: bool = False
) -> Counter[str]:
    """Launches of one decode step by op name (`count_decode_step_parts` also splits them by part)."""
    return count_decode_step_parts(config, batch, context, hisparse_device_tokens, graphs)[0]


def count_decode_step_parts(
    config: Path, batch: int, context: int, hisparse_device_tokens: int | None = None, graphs: bool = False
) -> tuple[Counter[str], Counter[tuple[str, str]]]:
    import triton.runtime.interpreter as interp

    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig
    from longctx.engine.request import Request, SamplingParams

    model = scratch_dir() / "model"
    init_random_checkpoint(ModelConfig.from_json(config), model, seed=0)
    counter = _Count()
    run = interp.GridExecutor.__call__

    def launch(self, *a, **k):  # type: ignore[no-untyped-def]
        counter.add("triton." + self.fn.__name__)
        counter.paused += 1  # the interpreter's own tensor copies are not device work
        try:
            return run(self, *a, **k)
        finally:
            counter.paused -= 1

    gen = torch.Generator().manual_seed(0)
    with Engine(
        model,
        device="cpu",
        dtype="float32",
        backend="triton",
        hisparse_device_tokens=hisparse_device_tokens,
        cuda_graphs=graphs,
    ) as eng:
        for i in range(batch):
            ids = torch.randint(0, 256, (context,), generator=gen).tolist()
            eng.add_request(Request(f"r{i}", ids, SamplingParams(max_new_tokens=4, ignore_eos=True)))
        while not all(eng._requests[f"r{i}"].output_ids for i in range(batch)):
            eng.step()
        eng.step()  # one decode step to settle lazily built state
        interp.GridExecutor.__call__ = launch  # type: ignore[method-assign]
        dg = eng.runner.graphs
        handles = counter.watch(eng.runner.worker.model)
        try:
            if dg is None:
                with counter:
                    eng.step()
            else:  # only what the graph replays
                forward = dg._forward
                replays = dg.replays

                def captured(c):  # type: ignore[no-untyped-def]
                    with counter:
                        return forward(c)

                dg._forward = captured
                eng.step()
                assert dg.replays == replays + 1, "the step did not go through the decode graphs"
        finally:
            interp.GridExecutor.__call__ = run  # type: ignore[method-assign]
            for h in handles:
                h.remove()
    return counter.ops, counter.parts


def by_part(parts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """{part: {op: launches}}, parts by total launches, most first."""
    out: dict[str, Counter[str]] = {}
    for (part, op), n in parts.items():
        out.setdefault(part, Counter())[op] += n
    order = sorted(out, key=lambda p: (-sum(out[p].values()), p))
    return {p: dict(out[p].most_common()) for p in order}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--hisparse-device-tokens", type=int, default=None, help="count the capped path")
    ap.add_argument("--graphs", action="store_true", help="count what a replayed decode graph runs")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from longctx.config import ModelConfig

    cfg = ModelConfig.from_json(args.config)
    ops, parts = count_decode_step_parts(
        args.config, args.batch, args.context, args.hisparse_device_tokens, args.graphs
    )
    total = sum(ops.values())
    layers = cfg.num_hidden_layers
    where = " (inside the decode graph)" if args.graphs else ""
    print(
        f"decode step{where}, batch {args.batch}, {layers} layers: {total} launches"
        f" ({total / layers:.1f} per layer)"
    )
    for name, n in ops.most_common(args.top):
        print(f"{n:6d}  {name}")
    split = by_part(parts)
    print("\nby model part (layer numbers folded; launches summed over the layers that have the part):")
    for part, part_ops in split.items():
        detail = ", ".join(f"{op} {n}" for op, n in part_ops.items())
        print(f"{sum(part_ops.values()):6d}  {part}: {detail}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        res = {"config": str(args.config), "batch": args.batch, "layers": layers, "graphs": args.graphs,
               "launches": total, "per_layer": round(total / layers, 1), "ops": dict(ops.most_common()),
               "by_part": split}  # fmt: skip
        cap = f"-cap{args.hisparse_device_tokens}" if args.hisparse_device_tokens else ""
        cap += "-graph" if args.graphs else ""
        (args.out / f"launch-count-b{args.batch}{cap}.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
