"""Prometheus metrics, all `longctx_`-prefixed, in a registry private to one server."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)
RATE_WINDOW_S = 10.0


def _pick(stats: dict[str, Any], *names: str) -> float:
    """The first of `names` present in the engine's stats (engines name these slightly differently)."""
    for n in names:
        v = stats.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 0.0


class Metrics:
    """Frontend-side metrics plus gauges mirrored from the engine's `stats()`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "longctx_requests",
            "Finished HTTP generation requests and document uploads",
            ["endpoint", "status"],
            registry=r,
        )
        self.generated_tokens = Counter("longctx_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("longctx_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.tokens_per_s = Gauge(
            "longctx_generation_tokens_per_second",
            f"Generated tokens/s over the last {RATE_WINDOW_S:.0f} s",
            registry=r,
        )
        self.ttft = Histogram(
            "longctx_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "longctx_inter_token_latency_seconds",
            "Time between generated tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "longctx_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Gauge("longctx_queue_length", "Requests waiting for admission", registry=r)
        self.running = Gauge("longctx_running_requests", "Requests being prefilled or decoded", registry=r)
        self.in_flight = Gauge(
            "longctx_http_requests_in_flight", "Generation requests the frontend is serving", registry=r
        )
        self.pages_used = Gauge("longctx_kv_pages_used", "KV pages in use", registry=r)
        self.pages_total = Gauge("longctx_kv_pages_total", "KV pages in the device pool", registry=r)
        self.prefix_hits = Gauge(
            "longctx_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prefix_cache_resets = Counter(
            "longctx_prefix_cache_resets",
            "Prefix-cache resets (POST /reset_prefix_cache or /flush_cache)",
            registry=r,
        )
        self.host_bytes = Gauge("longctx_host_pool_bytes", "Bytes of the host KV pool", registry=r)
        self.hisparse_rate = Gauge("longctx_hisparse_hit_rate", "HiSparse device-buffer hit rate", registry=r)
        self.healthy = Gauge("longctx_engine_healthy", "1 while the engine process is up", registry=r)
        self.documents = Gauge("longctx_documents", "Pinned documents", registry=r)
        self._recent: deque[tuple[float, int]] = deque()
        self.tokens_per_s.set_function(self._rate)

    def add_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)
        self._recent.append((time.monotonic(), n))

    def _rate(self) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def update_engine(self, stats: dict[str, Any], num_waiting: int, num_running: int, healthy: bool) -> None:
        self.queue.set(num_waiting)
        self.running.set(num_running)
        self.healthy.set(1 if healthy else 0)
        self.pages_used.set(_pick(stats, "pages_used", "kv_pages_used", "used_pages"))
        self.pages_total.set(_pick(stats, "pages_total", "kv_pages_total", "total_pages", "num_pages"))
        self.prefix_hits.set(_pick(stats, "prefix_hit_tokens", "prefix_cache_hit_tokens", "cache_hit_tokens"))
        self.host_bytes.set(_pick(stats, "host_pool_bytes", "host_bytes"))
        hits = _pick(stats, "hisparse_hits")
        misses = _pick(stats, "hisparse_misses")
        rate = _pick(stats, "hisparse_hit_rate")
        self.hisparse_rate.set(rate if rate else (hits / (hits + misses) if hits + misses else 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
