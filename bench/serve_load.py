"""Load test for `longctx serve`: N concurrent streaming clients, throughput and latency percentiles.

Starts a server (`--model DIR`, optionally `--fake-engine`) or targets a running one
(`--base-url`), then runs `--concurrency` clients that each send streaming completions until
`--requests` have been sent in total or `--duration` seconds have passed. Reports req/s, output
tokens/s, and p50/p90/p99 of time to first token (TTFT), inter-token latency (ITL) and request
latency, as JSON and a markdown table (`--out PREFIX` writes PREFIX.json and PREFIX.md).

    python bench/serve_load.py --model models/tiny --device cpu --concurrency 8 --requests 32 \\
        --out bench/results/serve-load-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    out_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(s) / len(s)}


async def one_request(client: httpx.AsyncClient, body: dict) -> Sample:
    t0 = time.perf_counter()
    last = None
    smp = Sample(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                smp.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return smp
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    smp.error = obj["error"]["message"]
                    return smp
                if obj.get("usage"):
                    smp.out_tokens = obj["usage"]["completion_tokens"]
                    smp.prompt_tokens = obj["usage"]["prompt_tokens"]
                if obj.get("choices") and obj["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        smp.ttft = now - t0
                    else:
                        smp.itl.append(now - last)
                    last = now
        smp.latency = time.perf_counter() - t0
        smp.ok = True
    except httpx.HTTPError as e:
        smp.error = f"{type(e).__name__}: {e}"
    return smp


async def run_load(base_url: str, args: argparse.Namespace) -> tuple[list[Sample], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 45 + 1))[
        : args.prompt_tokens
    ]
    body = {
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    samples: list[Sample] = []
    sent = 0
    deadline = time.perf_counter() + args.duration
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.duration + 60)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < args.requests and time.perf_counter() < deadline:
                sent += 1
                samples.append(await one_request(client, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return samples, wall


def summarize(samples: list[Sample], wall: float, args: argparse.Namespace, engine: str) -> dict:
    ok = [s for s in samples if s.ok]
    out_tok = sum(s.out_tokens for s in ok)
    ms = lambda d: {k: (None if v is None else round(v * 1000, 2)) for k, v in d.items()}  # noqa: E731
    return {
        "bench": "serve_load",
        "engine": engine,
        "model": args.model or args.base_url,
        "device": args.device,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests_ok": len(ok),
        "requests_failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if not s.ok})[:5],
        "wall_s": round(wall, 3),
        "req_per_s": round(len(ok) / wall, 3) if wall else None,
        "output_tokens_per_s": round(out_tok / wall, 2) if wall else None,
        "total_tokens_per_s": round((out_tok + sum(s.prompt_tokens for s in ok)) / wall, 2) if wall else None,
        "ttft_ms": ms(percentiles([s.ttft for s in ok])),
        "itl_ms": ms(percentiles([x for s in ok for x in s.itl])),
        "latency_ms": ms(percentiles([s.latency for s in ok])),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "note": args.note,
    }


def markdown(r: dict) -> str:
    lines = [
        f"# serve_load: {r['engine']} engine, {r['model']}",
        "",
        f"Command: `{r['command']}`",
        "",
        *([r["note"], ""] if r.get("note") else []),
        f"{r['concurrency']} concurrent streaming clients, prompt ~{r['prompt_tokens']} tokens, "
        f"{r['max_tokens']} output tokens each (ignore_eos); {r['requests_ok']} ok, "
        f"{r['requests_failed']} failed in {r['wall_s']} s on {r['host']['cpus']} CPUs.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| requests/s | {r['req_per_s']} |",
        f"| output tokens/s | {r['output_tokens_per_s']} |",
        f"| total tokens/s (prompt + output) | {r['total_tokens_per_s']} |",
        "",
        "| latency (ms) | p50 | p90 | p99 | mean |",
        "|---|---|---|---|---|",
    ]
    for key, name in (
        ("ttft_ms", "time to first token"),
        ("itl_ms", "inter-token"),
        ("latency_ms", "request"),
    ):
        d = r[key]
        lines.append(f"| {name} | {d['p50']} | {d['p90']} | {d['p99']} | {d['mean']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="target a running server instead of starting one")
    p.add_argument("--model", help="model directory for the server this script starts")
    p.add_argument(
        "--fake-engine", nargs="?", const="{}", default=None, help="start the server on the fake engine"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64, help="total requests (bounded)")
    p.add_argument("--duration", type=float, default=120.0, help="stop sending after this many seconds")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", help="write OUT.json and OUT.md")
    p.add_argument(
        "--note", default="", help="free text recorded with the result (how the model was made...)"
    )
    args = p.parse_args()
    if not args.base_url and not args.model:
        p.error("give --model DIR (to start a server) or --base-url URL")

    engine = "fake" if args.fake_engine is not None else "real"
    if args.base_url:
        engine = "remote"
        samples, wall = asyncio.run(run_load(args.base_url.rstrip("/"), args))
    else:
        from longctx.server.testing import ServerProcess

        extra = ["--device", args.device, "--max-context", str(args.max_context), "--max-queue", "100000"]
        if args.fake_engine is not None:
            extra += ["--fake-engine", args.fake_engine]
        if args.api_key:
            extra += ["--api-key", args.api_key]
        with ServerProcess(args.model, *extra, startup_timeout=1800) as server:
            samples, wall = asyncio.run(run_load(server.url, args))
    result = summarize(samples, wall, args, engine)
    print(json.dumps(result, indent=2))
    print(markdown(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(result))
    return 0 if result["requests_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
