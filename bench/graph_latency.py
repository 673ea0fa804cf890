"""What one kernel node of a replayed CUDA graph costs when it does (almost) nothing.

A batch-1 decode step replays a graph of ~270 kernels whose GPU busy time is ~0.5 ms shorter than
the step (bench/results/step-profile-decode-h200.md). This measures the per-node cost directly:
a graph of N dependent tiny kernels (each reads and writes one float of the previous one's
output), replayed back to back, for
- Triton kernels launched plainly,
- Triton kernels launched with programmatic dependent launch (PDL: `launch_pdl=True`, the kernel
  waits on its predecessor with `gdc_wait`, so its launch overlaps the predecessor's tail),
- torch elementwise ops (`add_` on a one-element tensor),
- Triton kernels of a realistic grid (132 x 4 programs) so the ramp of a full wave is included.
The per-node figure is (replay time of N nodes - replay time of 1 node) / (N - 1).

    python -m bench.graph_latency [--nodes 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import capture_graph, environment, gpu_tag, time_cuda, write_results  # noqa: E402


def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def tiny(x_ptr, n_progs):
        pid = tl.program_id(0)
        v = tl.load(x_ptr + pid % n_progs)
        tl.store(x_ptr + pid % n_progs, v + 1.0)

    @triton.jit
    def tiny_pdl(x_ptr, n_progs):
        tl.extra.cuda.gdc_wait()  # the predecessor's writes are visible after this
        pid = tl.program_id(0)
        v = tl.load(x_ptr + pid % n_progs)
        tl.extra.cuda.gdc_launch_dependents()
        tl.store(x_ptr + pid % n_progs, v + 1.0)

    return tiny, tiny_pdl


def replay_seconds(body: Callable[[], None], reps: int = 50) -> float:
    """Seconds per replay of a graph that runs `body` once."""
    g = capture_graph(body)
    return time_cuda(lambda: [g.replay() for _ in range(reps)], iters=10, warmup=2) / reps


def per_node(make: Callable[[int], Callable[[], None]], nodes: int) -> dict[str, float]:
    one = replay_seconds(make(1))
    many = replay_seconds(make(nodes))
    return {
        "one_node_us": one * 1e6,
        "n_nodes_us": many * 1e6,
        "per_node_us": (many - one) / (nodes - 1) * 1e6,
    }


def run(nodes: int) -> dict[str, Any]:
    tiny, tiny_pdl = _kernels()
    x = torch.zeros(4096, device="cuda")
    res: dict[str, Any] = {"nodes": nodes}

    def triton_chain(grid: int, pdl: bool) -> Callable[[int], Callable[[], None]]:
        def make(n: int) -> Callable[[], None]:
            def body() -> None:
                for _ in range(n):
                    if pdl:
                        tiny_pdl[(grid,)](x, 4096, launch_pdl=True)
                    else:
                        tiny[(grid,)](x, 4096)

            return body

        return make

    def torch_chain(n: int) -> Callable[[], None]:
        y = x[:1]

        def body() -> None:
            for _ in range(n):
                y.add_(1.0)

        return body

    cases: dict[str, Callable[[int], Callable[[], None]]] = {
        "triton_1_program": triton_chain(1, False),
        "triton_1_program_pdl": triton_chain(1, True),
        "triton_528_programs": triton_chain(528, False),
        "triton_528_programs_pdl": triton_chain(528, True),
        "torch_add_": torch_chain,
    }
    for name, make in cases.items():
        try:
            res[name] = per_node(make, nodes)
        except Exception as e:  # noqa: BLE001 - PDL may be missing from this triton build
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return res


def table(res: dict[str, Any]) -> str:
    lines = [
        f"Per-node cost of a replayed CUDA graph of {res['nodes']} dependent tiny kernels "
        "(`python -m bench.graph_latency`).",
        "",
        "| kernels | 1 node, us | N nodes, us | per node, us |",
        "|---|---|---|---|",
    ]
    for k, v in res.items():
        if not isinstance(v, dict) or k == "env":
            continue
        if "error" in v:
            lines.append(f"| {k} | {v['error']} | | |")
        else:
            lines.append(f"| {k} | {v['one_node_us']:.1f} | {v['n_nodes_us']:.1f} | {v['per_node_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be >= 2")
    if not torch.cuda.is_available():
        print("bench/graph_latency.py needs CUDA")
        return 0
    res = {"env": environment(), **run(args.nodes)}
    md = table(res)
    print(md)
    write_results(f"graph-latency-{gpu_tag()}", res, md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
