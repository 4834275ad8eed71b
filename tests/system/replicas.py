"""Engine replicas behind one gateway as real processes on loopback (helpers for test_replicas.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from services.netutil import free_port
from services.kit.proc import preexec_die_with_parent  # a killed test run leaves no server behind
from tests.waiting import wait_until

from .stackproc import ROOT, group_alive

TOKEN = "replica-test-token"
HEADERS = {"X-U1-Internal-Token": TOKEN}


class Service:
    """One service process (its own process group), its log in run_dir."""

    def __init__(self, name: str, argv: list[str], run_dir: str, env: dict | None = None, port: int | None = None):
        self.name, self.run_dir = name, run_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = argv + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, "PYTHONPATH": ROOT, "U1SERVE_INTERNAL_TOKEN": TOKEN, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None

    def start(self) -> "Service":
        log = open(os.path.join(self.run_dir, f"{self.name}.log"), "a")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=preexec_die_with_parent)
        log.close()
        self.pgid = self.proc.pid
        return self

    def log(self) -> str:
        with open(os.path.join(self.run_dir, f"{self.name}.log")) as f:
            return f.read()[-6000:]

    def wait_healthy(self, timeout: float = 240.0) -> dict:
        def healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 else None
        try:
            return wait_until(healthy, timeout, interval=0.3)
        except TimeoutError:
            raise TimeoutError(f"{self.name} not healthy in time:\n{self.log()}") from None

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def kill(self) -> None:
        """A crash: SIGKILL to the whole process group."""
        os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pgid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 15
        while group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.proc.returncode


def understanding(model: str, run_dir: str, pool: str, i: int, transport: str) -> Service:
    return Service(f"und{i}", [sys.executable, "-m", "services.understanding.server", "--model", model,
                               "--device", "cpu", "--dtype", "float32", "--kv-pool-name", pool, "--kv-pool-gb", "0.1",
                               "--kv-transport", transport, "--kv-advertise-host", "127.0.0.1",
                               "--log-level", "warning"], run_dir)


def generation(model: str, run_dir: str, pool: str, i: int, env: dict) -> Service:
    return Service(f"gen{i}", [sys.executable, "-m", "services.generation.server", "--model", model,
                               "--device", "cpu", "--dtype", "float32", "--kv-pool-name", pool,
                               "--default-size", "64x64", "--log-level", "warning"], run_dir, env=env)


def gateway(run_dir: str, und: list[Service], gen: list[Service]) -> Service:
    argv = [sys.executable, "-m", "services.gateway.server", "--default-size", "64x64",
            "--health-interval-s", "0.5", "--retry-down-after-s", "1", "--log-level", "warning"]
    for s in und:
        argv += ["--und-url", s.url]
    for s in gen:
        argv += ["--gen-url", s.url]
    return Service("gateway", argv, run_dir)


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on a service's /metrics."""
    text = httpx.get(url + "/metrics", headers=HEADERS, timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total
