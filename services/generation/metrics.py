"""Prometheus metrics of the generation service.

The engine process measures; it ships small stats messages to the HTTP process, which owns the registry
(one registry, one process: no prometheus multiprocess directory to manage).
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
                               CONTENT_TYPE_LATEST)

from .protocol import IdleStats, KvImportStats, StepStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)
_IMPORT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)


class GenerationMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("u1_gen_queue_depth", "jobs waiting for the engine (set by the HTTP process)",
                                 registry=r)
        self.running_jobs = Gauge("u1_gen_running_jobs", "jobs in the running batch", registry=r)
        self.steps = Counter("u1_gen_steps", "denoising steps (batched forwards) run", registry=r)
        self.forwards = Counter("u1_gen_forwards", "layer-stack forwards those steps ran (image jobs in one, RL jobs "
                                "in one where they keep their bits, generation/reference.py)", registry=r)
        self.job_steps = Counter("u1_gen_job_steps", "per-job denoising steps completed",
                                 registry=r)
        self.steps_per_second = Gauge("u1_gen_steps_per_second",
                                      "batched steps per second over the last 10 s", registry=r)
        self.step_seconds = Histogram("u1_gen_step_seconds", "latency of one batched step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.batch_rows = Gauge("u1_gen_batch_tokens", "image tokens in the last forward",
                                registry=r)
        self.kv_import_seconds = Histogram("u1_gen_kv_import_seconds",
                                           "prefix KV import (pool -> per-request buffer)",
                                           buckets=_IMPORT_BUCKETS, registry=r)
        self.kv_import_bytes = Counter("u1_gen_kv_import_bytes", "prefix KV bytes imported",
                                       registry=r)
        self.peak_gpu_memory = Gauge("u1_gen_peak_gpu_memory_bytes",
                                     "peak allocated device memory of the engine (rank 0)",
                                     registry=r)
        self.requests = Counter("u1_gen_requests", "requests by outcome (ok, an error code, disconnected)",
                                ["outcome"],
                                registry=r)
        self.streams_behind = Counter("u1_gen_streams_fell_behind", "jobs aborted because their stream's "
                                      "reader left more than --max-stream-backlog-mb of pixels waiting", registry=r)
        self.engine_restarts = Counter("u1_gen_engine_restarts", "engine process restarts",
                                       registry=r)
        self._recent = collections.deque()
        self._lock = threading.Lock()

    def on_stats(self, msg) -> None:
        """Apply one stats message from the engine (protocol.py)."""
        if isinstance(msg, StepStats):
            self.steps.inc()
            self.forwards.inc(msg.forwards)
            self.job_steps.inc(msg.jobs)
            self.step_seconds.observe(msg.seconds)
            self.batch_rows.set(msg.tokens)
            self.running_jobs.set(msg.running)
            if msg.peak_memory is not None:
                self.peak_gpu_memory.set(msg.peak_memory)
            self._count_step(time.monotonic())
        elif isinstance(msg, KvImportStats):
            self.kv_import_seconds.observe(msg.seconds)
            self.kv_import_bytes.inc(msg.bytes)
        elif isinstance(msg, IdleStats):
            self.running_jobs.set(msg.running)

    def _count_step(self, now: float) -> None:
        with self._lock:
            self._recent.append(now)
            while self._recent and now - self._recent[0] > 10.0:
                self._recent.popleft()
            span = now - self._recent[0] if len(self._recent) > 1 else 0.0
            self.steps_per_second.set((len(self._recent) - 1) / span if span else 0.0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
