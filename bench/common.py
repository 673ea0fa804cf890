"""Timing and hardware ceilings shared by the GPU benches (measured in the same run as the figures), and
the prompts they share."""

from __future__ import annotations

import atexit
import contextlib
import json
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def check_selection(config: str | Path, args: Any) -> None:
    """ConfigError (one line for the bench to print) unless the selection flags `args` carries
    (`longctx.engine.args.add_selection_args`) are ones the model config.json at `config` (a file or a
    model directory) can take, as the engine would take them."""
    from longctx.config import ModelConfig, with_selection
    from longctx.engine.args import selection_kwargs

    with_selection(ModelConfig.from_json(config), **selection_kwargs(args))


def time_fn(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median seconds per call (triton's do_bench, which flushes L2 between calls; CUDA events
    via `time_cuda` if triton is missing)."""
    try:
        from triton.testing import do_bench
    except ImportError:  # pragma: no cover
        return time_cuda(fn)
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) / 1e3


def time_cuda(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call with CUDA events, no cache flush (for whole steps)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def capture_graph(
    body: Callable[[], Any], warmup: int = 1, warm: Callable[[], Any] | None = None
) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of `body`, after `warmup` calls of `warm` (default: body) on a side
    stream, which compile the kernels and settle the allocator outside the capture."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                (warm or body)()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def copy_rate(src: torch.Tensor, dst: torch.Tensor, both_ways: bool, warmup: int = 3, rep: int = 20) -> float:
    """Bytes/s of `dst.copy_(src)`, counting read + write when `both_ways` (device-to-device)."""
    t = time_fn(lambda: dst.copy_(src, non_blocking=True), warmup=warmup, rep=rep)
    return (2 if both_ways else 1) * src.numel() / t


def gemm_flops(
    dtype: torch.dtype = torch.bfloat16,
    n: int = 8192,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    device: str = "cuda",
) -> float:
    """Dense n x n x n GEMM FLOP/s: torch.mm in `dtype`, or for fp8 (e4m3) torch._scaled_mm with
    per-tensor scales and a column-major second operand. `timer` maps a call to seconds (default
    `time_fn`). Raises whatever the torch build raises for an unsupported fp8 GEMM."""
    timer = timer or time_fn
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    if dtype == torch.float8_e4m3fn:
        a8 = a.to(dtype)
        b8 = b.to(dtype).t().contiguous().t()  # _scaled_mm wants the second operand column-major
        one = torch.ones((), device=device)
        fn = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a, b = a.to(dtype), b.to(dtype)
        fn = lambda: torch.mm(a, b)  # noqa: E731
    return 2 * n**3 / timer(fn)


def measure_ceilings(
    hbm_bytes: int = 4 << 30,
    h2d_bytes: int = 1 << 30,
    gemm: bool = True,
    copy_warmup: int = 3,
    copy_rep: int = 20,
) -> dict[str, float]:
    """HBM copy rate (read + write), pinned H2D bulk copy rate, bf16 and fp8 dense GEMM rates."""
    hbm = copy_rate(
        torch.empty(hbm_bytes // 2, dtype=torch.uint8, device="cuda"),
        torch.empty(hbm_bytes // 2, dtype=torch.uint8, device="cuda"),
        both_ways=True,
        warmup=copy_warmup,
        rep=copy_rep,
    )
    h2d = copy_rate(
        torch.empty(h2d_bytes, dtype=torch.uint8, pin_memory=True),
        torch.empty(h2d_bytes, dtype=torch.uint8, device="cuda"),
        both_ways=False,
        warmup=copy_warmup,
        rep=copy_rep,
    )
    out: dict[str, Any] = {"hbm_copy_Bps": hbm, "pinned_h2d_Bps": h2d}
    if gemm:
        timer = partial(time_fn, warmup=5, rep=20)
        out["bf16_gemm_flops"] = gemm_flops(torch.bfloat16, timer=timer)
        try:
            out["fp8_gemm_flops"] = gemm_flops(torch.float8_e4m3fn, timer=timer)
        except Exception as e:  # noqa: BLE001 - report, don't die
            out["fp8_gemm_error"] = str(e).splitlines()[0]
    torch.cuda.empty_cache()
    return out


@contextlib.contextmanager
def sampler_route(
    candidates: int | None = None,
    split: bool | None = None,
    scale_in_kernel: bool | None = None,
    penalties_kernel: bool | None = None,
    pick_kernel: bool | None = None,
) -> Iterator[None]:
    """The sampler's routes for a timing: top-p rows take the candidates route on CUDA too
    (`TOP_P_CANDIDATES_CUDA`, off there by default), with `candidates` of them (0: whole rows sorted);
    temperature-only rows drawn apart from top-p rows on CUDA or not (`SPLIT_PLAIN_CUDA`); the Gumbel
    kernel scaling raw logits itself on CUDA or not (`SCALE_IN_KERNEL_CUDA`); the penalties in one kernel
    on CUDA or not (`PENALTIES_KERNEL_CUDA`); the Gumbel draw's winner picked by its second kernel on CUDA
    or not (`kernels.gumbel.PICK_KERNEL_CUDA`). None: the default. Every setting restored after."""
    from longctx.kernels import gumbel

    from longctx.engine import sampling

    names = (
        "TOP_P_CANDIDATES",
        "TOP_P_CANDIDATES_CUDA",
        "SPLIT_PLAIN_CUDA",
        "SCALE_IN_KERNEL_CUDA",
        "PENALTIES_KERNEL_CUDA",
    )
    keep = {n: getattr(sampling, n) for n in names}
    for n, v in zip(names, (candidates, True, split, scale_in_kernel, penalties_kernel)):
        if v is not None:
            setattr(sampling, n, v)
    pick = gumbel.PICK_KERNEL_CUDA
    if pick_kernel is not None:
        gumbel.PICK_KERNEL_CUDA = pick_kernel
    try:
        yield
    finally:
        for n, v in keep.items():
            setattr(sampling, n, v)
        gumbel.PICK_KERNEL_CUDA = pick


def time_wall(fn: Callable[[], Any], iters: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds per call (`time_cuda`'s CPU form)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def write_json_md(out_dir: Path, name: str, data: Any, md: str, **json_kw: Any) -> None:
    """out_dir/<name>.json (indent 1) and out_dir/<name>.md, for the benches that write only to --out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, **json_kw))
    (out_dir / f"{name}.md").write_text(md)


