"""Process management for `u1serve up`: start the services in waves, keep them running, stop them.

Start: the services of one wave start together and the next wave waits until all of them are healthy (the engines
first: understanding and generation load and warm up side by side, since neither needs the other to start:
generation opens understanding's KV pool when it appears; then the gateway).

Each service runs as its own process group (its engine ranks included) under the one supervisor
(services.kit.supervisor): a service that dies is restarted with exponential backoff within a restart budget;
one that never became healthy (it exited, its /health says its engine failed, or the start-up timeout passed)
is not restarted: the stack stops and `u1serve up` exits non-zero, printing that service's last log lines.
Stop: SIGTERM to each service's leader process (it shuts its own engines down; a group-wide signal would look
like a crash to them), a grace period, then SIGKILL to whatever is left of the group. Children get
PR_SET_PDEATHSIG, so a launcher killed with SIGKILL does not leave them behind. The understanding service owns
the KV pool segment (/dev/shm/<pool name>). Every shm segment records the stack that made it (its id, in the
segment: shm_transfer/segment.py): at start the launcher refuses names a live stack holds and reclaims those of
dead ones; after shutdown it unlinks only the segments its own stack made (in case a service was killed), never
another stack's, and removes private directories (`u1und-*`) that dead processes left.
Daemons the services need (the deployment's CUDA MPS control daemon, services/launch/mps.py) are started before the
first service and stopped after the last one, on every exit path.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

from services.kit.proc import preexec_die_with_parent
from services.kit.restart import RestartPolicy
from services.kit.supervisor import Supervisor
from services.launch.progress import Phase, starting_line

SHM_DIR = "/dev/shm"
TAIL_LINES = 20
SERVICE_RESTARTS = RestartPolicy(base_delay_s=1.0, max_delay_s=30.0, max_failures=5, window_s=600.0)
_FAILED_HEALTH = ("error", "failed")     # /health statuses of a service whose engine cannot run


@dataclass
class ServiceSpec:
    name: str                    # short log prefix: und, gen, gateway
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)
    wave: int = 0                # started with the other services of its wave, once every earlier wave is healthy


class ServiceLog:
    """A service's output across restarts: a log file, optional echo with a `[name]` prefix, the last lines."""

    def __init__(self, name: str, out: Optional[TextIO], log_dir: Optional[str]):
        self.name = name
        self.out = out
        self.path = os.path.join(log_dir, f"{name}.log") if log_dir else None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()

    def pump(self, stream) -> None:
        logf = open(self.path, "a", buffering=1) if self.path else None
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self._lock:
                    self.tail.append(line)
                    if self.out is not None:
                        try:
                            self.out.write(f"[{self.name}] {line}\n")
                            self.out.flush()
                        except (ValueError, OSError):
                            pass
                if logf:
                    logf.write(line + "\n")
        finally:
            if logf:
                logf.close()

    def last_lines(self) -> list[str]:
        with self._lock:
            return list(self.tail)


