"""Run `u1serve up` as a real process tree and take it down again (helpers for the system tests)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from services.netutil import free_port
from services.kit.proc import preexec_die_with_parent  # a killed test run leaves no server behind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(") ", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    return True
    except OSError:
        pass
    return False


class RunningStack:
    def __init__(self, model: str, mode: str, run_dir: str, extra: list[str] | None = None):
        self.port, self.und_port, self.gen_port = free_port(), free_port(), free_port()
        self.run_dir = run_dir
        self.state_file = os.path.join(run_dir, "stack.json")
        self.pool = f"u1serve-test-{os.getpid()}-{self.port}"
        self.token = f"token-{self.port}"
        self.shm_before = shm_entries()
        argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--mode", mode,
                "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
                "--und-port", str(self.und_port), "--gen-port", str(self.gen_port),
                "--kv-pool-name", self.pool, "--kv-pool-gb", "0.1", "--internal-token", self.token, "--run-dir", run_dir,
                "--grace", "8", "--default-size", "64x64"] + (extra or [])
        self.log = open(os.path.join(run_dir, "launcher.out"), "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": ROOT}, preexec_fn=preexec_die_with_parent)
        self.base = f"http://127.0.0.1:{self.port}"
        self.pids: dict[str, int] = {}

    def wait_ready(self, timeout: float = 240.0) -> "RunningStack":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"u1serve up exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    self.pids = self.service_pids()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("stack not healthy in time:\n" + self.output())

    def service_pids(self) -> dict[str, int]:
        with open(self.state_file) as f:
            return {k: v["pid"] for k, v in json.load(f)["services"].items()}

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(os.path.join(self.run_dir, "launcher.out")) as f:
            return f.read()[-20000:]

    def stop(self, sig=signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        self.log.close()
        return self.proc.returncode

    def leftovers(self) -> tuple[list[int], list[str]]:
        """(live process groups of the services, new /dev/shm entries) after stop()."""
        groups = [p for p in self.pids.values() if group_alive(p) or pid_alive(p)]
        new_shm = sorted(e for e in shm_entries() - self.shm_before
                         if e.startswith(self.pool) or e.startswith("sem.mp-"))
        return groups, new_shm
