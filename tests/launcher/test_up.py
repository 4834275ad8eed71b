"""`u1serve up` as a real process tree on CPU (tiny checkpoint): it fails fast with the failing service's last
lines, and `u1serve demo` leaves nothing in the working dir. That it chooses free engine ports when the ones derived
from --port are taken, passes secrets through the environment only and restarts a killed service is checked on
the one running stack of tests/launcher/test_mps.py (with its GPU-sharing daemon's lifecycle)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx

from services.base.netutil import free_port
from tests.system.stackproc import ROOT


def _up(*args: str, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.launch.cli", "up", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(") ", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def test_broken_checkpoint_exits_nonzero_at_once_with_the_last_lines(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("u1"), broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            (broken / name).write_bytes(b"\0" * 16)
    t0 = time.monotonic()
    p = _up("--model", str(broken), "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()),
            "--run-dir", str(tmp_path / "run"), "--kv-pool-gb", "0.05")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 1, out
    assert time.monotonic() - t0 < 120, out           # not the 900 s start-up timeout
    # the engines start together: whichever reads the checkpoint first reports it
    failed = re.search(r"start-up failed: (und|gen) failed", out)
    assert failed and "safetensors" in out, out
    assert out.index(f"{failed.group(1)} failed") < out.index("[u1serve] stopped"), out


class _Output:
    """A process's stdout read as it comes, so a test can wait for a line (and a full pipe never blocks it)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def text(self) -> str:
        self._reader.join(timeout=30)
        return "".join(self.lines)


def _free(port: int) -> bool:
    from services.launch.launcher import port_free
    return port_free("127.0.0.1", port)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_demo_writes_its_image_to_the_cache_dir_and_exits_quietly(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", "demo", "--steps", "1"], cwd=work, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "U1SERVE_CACHE": str(cache)},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"image saved to {cache / 'u1serve-demo.png'}" in r.stdout
    assert (cache / "u1serve-demo.png").exists() and os.listdir(work) == []     # nothing in the working dir
    logs = "".join(p.read_text() for p in (cache / "run-demo" / "logs").iterdir())
    assert "terminated by a signal" not in logs and "Traceback" not in logs
