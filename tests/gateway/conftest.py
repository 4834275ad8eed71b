"""A real gateway process with NO engines behind it: validation must answer on its own,
and valid requests must get a 503 (dead dependency), never a 500."""
import os
import subprocess
import sys
import time

import httpx
import pytest
from services.netutil import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "sk-gateway-test"


@pytest.fixture(scope="session")
def gateway():
    port = free_port()
    argv = [sys.executable, "-m", "services.gateway.server", "--host", "127.0.0.1",
            "--port", str(port), "--und-url", f"http://127.0.0.1:{free_port()}",
            "--gen-url", f"http://127.0.0.1:{free_port()}", "--default-size", "64x64",
            "--max-body-mb", "8"]
    env = {**os.environ, "U1SERVE_API_KEY": API_KEY, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())
        try:
            if httpx.get(base + "/metrics", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("gateway did not start")
    yield base
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    out = proc.stdout.read().decode()
    assert "Traceback" not in out, out


@pytest.fixture()
def client(gateway):
    with httpx.Client(base_url=gateway, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
