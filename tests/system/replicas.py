"""Engine replicas behind one gateway as real processes on loopback (helpers for test_replicas.py)."""
from __future__ import annotations

import sys

from tests.metrics import metric as shared_metric

from .stackproc import Service

TOKEN = "replica-test-token"
HEADERS = {"X-U1-Internal-Token": TOKEN}
ENV = {"U1SERVE_INTERNAL_TOKEN": TOKEN}


def understanding(model: str, run_dir: str, pool: str, i: int, transport: str) -> Service:
    return Service(f"und{i}", [sys.executable, "-m", "services.understanding.server", "--model", model,
                               "--device", "cpu", "--dtype", "float32", "--kv-pool-name", pool, "--kv-pool-gb", "0.1",
                               "--kv-transport", transport, "--kv-advertise-host", "127.0.0.1",
                               "--log-level", "warning"], run_dir, env=ENV)


def generation(model: str, run_dir: str, pool: str, i: int, env: dict) -> Service:
    return Service(f"gen{i}", [sys.executable, "-m", "services.generation.server", "--model", model,
                               "--device", "cpu", "--dtype", "float32", "--kv-pool-name", pool,
                               "--default-size", "64x64", "--log-level", "warning"], run_dir, env={**ENV, **env})


def gateway(run_dir: str, und: list[Service], gen: list[Service]) -> Service:
    argv = [sys.executable, "-m", "services.gateway.server", "--default-size", "64x64",
            "--health-interval-s", "0.5", "--retry-down-after-s", "1", "--log-level", "warning"]
    for s in und:
        argv += ["--und-url", s.url]
    for s in gen:
        argv += ["--gen-url", s.url]
    return Service("gateway", argv, run_dir, env=ENV)


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on an engine's /metrics (0 before its first count)."""
    return shared_metric(url, name, headers=HEADERS, timeout=5, default=0.0)
