"""`u1serve up` as a real process tree on CPU (tiny checkpoint): it fails fast with the failing service's last
lines, chooses free engine ports when the ones derived from --port are taken, passes secrets through the
environment only, and restarts a killed service."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.netutil import free_port
from tests.system.stackproc import ROOT, group_alive, pid_alive
from tests.waiting import wait_until


def _up(*args: str, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args], cwd=ROOT,
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
    assert "start-up failed: und failed" in out and "safetensors" in out, out
    assert out.index("und failed") < out.index("[u1serve] stopped"), out


@pytest.fixture()
def busy_port():
    """A port that something listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_stack_ports_secrets_and_restart(tiny_checkpoint, tmp_path, busy_port):
    # the gateway's port is chosen so that the understanding port derived from it (+100) is taken
    port = busy_port - 100
    if port < 1024 or not _free(port) or not _free(port + 200):
        pytest.skip("no suitable port pair")
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-from-a-file\n")
    run = tmp_path / "run"
    p = _up("--model", tiny_checkpoint("u1"), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--api-key-file", str(key_file), "--run-dir", str(run), "--kv-pool-gb", "0.05", "--grace", "5",
            env={"U1SERVE_INTERNAL_TOKEN": "tok-from-env"})
    base = f"http://127.0.0.1:{port}"
    output = _Output(p)
    try:
        # the launcher's start-up is over (not only the gateway answering): a service killed before that ends
        # the start-up instead of being restarted
        assert wait_until(lambda: output.has("[u1serve] ready:") or p.poll() is not None, 240), output.text()
        assert _ok(base + "/health"), output.text()
        state = json.loads((run / "stack.json").read_text())
        und_url = state["services"]["und"]["health_url"]
        assert f":{busy_port}/" not in und_url                              # a free port instead of the taken one
        assert state["services"]["gen"]["health_url"] == f"http://127.0.0.1:{port + 200}/health"
        # secrets: on no command line of the stack, but in the services' environment
        pids = [q for s in state["services"].values() for q in _tree(s["pid"])]
        for q in pids + [p.pid]:
            with open(f"/proc/{q}/cmdline", "rb") as f:
                cmd = f.read()
            assert b"sk-from-a-file" not in cmd and b"tok-from-env" not in cmd
        with open(f"/proc/{state['services']['gateway']['pid']}/environ", "rb") as f:
            assert b"U1SERVE_INTERNAL_TOKEN=tok-from-env" in f.read().split(b"\0")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer sk-from-a-file"})
        assert r.status_code == 200, r.text
        # a killed service is restarted by the launcher
        gen = state["services"]["gen"]["pid"]
        os.killpg(gen, signal.SIGKILL)
        assert wait_until(lambda: json.loads((run / "stack.json").read_text())["services"]["gen"]["pid"] != gen, 60)
        assert wait_until(lambda: _ok(base + "/health"), 180)
        r = httpx.post(base + "/v1/images/generations", timeout=120, headers={"Authorization": "Bearer sk-from-a-file"},
                       json={"prompt": "x", "size": "64x64", "num_inference_steps": 1})
        assert r.status_code == 200, r.text
        groups = [s["pid"] for s in json.loads((run / "stack.json").read_text())["services"].values()]
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
        out = output.text()
    assert p.returncode == 0, out
    assert "gen died (killed by SIGKILL); restarting in" in out and "gen ready again (restart 1)" in out, out
    assert out.rstrip().endswith("[u1serve] stopped"), out[-2000:]
    assert not any(group_alive(g) or pid_alive(g) for g in groups)
    logs = "".join((run / "logs" / f).read_text() for f in os.listdir(run / "logs"))
    assert "terminated by a signal" not in logs and "Traceback" not in logs


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
    from services.launcher import port_free
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
    r = subprocess.run([sys.executable, "-m", "services.cli", "demo", "--steps", "1"], cwd=work, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "U1SERVE_CACHE": str(cache)},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"image saved to {cache / 'u1serve-demo.png'}" in r.stdout
    assert (cache / "u1serve-demo.png").exists() and os.listdir(work) == []     # nothing in the working dir
    logs = "".join(p.read_text() for p in (cache / "run-demo" / "logs").iterdir())
    assert "terminated by a signal" not in logs and "Traceback" not in logs
