"""Real service processes for the system tests: one service (`Service`: its own process group, its log, its
health), a gateway alone (`GatewayProc`) or a whole `u1serve up` tree (`RunningStack`), started and taken down
again."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import httpx
from services.base.netutil import free_port
from services.kit.proc import preexec_die_with_parent  # a killed test run leaves no server behind
from tests.threads import ONE_THREAD  # noqa: F401  (the stacks that pin themselves import it from here)
from tests.waiting import wait_ok, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_shm() -> set[str]:
    """The /dev/shm entries some live process has mapped (a named semaphore is mapped by each holder)."""
    out = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/maps") as f:
                out.update(line.rsplit("/dev/shm/", 1)[1].rstrip("\n").removesuffix(" (deleted)")
                           for line in f if "/dev/shm/" in line)
        except OSError:        # gone meanwhile, or not ours to read
            pass
    return out


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


class Service:
    """One service process on loopback (`python -m services.<name>.server ...`): its own process group, which
    dies with the test run; its output in run_dir/<name>.log."""

    def __init__(self, name: str, argv: list[str], run_dir: str, env: dict | None = None, port: int | None = None):
        self.name, self.run_dir = name, run_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = argv + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        self.log_path = os.path.join(run_dir, f"{name}.log")
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None

    def start(self) -> "Service":
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=preexec_die_with_parent)
        self.pgid = self.proc.pid
        return self

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def wait_healthy(self, timeout: float = 240.0, path: str = "/health") -> dict:
        """Until `path` answers 200 (a gateway whose engines are down answers /v1/models, not /health)."""
        return wait_ok(self.url + path, self.proc, self.log, timeout, self.name).json()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def kill(self) -> None:
        """A crash: SIGKILL to the whole process group."""
        os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, SIGKILL to the group after `timeout`; returns once nothing of the group is left."""
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


class GatewayProc:
    """`python -m services.gateway.server` on loopback; its output is kept for assertions."""

    def __init__(self, und_urls: str, gen_urls: str, *flags: str, env: dict | None = None, log_dir: str = "/tmp",
                 host: str | None = "127.0.0.1"):
        """host None: no --host flag (the gateway's own default)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "services.gateway.server", *(["--host", host] if host else []),
                "--port", str(self.port),
                "--und-url", und_urls, "--gen-url", gen_urls, "--default-size", "64x64", *flags]
        self.log_path = os.path.join(log_dir, f"gateway-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_die_with_parent)

    def wait_up(self, timeout: float = 60.0) -> "GatewayProc":
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(self.base + "/health/live", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            wait_until(up, timeout, interval=0.1)
        except TimeoutError:
            raise RuntimeError("gateway did not start:\n" + self.stop()) from None
        return self

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.output()


class Terminal:
    """A pseudo-terminal for a child's output, read by a thread into memory until the child closes it."""

    def __init__(self, rows: int = 40, cols: int = 120):
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name="pty-reader")

    def started(self) -> None:
        """The child holds the slave end now: close ours (its exit is then EOF here)."""
        os.close(self.slave)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:            # EIO: the child closed the terminal
                return
            if not data:
                return
            self._chunks.append(data)

    def shown(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def close(self) -> None:
        self._reader.join(timeout=10)
        os.close(self.master)


def in_terminal(argv: list[str], timeout: float = 60, **env: str) -> tuple[int, str, str]:
    """Run `argv` with stderr on a pseudo-terminal: (exit code, what the terminal showed, its stdout)."""
    term = Terminal()
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=term.slave, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT, **env})
    term.started()
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        term.close()
    return p.returncode, term.shown(), out


# ONE_THREAD (tests/threads.py): one CPU thread per process of a stack (OMP_NUM_THREADS reaches every engine
# rank). When the two cores are busy, a stack's OpenMP threads spinning against each other slow the tiny forwards
# several-fold (measured on a loaded 2-core machine: four 96x64 8-step images 3-4 s pinned, 16 s not; four
# 32-token chats 0.8 s, 13 s; idle, the LoRA stack's tests took 27 s either way). The whole run is pinned so
# (tests/threads.py: the test process too, so the shared stack's outputs still equal the reference computed in the
# test process); a stack given ONE_THREAD keeps one thread also in a run started with OMP_NUM_THREADS set. The
# thread count changes float bits: the golden checks (tests/golden_cases.py) take torch's own count
# (`default_threads`, tests/conftest.py).


