"""Process management for `u1serve up`: start the engines and the gateway, watch, shut down.

Each service runs in its own process group (its ranks included), so shutdown can signal the whole
group: SIGTERM, a grace period, then SIGKILL. Children also get PR_SET_PDEATHSIG so a launcher
killed with SIGKILL does not leave them behind. The understanding service owns the KV pool segment
(/dev/shm/<pool name>); the launcher unlinks it after shutdown in case that service was killed.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, TextIO

SHM_DIR = "/dev/shm"


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when the launcher dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServiceSpec:
    name: str                    # short log prefix: und, gen, gateway
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)


class ManagedProcess:
    def __init__(self, spec: ServiceSpec, out: TextIO | None, log_dir: str | None):
        self.spec = spec
        self.out = out              # None: log file only
        self.log_path = os.path.join(log_dir, f"{spec.name}.log") if log_dir else None
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True,
                         name=f"log-{self.spec.name}").start()

    def _pump(self, proc: subprocess.Popen) -> None:
        """Copy the child's output, each line prefixed with its name; keep a log file."""
        logf = open(self.log_path, "a", buffering=1) if self.log_path else None
        prefix = f"[{self.spec.name}] "
        try:
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if self.out is not None:
                    with self._lock:
                        try:
                            self.out.write(prefix + line + "\n")
                            self.out.flush()
                        except (ValueError, OSError):
                            pass
                if logf:
                    logf.write(line + "\n")
        finally:
            if logf:
                logf.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)   # pgid == pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


def port_in_use(url: str) -> bool:
    """Something already answers on the host:port of `url` (a stale server would fake health)."""
    import socket
    from urllib.parse import urlparse
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((u.hostname or "127.0.0.1", u.port or 80)) == 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class StartupError(RuntimeError):
    pass


class Stack:
    """An ordered set of services: started in order (each healthy before the next), stopped in reverse."""

    def __init__(self, specs: list[ServiceSpec], *, out: TextIO = sys.stdout,
                 log_dir: str | None = None, shm_names: list[str] | None = None,
                 grace_s: float = 10.0, startup_timeout_s: float = 600.0,
                 restart_delay_s: float = 1.0, state_file: str | None = None,
                 echo_logs: bool = True):
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self.procs = [ManagedProcess(s, out if echo_logs else None, log_dir) for s in specs]
        self.out = out
        self.shm_names = shm_names or []
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.restart_delay_s = restart_delay_s
        self.state_file = state_file
        self._stopping = threading.Event()
        self._stopped = False

    def say(self, text: str) -> None:
        try:
            self.out.write(f"[u1serve] {text}\n")
            self.out.flush()
        except (ValueError, OSError):
            pass

    def by_name(self, name: str) -> ManagedProcess:
        return next(p for p in self.procs if p.spec.name == name)

    def wait_healthy(self, mp: ManagedProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                raise StartupError("stopped during startup")
            if not mp.alive():
                raise StartupError(f"{mp.spec.name} exited with code {mp.proc.returncode} "
                                   f"during startup (see its log lines above)")
            if http_ok(mp.spec.health_url):
                return
            time.sleep(0.25)
        raise StartupError(f"{mp.spec.name} not healthy at {mp.spec.health_url} after {timeout_s:.0f}s")

    def start(self) -> None:
        try:
            for mp in self.procs:
                if port_in_use(mp.spec.health_url):
                    raise StartupError(f"cannot start {mp.spec.name}: the port of "
                                       f"{mp.spec.health_url} is already in use")
            for mp in self.procs:
                t0 = time.monotonic()
                self.say(f"starting {mp.spec.name}: {' '.join(mp.spec.argv)}")
                mp.start()
                self.write_state()
                self.wait_healthy(mp, self.startup_timeout_s)
                self.say(f"{mp.spec.name} healthy in {time.monotonic() - t0:.1f}s (pid {mp.pid})")
        except BaseException:
            self.stop()
            raise

    def write_state(self) -> None:
        if not self.state_file:
            return
        state = {"launcher_pid": os.getpid(),
                 "services": {p.spec.name: {"pid": p.pid, "health_url": p.spec.health_url,
                                            "restarts": p.restarts} for p in self.procs},
                 "shm": self.shm_names}
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_file)

    def supervise(self, restart: bool = True, poll_s: float = 0.5) -> None:
        """Until stop(): restart a service that died (its clients get 503s meanwhile)."""
        while not self._stopping.wait(poll_s):
            for mp in self.procs:
                if mp.alive() or self._stopping.is_set():
                    continue
                code = mp.proc.returncode if mp.proc else None
                if not restart:
                    self.say(f"{mp.spec.name} exited with code {code}; shutting down")
                    return
                self.say(f"{mp.spec.name} exited with code {code}; restarting in "
                         f"{self.restart_delay_s:.0f}s")
                mp.signal_group(signal.SIGKILL)   # ranks left behind by the dead leader
                if self._stopping.wait(self.restart_delay_s):
                    return
                mp.restarts += 1
                mp.start()
                self.write_state()
                try:
                    self.wait_healthy(mp, self.startup_timeout_s)
                    self.say(f"{mp.spec.name} healthy again (pid {mp.pid})")
                except StartupError as exc:
                    self.say(f"restart of {mp.spec.name} failed: {exc}")

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        """SIGTERM every group (gateway first), wait the grace period, SIGKILL what is left."""
        self._stopping.set()
        if self._stopped:
            return
        self._stopped = True
        for mp in reversed(self.procs):
            if mp.proc is not None:
                mp.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(mp.group_alive() for mp in self.procs):
            time.sleep(0.1)
        for mp in self.procs:
            if mp.group_alive():
                self.say(f"{mp.spec.name} did not stop in {self.grace_s:.0f}s; killing it")
                mp.signal_group(signal.SIGKILL)
        for mp in self.procs:
            if mp.proc is not None:
                try:
                    mp.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for name in self.shm_names:
            unlink_shm(name)
        if self.state_file:
            try:
                os.unlink(self.state_file)
            except FileNotFoundError:
                pass
        self.say("stopped")


def unlink_shm(name: str) -> None:
    """Remove /dev/shm/<name>, exactly that name (other stacks' segments may share its prefix), left by a
    killed owner."""
    from shm_transfer.segment import unlink_exact
    try:
        unlink_exact(name)
    except (ValueError, OSError):
        pass  # not a segment name, or not ours to remove


def run_until_signal(stack: Stack, restart: bool = True,
                     on_ready: Callable[[], None] | None = None) -> int:
    """Start the stack, supervise it until SIGINT/SIGTERM, shut down cleanly. Returns an exit code."""
    def handler(signum, frame):
        stack.say(f"received {signal.Signals(signum).name}; shutting down")
        stack.request_stop()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            stack.start()
        except StartupError as exc:
            stack.say(f"startup failed: {exc}")
            return 1
        if on_ready:
            on_ready()
        stack.supervise(restart=restart)
        return 0
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
