"""Prometheus metrics of the understanding service (own registry; engine gauges read at scrape time)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "u1_und_"
        self.running = Gauge(p + "running_requests", "requests in the running batch", registry=r)
        self.waiting = Gauge(p + "waiting_requests", "requests waiting for admission", registry=r)
        self.kv_total = Gauge(p + "kv_cache_tokens_total", "KV cache capacity (tokens)", registry=r)
        self.kv_used = Gauge(p + "kv_cache_tokens_used", "KV slots held by requests", registry=r)
        self.kv_cached = Gauge(p + "kv_cache_tokens_cached", "KV slots held only by the prefix cache", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "KV slots in use (requests + cache) / capacity",
                              registry=r)
        self.hit_rate = Gauge(p + "prefix_cache_hit_rate", "cached prompt tokens / prompt tokens", registry=r)
        self.preemptions = Gauge(p + "preemptions_total", "requests preempted (recompute)", registry=r)
        self.prompt_tokens = Gauge(p + "prompt_tokens_total", "prompt tokens admitted", registry=r)
        self.cached_prompt_tokens = Gauge(p + "prompt_tokens_cached_total",
                                          "prompt tokens found in the prefix cache (not computed)", registry=r)
        self.generated_tokens = Gauge(p + "generation_tokens_total", "tokens generated", registry=r)
        self.shm_pages_used = Gauge(p + "shm_pool_pages_used", "pages of the shared-memory KV pool in use",
                                    registry=r)
        self.shm_pages_total = Gauge(p + "shm_pool_pages_total", "pages of the shared-memory KV pool", registry=r)
        self.engine_restarts = Gauge(p + "engine_restarts_total", "engine restarts after a crash", registry=r)
        self.in_flight = Gauge(p + "admitted_requests", "requests admitted (running or queued)", registry=r)
        self.admission_limit = Gauge(p + "admission_limit", "running + queued requests allowed", registry=r)
        self.rejected = Gauge(p + "rejected_requests_total", "requests refused with 429 (admission full)",
                              registry=r)
        self.requests = Counter(p + "requests", "finished requests", ["endpoint", "finish_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between output tokens", buckets=_ITL,
                             registry=r)
        self.e2e = Histogram(p + "request_latency_seconds", "end-to-end request latency", buckets=_LAT,
                             registry=r)
        self.prefix_export = Histogram(p + "image_prefix_seconds", "image-prefix request latency", buckets=_LAT,
                                       registry=r)

    def render(self, stats, pool_stats: dict | None, restarts: int, gate) -> bytes:
        self.engine_restarts.set(restarts)
        self.in_flight.set(gate.active)
        self.admission_limit.set(gate.limit)
        self.rejected.set(gate.rejected)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_total.set(stats.kv_total)
        self.kv_used.set(stats.kv_in_use)
        self.kv_cached.set(stats.kv_cached)
        self.kv_usage.set((stats.kv_total - stats.kv_free) / max(1, stats.kv_total))
        self.hit_rate.set(stats.cached_prompt_tokens / max(1, stats.prompt_tokens))
        self.preemptions.set(stats.preemptions)
        self.prompt_tokens.set(stats.prompt_tokens)
        self.cached_prompt_tokens.set(stats.cached_prompt_tokens)
        self.generated_tokens.set(stats.generated_tokens)
        if pool_stats:
            self.shm_pages_used.set(pool_stats["pages_used"])
            self.shm_pages_total.set(pool_stats["pages_total"])
        return generate_latest(self.registry)