class RunningStack:
    """`u1serve up` on the CPU; with `terminal`, its stderr is a pseudo-terminal (where progress lines are drawn:
    `terminal_output()`), its stdout the log as always; `env` is added to the launcher's environment (which its
    services inherit)."""

    def __init__(self, model: str, mode: str, run_dir: str, extra: list[str] | None = None, terminal: bool = False,
                 env: dict[str, str] | None = None):
        self.port, self.und_port, self.gen_port = free_port(), free_port(), free_port()
        self.run_dir = run_dir
        self.state_file = os.path.join(run_dir, "stack.json")
        self.pool = f"u1serve-test-{os.getpid()}-{self.port}"
        self.token = f"token-{self.port}"
        self.shm_before = shm_entries()
        argv = [sys.executable, "-m", "services.launch.cli", "up", "--model", model, "--mode", mode,
                "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
                "--und-port", str(self.und_port), "--gen-port", str(self.gen_port),
                "--kv-pool-name", self.pool, "--kv-pool-gb", "0.1", "--internal-token", self.token, "--run-dir", run_dir,
                "--grace", "8", "--default-size", "64x64"] + (extra or [])
        self.log = open(os.path.join(run_dir, "launcher.out"), "w")
        self.terminal = Terminal() if terminal else None
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log,
                                     stderr=self.terminal.slave if terminal else subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                                     preexec_fn=preexec_die_with_parent)
        if self.terminal:
            self.terminal.started()
        self.base = f"http://127.0.0.1:{self.port}"
        self.und, self.gen = f"http://127.0.0.1:{self.und_port}", f"http://127.0.0.1:{self.gen_port}"
        self.pids: dict[str, int] = {}

    def wait_ready(self, timeout: float = 240.0) -> "RunningStack":
        try:
            wait_ok(self.base + "/health", self.proc, self.output, timeout, "u1serve up")
        except RuntimeError:
            self.stop()
            raise
        self.pids = self.service_pids()
        return self

    def service_pids(self) -> dict[str, int]:
        with open(self.state_file) as f:
            return {k: v["pid"] for k, v in json.load(f)["services"].items()}

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(os.path.join(self.run_dir, "launcher.out")) as f:
            return f.read()[-20000:]

    def terminal_output(self) -> str:
        """What the pseudo-terminal showed (all of it once the stack stopped)."""
        return self.terminal.shown()

    def stop(self, sig=signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        self.log.close()
        if self.terminal:
            self.terminal.close()
        return self.proc.returncode

    def stop_clean(self) -> None:
        """Stop (Ctrl-C) and assert a clean exit: status 0, no service process group, no new shm entry."""
        code = self.stop()
        # a rank's multiprocessing semaphores (sem.mp-*) go with its resource tracker, which can outlive the
        # launcher's exit by a moment: what is still there after a few seconds is a leak
        deadline = time.monotonic() + 5.0
        groups, shm = self.leftovers()
        while (groups or shm) and time.monotonic() < deadline:
            time.sleep(0.2)
            groups, shm = self.leftovers()
        assert code == 0, self.output()
        assert not groups and not shm, (groups, shm)

    def leftovers(self) -> tuple[list[int], list[str]]:
        """(live process groups of the services, new /dev/shm entries) after stop(): the stack's pool and
        multiprocessing semaphores (sem.mp-*) that no live process holds -- a semaphore some live process has
        mapped belongs to another run (a parallel test worker's stack), not to this stopped one."""
        groups = [p for p in self.pids.values() if group_alive(p) or pid_alive(p)]
        new = shm_entries() - self.shm_before
        sems = {e for e in new if e.startswith("sem.mp-")}
        new_shm = sorted({e for e in new if e.startswith(self.pool)} | (sems - mapped_shm() if sems else set()))
        return groups, new_shm


def rl_stack(model: str, run_dir: str) -> RunningStack:
    """A ready colocate stack whose weights its tests change: the RL routes on and /tmp allowed (where the trainers
    and the RL benches write their weight pushes). One CPU thread a process: und, gen, gateway and a trainer or
    bench share CI's two cores, and OpenMP oversubscription slows these tiny forwards ten-fold."""
    return RunningStack(model, "colocate", run_dir, extra=["--enable-rl", "--allowed-local-dirs", "/tmp"],
                        env=ONE_THREAD).wait_ready()