class ServiceProcess:
    """One run of a service, in its own process group (a kit.supervisor Unit)."""

    def __init__(self, spec: ServiceSpec, log: ServiceLog, grace_s: float):
        self.spec = spec
        self.grace_s = grace_s
        self.failure: Optional[str] = None      # set when we killed it for failing its health check
        self._asked_to_stop = False
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=preexec_die_with_parent)
        self.pump = threading.Thread(target=log.pump, args=(self.proc.stdout,), daemon=True,
                                     name=f"log-{spec.name}")
        self.pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_reason(self) -> str:
        if self.failure:
            return self.failure
        code = self.proc.poll()
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stopped_on_purpose(self) -> bool:
        return self._asked_to_stop

    def fail(self, reason: str) -> None:
        """It is up but cannot serve (its /health says so, or it never got healthy): kill it."""
        self.failure = reason
        self._signal_group(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM the leader when it still runs, wait up to the grace period for the group, then SIGKILL it."""
        if self.alive() and not self._asked_to_stop:
            self._asked_to_stop = True
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and self.group_alive():
                time.sleep(0.1)
        self._signal_group(signal.SIGKILL)      # ranks left behind by a dead leader, or a stuck one
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)        # pgid == pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


def health(url: str, timeout: float = 2.0) -> tuple[Optional[int], dict]:
    """(HTTP status or None when nothing answers, JSON body or {})."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, _json(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _json(e.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None, {}


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class StartupError(RuntimeError):
    pass


class Service:
    """A service kept running by its own kit.supervisor; a thread per run waits for it to get healthy."""

    def __init__(self, spec: ServiceSpec, log: ServiceLog, *, grace_s: float, startup_timeout_s: float,
                 policy: RestartPolicy, on_give_up: Callable[["Service", str], None], on_change: Callable[[], None]):
        self.spec = spec
        self.log = log
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.on_change = on_change
        self.sup = Supervisor(spec.name, self._spawn, policy=policy,
                              on_give_up=lambda why: on_give_up(self, why))
        self.phase = "waiting"                  # for the progress line of `u1serve up` (services/launch/progress.py)

    @property
    def unit(self) -> Optional[ServiceProcess]:
        return self.sup.unit  # type: ignore[return-value]

    def _spawn(self) -> ServiceProcess:
        self.phase = "starting its process"
        unit = ServiceProcess(self.spec, self.log, self.grace_s)
        threading.Thread(target=self._until_healthy, args=(unit,), daemon=True,
                         name=f"health-{self.spec.name}").start()
        return unit

    def _until_healthy(self, unit: ServiceProcess) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while self.sup.unit is not unit and unit.alive() and time.monotonic() < deadline:
            time.sleep(0.01)                    # the supervisor records the new run right after _spawn
        self.on_change()
        while unit.alive() and self.sup.state not in (Supervisor.STOPPED, Supervisor.FAILED):
            status, body = health(self.spec.health_url)
            if status is not None:               # its HTTP server is up: the engine loads its weights, warms up
                self.phase = starting_line(body)
            if status == 200:
                self.sup.mark_ready(unit)
                return
            if status == 503 and body.get("status") in _FAILED_HEALTH:
                unit.fail(f"its /health reports {body.get('status')}: "
                          f"{body.get('error') or body.get('failure') or body.get('last_error') or 'no detail'}")
                return
            if time.monotonic() > deadline:
                unit.fail(f"not healthy at {self.spec.health_url} after {self.startup_timeout_s:.0f} s")
                return
            time.sleep(0.25)


class Stack:
    """An ordered set of services: started wave by wave (a wave's services together, the next once they are all
    healthy), stopped in reverse order."""

    def __init__(self, specs: list[ServiceSpec], *, out: TextIO = sys.stdout,
                 log_dir: Optional[str] = None, shm_names: Optional[list[str]] = None,
                 grace_s: float = 10.0, startup_timeout_s: float = 900.0, restart: bool = True,
                 policy: Optional[RestartPolicy] = None, state_file: Optional[str] = None,
                 echo_logs: bool = True, daemons: Optional[list] = None, stack_id: str = "",
                 private_dirs: Optional[list[str]] = None):
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self.out = out
        self.shm_names = shm_names or []
        self.stack_id = stack_id            # the owner recorded in the segments this stack's services create
        self.private_dirs = private_dirs or []      # temp-dir prefixes of per-process dirs (kit/rundirs.py)
        self.device = ""                    # for the start line, e.g. "cuda bfloat16, GPUs 0,1"
        self.state_file = state_file
        self.daemons = daemons or []      # each: name, argv, env(), start(say) (StartupError), stop(say), state()
        self.info: dict = {}              # more stack.json entries: name -> value, or a function giving it
        policy = policy or (SERVICE_RESTARTS if restart else RestartPolicy(max_failures=1))
        self.services = [Service(s, ServiceLog(s.name, out if echo_logs else None, log_dir), grace_s=grace_s,
                                 startup_timeout_s=startup_timeout_s, policy=policy,
                                 on_give_up=self._gave_up, on_change=self.write_state) for s in specs]
        self.failed: Optional[tuple[Service, str]] = None
        self._stopping = threading.Event()
        self._stopped = False
        self._state_lock = threading.Lock()   # one writer of stack.json at a time: its services' health threads write it
        self._log_handler = _SayHandler(self.say)
        logging.getLogger("u1serve.supervisor").addHandler(self._log_handler)
        logging.getLogger("u1serve.supervisor").propagate = False

    def say(self, text: str) -> None:
        try:
            self.out.write(f"[u1serve] {text}\n")
            self.out.flush()
        except (ValueError, OSError):
            pass

    def by_name(self, name: str) -> Service:
        return next(s for s in self.services if s.spec.name == name)

    def _gave_up(self, service: Service, why: str) -> None:
        if self.failed is None and not self._stopping.is_set():
            self.failed = (service, why)
        self._stopping.set()

    def failure_report(self) -> str:
        """Which service failed, why, and its last log lines (printed before anything is stopped)."""
        if self.failed is None:
            return ""
        service, why = self.failed
        lines = service.log.last_lines()
        where = f" (log: {service.log.path})" if service.log.path else ""
        text = f"{service.spec.name} failed: {why}{where}"
        if lines:
            text += f"\n[u1serve] last {len(lines)} lines of {service.spec.name}:\n" + \
                "\n".join(f"    {ln}" for ln in lines)
        return text

    def start(self) -> None:
        """Start the daemons, then the services wave by wave, each wave's together, until all are healthy.
        StartupError (the stack still runs: call stop())."""
        self._take_shm_names()
        for d in self.daemons:
            if not self._stopping.is_set():
                d.start(self.say)
        for wave in sorted({s.spec.wave for s in self.services}):
            if self._stopping.is_set():
                break
            self._start_together([s for s in self.services if s.spec.wave == wave])
        if self.failed is not None:
            raise StartupError(self.failure_report())
        if self._stopping.is_set():
            raise StartupError("stopped during start-up")

    def _start_together(self, wave: list[Service]) -> None:
        t0 = time.monotonic()
        lines = {}
        for i, s in enumerate(wave):
            self.say(f"starting {s.spec.name}")
            lines[s.spec.name] = Phase(f"[u1serve] {s.spec.name}", position=i)   # a terminal's live lines
            s.sup.start()
        waiting = list(wave)
        while waiting:
            for s in list(waiting):
                lines[s.spec.name](s.phase)
                if s.sup.ready:
                    waiting.remove(s)
                    lines[s.spec.name].close("ready")
                    self.say(f"{s.spec.name} healthy in {time.monotonic() - t0:.1f}s (pid {s.unit.pid})")
            if waiting and self._stopping.wait(0.1):
                break
        for s in waiting:
            lines[s.spec.name].close("stopped")

    def _take_shm_names(self) -> None:
        """The shm names this stack will create: one a live process holds fails the start now, with its owner
        (a second stack with the same --kv-pool-name); a dead stack's segment is reclaimed."""
        from shm_transfer.errors import PoolError
        from shm_transfer.segment import take_name
        for name in self.shm_names:
            try:
                take_name(name, "shared-memory segment")
            except (PoolError, ValueError) as exc:
                raise StartupError(str(exc)) from None

    def write_state(self) -> None:
        if not self.state_file:
            return
        state = {"launcher_pid": os.getpid(),
                 "services": {s.spec.name: {"pid": s.unit.pid if s.unit else None, "health_url": s.spec.health_url,
                                            "restarts": s.sup.restarts} for s in self.services},
                 "shm": self.shm_names, **{d.name: d.state() for d in self.daemons},
                 **{k: v() if callable(v) else v for k, v in self.info.items()}}
        tmp = self.state_file + ".tmp"
        with self._state_lock:     # two services turning healthy together once raced on the one tmp file
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.state_file)

    def supervise(self) -> int:
        """Until stop is requested (0) or a service is down for good (1; the reason is printed)."""
        self._stopping.wait()
        if self.failed is not None:
            self.say(self.failure_report())
            return 1
        return 0

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        """Stop every service (gateway first): SIGTERM to its leader, grace period, SIGKILL to its group; then the
        daemons."""
        self._stopping.set()
        if self._stopped:
            return
        self._stopped = True
        for s in reversed(self.services):
            if s.sup.unit is not None:
                s.sup.stop()
        for d in reversed(self.daemons):
            d.stop(self.say)
        self.release_shm()
        if self.state_file:
            try:
                os.unlink(self.state_file)
            except FileNotFoundError:
                pass
        logging.getLogger("u1serve.supervisor").removeHandler(self._log_handler)
        self.say("stopped")


    def release_shm(self) -> None:
        """After the services stopped: the segments this stack made that a killed service left (never another
        stack's: the owner recorded in each decides), the RL trajectory segments under its pools' names that no live
        process holds, and private directories of dead processes."""
        from services.generation.trajectory_names import reclaim
        from services.kit.rundirs import reclaim_stale
        from shm_transfer.segment import unlink_if_owned
        for name in self.shm_names:
            try:
                unlink_if_owned(name, self.stack_id)
                reclaim(name)       # RL trajectory segments a killed generation server of this pool left
            except (ValueError, OSError):
                pass
        for prefix in self.private_dirs:
            reclaim_stale(prefix)


class _SayHandler(logging.Handler):
    """The supervisors' log lines (died, restarting, ready again, gave up) on the launcher's output."""

    def __init__(self, say: Callable[[str], None]):
        super().__init__(logging.INFO)
        self._say = say

    def emit(self, record: logging.LogRecord) -> None:
        if record.funcName != "_give_up":      # a give-up is printed with the service's last lines instead
            self._say(record.getMessage())


def port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port (a server binding it would succeed)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", port))
        except OSError:
            return False
    return True




def run_until_signal(stack: Stack, on_ready: Optional[Callable[[], None]] = None) -> int:
    """Start the stack, supervise it until SIGINT/SIGTERM or a service is down for good, shut down cleanly.
    Returns the exit code (1 when a service failed: its reason and last lines are printed first)."""
    def handler(signum, frame):
        stack.say(f"received {signal.Signals(signum).name}; shutting down")
        stack.request_stop()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            stack.start()
        except StartupError as exc:
            stack.say(f"start-up failed: {exc}")
            return 1
        if on_ready:
            on_ready()
        return stack.supervise()
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