def environment() -> dict[str, Any]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


NOTES_MARK = "<!-- notes below are kept when the bench rewrites the table above -->"


def kept_notes(old: str) -> str:
    """What a results table's rewrite keeps of the file it replaces: the text after NOTES_MARK, or else
    everything after the file's leading table rows (a file that does not start with a table is kept
    whole), so the commentary written beside earlier runs' figures is never lost."""
    if NOTES_MARK in old:
        return old.split(NOTES_MARK, 1)[1].strip("\n")
    lines = old.splitlines()
    i = 0
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    return "\n".join(lines[i:]).strip("\n")


def gpu_tag() -> str:
    """The results files' GPU suffix: "h100", "h200", ..., from this machine's GPU name ("gpu" for another
    one, "cpu" without CUDA), so a run on one GPU does not overwrite another's figures."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((t for t in ("h100", "h200", "h800", "h20", "b200", "a100") if t in name), "gpu")


def write_results(name: str, data: dict[str, Any], table: str, out_dir: Path | None = None) -> list[Path]:
    """bench/results/<name>.json and .md (and the same under out_dir, e.g. $OUT). The .md is the new
    table followed by the notes the committed one had below its table (`kept_notes`)."""
    old = RESULTS / f"{name}.md"
    notes = kept_notes(old.read_text()) if old.exists() else ""
    md = table.rstrip("\n") + "\n" + (f"\n{NOTES_MARK}\n\n{notes}\n" if notes else "")
    paths = []
    for d in {RESULTS, *([out_dir] if out_dir else [])}:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.json").write_text(json.dumps(data, indent=2, default=float) + "\n")
        (d / f"{name}.md").write_text(md)
        paths += [d / f"{name}.json", d / f"{name}.md"]
    return paths


def fmt_bytes(x: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(x) < 1000:
            return f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"


def niah_byte_prompt(n: int, seed: int = 7) -> list[int]:
    """A RULER niah_single_1 prompt of about `n` byte tokens (task text + answer prefix, as `longctx
    ruler` sends it raw), for the byte-level trained checkpoint; the benches' fixed seed by default."""
    from longctx.workloads.ruler_tasks import RulerGenerator
    from longctx.workloads.tokens import ByteCounter

    s = RulerGenerator(ByteCounter(), seed=seed, max_new_tokens_scale=0.5).sample("niah_single_1", n, 0)
    return list((s.input + s.answer_prefix).encode("utf-8"))


def sweep_timer(cuda: bool) -> Callable[[Callable[[], Any]], float]:
    """A launch sweep's timer: kernel time in a CUDA graph (L2 flushed, 20 replays) on the GPU; on the
    CPU (the interpreter smoke test, correctness only) the wall time of one call."""
    if cuda:
        from bench.kernels_mla_moe import time_graph

        return lambda fn: time_graph(fn, reps=20)

    def wall(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return wall


def sweep_device(spec: str, script: str) -> tuple[torch.device, int | None]:
    """A launch sweep's device, and the exit code to return at once when it cannot run there (None: go
    on): CUDA must be present, and `--device cpu` runs the kernels under TRITON_INTERPRET=1 only."""
    from longctx.kernels.common import triton_interpret

    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"{script} needs CUDA (or --device cpu under TRITON_INTERPRET=1)")
        return dev, 0
    if dev.type != "cuda" and not triton_interpret():
        print("--device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        return dev, 2
    return dev, None


def scratch_dir() -> Path:
    """A fresh temporary directory removed when the process exits (a bench's random checkpoint: the
    benches run in-process from the tests too, which would otherwise leave one in the temp dir a run)."""
    d = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d
