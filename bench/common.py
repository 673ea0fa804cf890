"""Timing and hardware ceilings shared by the GPU benches (measured in the same run as the figures)."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_fn(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median seconds per call (triton's do_bench, which flushes L2 between calls)."""
    from triton.testing import do_bench

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


def _copy_rate(src: torch.Tensor, dst: torch.Tensor, both_ways: bool) -> float:
    t = time_fn(lambda: dst.copy_(src, non_blocking=True), warmup=3, rep=20)
    return (2 if both_ways else 1) * src.numel() / t


def measure_ceilings(
    hbm_bytes: int = 4 << 30, h2d_bytes: int = 1 << 30, gemm: bool = True
) -> dict[str, float]:
    """HBM copy rate (read + write), pinned H2D bulk copy rate, bf16 and fp8 dense GEMM rates."""
    hbm = _copy_rate(
        torch.empty(hbm_bytes // 2, dtype=torch.uint8, device="cuda"),
        torch.empty(hbm_bytes // 2, dtype=torch.uint8, device="cuda"),
        both_ways=True,
    )
    h2d = _copy_rate(
        torch.empty(h2d_bytes, dtype=torch.uint8, pin_memory=True),
        torch.empty(h2d_bytes, dtype=torch.uint8, device="cuda"),
        both_ways=False,
    )
    out = {"hbm_copy_Bps": hbm, "pinned_h2d_Bps": h2d}
    if gemm:
        n = 8192
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        out["bf16_gemm_flops"] = 2 * n**3 / time_fn(lambda: x @ y, warmup=5, rep=20)
        try:
            xf = x.to(torch.float8_e4m3fn)
            yf = y.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            out["fp8_gemm_flops"] = (
                2
                * n**3
                / time_fn(
                    lambda: torch._scaled_mm(xf, yf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    warmup=5,
                    rep=20,
                )
            )
        except Exception as e:  # noqa: BLE001 - report, don't die
            out["fp8_gemm_error"] = str(e).splitlines()[0]
        del x, y
    torch.cuda.empty_cache()
    return out


def environment() -> dict[str, Any]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(name: str, data: dict[str, Any], table: str, out_dir: Path | None = None) -> list[Path]:
    """bench/results/<name>.json and .md (and the same under out_dir, e.g. $OUT)."""
    paths = []
    for d in {RESULTS, *([out_dir] if out_dir else [])}:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.json").write_text(json.dumps(data, indent=2, default=float) + "\n")
        (d / f"{name}.md").write_text(table + "\n")
        paths += [d / f"{name}.json", d / f"{name}.md"]
    return paths


def fmt_bytes(x: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(x) < 1000:
            return f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"
