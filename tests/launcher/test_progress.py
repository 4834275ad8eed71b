"""Progress where people wait (services/progress.py), drawn only on a terminal: `u1serve up`'s line per engine
(a stack of stand-in services under a pseudo-terminal), `u1serve convert`'s shards; nothing on a pipe or with
U1SERVE_PROGRESS=0. And a CPU start says nothing of GPU sharing or MPS."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STACK = """
import io, sys
from services.launcher import Stack
from tests.launcher.test_launcher import spec
stack = Stack([spec("alpha", "ok"), spec("beta", "ok")], out=io.StringIO(), grace_s=2, startup_timeout_s=30)
stack.start()
stack.stop()
"""


def in_terminal(argv: list[str], **env: str) -> tuple[int, str]:
    """Run `argv` with stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))    # a terminal's size
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=slave,
                         env={**os.environ, "PYTHONPATH": ROOT, **env})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:            # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(60), b"".join(chunks).decode(errors="replace")


def test_up_shows_each_engine_on_a_terminal_only():
    code, shown = in_terminal([sys.executable, "-c", STACK])
    assert code == 0, shown
    assert "[u1serve] alpha: ready" in shown and "[u1serve] beta: ready" in shown, shown
    code, shown = in_terminal([sys.executable, "-c", STACK], U1SERVE_PROGRESS="0")
    assert code == 0 and "ready" not in shown, shown
    piped = subprocess.run([sys.executable, "-c", STACK], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert piped.returncode == 0 and "ready" not in piped.stderr, piped.stderr


def test_convert_shows_its_shards(tiny_dir, tmp_path):
    code, shown = in_terminal([sys.executable, "-m", "services.cli", "convert", tiny_dir, str(tmp_path / "q"),
                               "--to", "int8"])
    assert code == 0, shown
    assert "[u1serve] convert to int8" in shown and "shard" in shown, shown


def test_a_cpu_start_says_nothing_of_gpu_sharing():
    r = subprocess.run([sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--device", "cpu",
                        "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert "MPS" not in r.stderr and "GPU sharing" not in r.stderr, r.stderr
    assert "engines share the CPU" in r.stderr
