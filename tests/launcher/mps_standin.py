"""STAND-IN for `nvidia-cuda-mps-control`, for the launcher's MPS tests on machines without an NVIDIA driver.

The tests put a `nvidia-cuda-mps-control` wrapper that runs this script first on PATH. It mimics what the launcher
relies on, nothing of MPS itself:
  `-d`      daemonises a sleeper (double fork, own session) that writes its pid to
            $CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid, logs to $CUDA_MPS_LOG_DIRECTORY/control.log,
            and on SIGTERM removes the pid file and exits; `-d` returns at once, as the real one does.
  no args   reads commands on stdin; `quit` stops the daemon of that pipe dir (SIGTERM).
Every call appends a JSON record (argv, the MPS variables and CUDA_VISIBLE_DEVICES it saw, time) to
$CUDA_MPS_LOG_DIRECTORY/standin-calls.jsonl; a `quit` also records the processes still connected then (those whose
environment names the pipe dir), which must be none: the launcher quits after its services are gone.
Knobs (environment): MPS_STANDIN_FAIL=1: `-d` fails (a control.log line, exit status 1, no daemon);
MPS_STANDIN_IGNORE_QUIT=1: `quit` is ignored (the launcher must kill the daemon).
"""
import json
import os
import signal
import sys
import time

PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
LOGS = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
PID_FILE = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")


def record(**extra) -> None:
    seen = {k: v for k, v in os.environ.items() if k.startswith("CUDA_")}
    with open(os.path.join(LOGS, "standin-calls.jsonl"), "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "env": seen, "time": time.time(), "pid": os.getpid(), **extra})
                + "\n")


def log(text: str) -> None:
    with open(os.path.join(LOGS, "control.log"), "a") as f:
        f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")


def clients() -> list[int]:
    """Processes other than this one whose environment names our pipe dir."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={PIPE}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat") as s:
                            if s.read().rsplit(") ", 1)[1][0] != "Z":
                                out.append(int(entry))
            except OSError:
                pass
    return out


def daemon() -> int:
    if os.environ.get("MPS_STANDIN_FAIL") == "1":
        log("Failed to start: the stand-in was told to fail (MPS_STANDIN_FAIL=1)")
        print("An MPS control daemon could not be started (stand-in told to fail)", file=sys.stderr)
        return 1
    if os.fork():
        return 0                     # `-d` returns; the daemon lives on
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)

    def quit_(signum, frame):
        log("Shutdown")
        try:
            os.unlink(PID_FILE)
        except FileNotFoundError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, quit_)
    with open(PID_FILE + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(PID_FILE + ".tmp", PID_FILE)
    log(f"Startup (stand-in, pid {os.getpid()})")
    while True:
        time.sleep(60)


def control() -> int:
    try:
        with open(PID_FILE) as f:
            pid = int(f.read())
    except (OSError, ValueError):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    for line in sys.stdin:
        if line.strip() == "quit":
            record(command="quit", clients_at_quit=[p for p in clients() if p != pid])
            log("User did quit")
            if os.environ.get("MPS_STANDIN_IGNORE_QUIT") != "1":
                os.kill(pid, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    os.makedirs(LOGS, exist_ok=True)
    record()
    if sys.argv[1:] == ["-d"]:
        sys.exit(daemon())
    sys.exit(control())
