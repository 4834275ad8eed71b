"""`u1serve up --gpu-sharing mps` (and `auto`, the default, where MPS can run: services/launch/colocate_qos.py): the
deployment's own CUDA MPS control daemon and its GPU services' environment.

Two engines on one GPU are time-sliced by the driver, so a chat decode step waits behind an image step. Under
MPS their kernels run side by side; capping the generation processes' SM share
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, --gen-sm-percent) leaves understanding's decode kernels room
(docs/benchmarks/deployment.md, "MPS, measured on one H200").

The daemon is private to the deployment: its pipe and log directories lie under the run dir
(CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY), so it never meets a system-wide daemon or another stack's.
It sees only the deployment's GPUs (CUDA_VISIBLE_DEVICES), which MPS renumbers from 0 for its clients: a
service's CUDA_VISIBLE_DEVICES becomes the positions of its GPUs in the daemon's list. The launcher starts it
before the GPU services and stops it after them (`quit` on its control pipe, a wait, then SIGKILL to it and its
servers); a daemon left behind by a launcher that was killed outright is stopped by the next start in the same
run dir. The daemon writes its pid to <pipe dir>/nvidia-cuda-mps-control.pid and removes it when it exits.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Callable, Optional

from services.launch.launcher import StartupError

CONTROL = "nvidia-cuda-mps-control"
# 50: the only cap of 85 / 75 / 70 / 60 / 50 % at which cuBLAS computed the generation branch's GEMMs right in an MPS
# client (one H100, driver 580.159.04, 2026-12-06: deploy/mps_probe.py "check"; at 60-85 % plain bf16 GEMMs came out
# wrong, then NaN images). Was 85 (2 H200 TP2 + CFG2: chat p90 1.82x alone, image +5-7 %), with NaN images.
DEFAULT_GEN_SM_PERCENT = 50
SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# 0 NORMAL, 1 BELOW_NORMAL: the GPU's work distributor dispatches a normal client's blocks before a below-normal
# one's queued blocks (it preempts nothing that runs), so a decode kernel does not queue behind an image GEMM's
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
GEN_PRIORITIES = {"normal": "0", "low": "1"}
# low by default: side by side on 2 H200 (TP2 + CFG2) the loaded chat p90 is 1.82x alone at low, 2.15x at normal,
# for ~1 point of image time (docs/benchmarks/deployment.md)
DEFAULT_GEN_PRIORITY = "low"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
PID_FILE = "nvidia-cuda-mps-control.pid"
# a Unix socket path holds 107 bytes; the daemon's longest socket in its pipe dir is control_privileged
MAX_PIPE_DIR = 107 - len("/control_privileged")
START_TIMEOUT_S = 15.0
QUIT_TIMEOUT_S = 10.0

Say = Callable[[str], None]


class MpsError(StartupError):
    pass


class MpsDaemon:
    """The MPS control daemon of one deployment (a launcher daemon: start(say), stop(say), state())."""

    name = "mps"

    def __init__(self, run_dir: str, gpus: list[str], gen_sm_percent: int, gen_priority: str = DEFAULT_GEN_PRIORITY):
        base = os.path.join(os.path.abspath(run_dir), "mps")
        self.pipe_dir = os.path.join(base, "pipe")
        self.log_dir = os.path.join(base, "log")
        self.gpus = gpus
        self.gen_sm_percent = gen_sm_percent
        self.gen_priority = gen_priority
        self.argv = [CONTROL, "-d"]
        self.pid: Optional[int] = None
        self._launched = False      # `-d` ran: a daemon that came up after start() gave up is stopped too

    # -- environments ------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The daemon's environment (also what `quit` needs to reach it)."""
        env = {PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    def client_env(self, env: dict[str, str], capped: bool) -> dict[str, str]:
        """A GPU service's environment under this daemon: its pipe dir, its GPUs renumbered as MPS shows them,
        and, for generation (`capped`), the SM cap and the scheduling priority."""
        out = {**env, PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible and self.gpus:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(str(self.gpus.index(g)) for g in visible.split(","))
        if capped:
            out[SM_PERCENT_ENV] = str(self.gen_sm_percent)
            if self.gen_priority != "normal":
                out[PRIORITY_ENV] = GEN_PRIORITIES[self.gen_priority]
        return out

    def state(self) -> dict:
        return {"pid": self.pid, "pipe_dir": self.pipe_dir, "log_dir": self.log_dir, "gpus": self.gpus,
                "gen_sm_percent": self.gen_sm_percent, "gen_priority": self.gen_priority}

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, say: Say) -> None:
        """Start the daemon and wait until it runs; MpsError (a StartupError) says why it cannot."""
        exe = shutil.which(CONTROL)
        if exe is None:
            raise MpsError(f"--gpu-sharing mps needs {CONTROL} on PATH. It comes with the NVIDIA driver's compute "
                           "utilities (e.g. the nvidia-compute-utils-<driver version> package, or the driver's .run "
                           "installer); a container needs it from the host driver (the NVIDIA container toolkit "
                           "with the 'compute,utility' capabilities). Or run without MPS: --gpu-sharing time-slice")
        if len(self.pipe_dir) > MAX_PIPE_DIR:
            raise MpsError(f"the MPS pipe directory {self.pipe_dir} is {len(self.pipe_dir)} characters long; its "
                           f"Unix sockets need at most {MAX_PIPE_DIR}: pass a shorter --run-dir")
        check_compute_modes(self.gpus)
        leftover = self._running_pid()
        if leftover:
            say(f"stopping the MPS control daemon (pid {leftover}) left in {self.pipe_dir} by an earlier run")
            self._quit(leftover, say)
        os.makedirs(self.pipe_dir, mode=0o700, exist_ok=True)
        os.makedirs(self.log_dir, mode=0o700, exist_ok=True)
        self._launched = True
        with open(os.path.join(self.log_dir, "launch.out"), "wb") as out:
            try:      # `-d` forks the daemon and returns; its own session keeps Ctrl-C off it
                code = subprocess.run([exe, "-d"], env={**os.environ, **self.env()}, stdin=subprocess.DEVNULL,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                      timeout=START_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                code = None
        # a `-d` that failed leaves no daemon to wait for (a moment for one that failed after starting it)
        deadline = time.monotonic() + (START_TIMEOUT_S if code == 0 else 1.0)
        while self.pid is None and time.monotonic() < deadline:
            self.pid = self._running_pid()
            if self.pid is None:
                time.sleep(0.05)
        if self.pid is None:
            how = "did not return" if code is None else f"exited {code}"
            raise MpsError(f"the MPS control daemon did not start ({CONTROL} -d {how}; no running daemon in "
                           f"{self.pipe_dir}){self._log_tails()}")
        say(f"MPS control daemon running (pid {self.pid}; GPUs {','.join(self.gpus) or 'none'}; pipe dir "
            f"{self.pipe_dir}); generation capped at {self.gen_sm_percent} % of the SMs, priority {self.gen_priority}")

    def stop(self, say: Say) -> None:
        """Quit the daemon (after the services: MPS waits for its clients), kill it on a timeout. Idempotent."""
        pid, self.pid = self.pid or (self._running_pid() if self._launched else None), None
        self._launched = False
        if pid is not None:
            self._quit(pid, say)

    def _quit(self, pid: int, say: Say) -> None:
        deadline = time.monotonic() + QUIT_TIMEOUT_S
        exe = shutil.which(CONTROL)
        if exe is not None:
            try:
                subprocess.run([exe], input=b"quit\n", env={**os.environ, **self.env()}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True, timeout=QUIT_TIMEOUT_S)
            except (subprocess.TimeoutExpired, OSError):
                pass
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            for victim in descendants(pid) + [pid]:      # its MPS servers too
                try:
                    os.kill(victim, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            gone = _wait_gone(pid, 5.0)
            say(f"the MPS control daemon (pid {pid}) did not quit within {QUIT_TIMEOUT_S:.0f} s: "
                + ("killed it and its servers" if gone else "SIGKILL did not end it"))
        else:
            say(f"MPS control daemon (pid {pid}) stopped")
        shutil.rmtree(self.pipe_dir, ignore_errors=True)     # its sockets and pid file; the logs stay

    def _running_pid(self) -> Optional[int]:
        """The pid of a live daemon serving this pipe dir, or None."""
        try:
            with open(os.path.join(self.pipe_dir, PID_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if pid > 0 and _alive(pid) and self._is_ours(pid) else None

    def _is_ours(self, pid: int) -> bool:
        """Its environment names this pipe dir (a reused pid does not), or, where that is unreadable, it is the
        control binary."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"{PIPE_ENV}={self.pipe_dir}".encode() in f.read().split(b"\0")
        except PermissionError:
            pass
        except OSError:
            return False
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return os.path.basename(f.read().split(b"\0")[0]) == CONTROL.encode()
        except OSError:
            return False

    def _log_tails(self) -> str:
        text = ""
        for name in ("launch.out", "control.log"):
            path = os.path.join(self.log_dir, name)
            try:
                with open(path, errors="replace") as f:
                    lines = f.read().splitlines()[-20:]
            except OSError:
                continue
            if lines:
                text += f"\n[u1serve] last {len(lines)} lines of {path}:\n" + "\n".join(f"    {ln}" for ln in lines)
        return text


def check_compute_modes(gpus: list[str]) -> None:
    """MPS runs on GPUs in Default or Exclusive_Process compute mode; Prohibited admits no process at all.
    Checked with nvidia-smi where it answers (else the daemon reports it)."""
    smi = shutil.which("nvidia-smi")
    if not gpus or smi is None:
        return
    try:
        out = subprocess.run([smi, "--query-gpu=index,compute_mode", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return
    if out.returncode != 0:
        return
    modes = {}
    for line in out.stdout.splitlines():
        index, _, mode = line.partition(",")
        modes[index.strip()] = mode.strip()
    prohibited = [g for g in gpus if modes.get(g, "").lower() == "prohibited"]
    if prohibited:
        raise MpsError(f"GPU {','.join(prohibited)} is in compute mode Prohibited: no CUDA process may use it, MPS "
                       "included. Set it to Default or Exclusive_Process (as root: nvidia-smi -i N -c DEFAULT)")


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (one that is our child is reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    if state == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc's parent links."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
