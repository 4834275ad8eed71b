"""Starting and guarding the service: no start without an internal token (the error says how to set one);
every route but /health needs it (constant-time compare; wrong, missing or non-ASCII tokens are 401);
an engine that fails at its first start is not retried and the server exits non-zero with the engine's
error (and unlinks its shm pool); a healthy start is quiet (no access lines for /health polls, uvicorn's
access log off, request ids in the log lines)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from .conftest import HEADERS, ROOT, TOKEN, UndServer

ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
          ("POST", "/generate_stream"), ("POST", "/internal/image_prefix"), ("POST", "/internal/release"),
          ("POST", "/internal/abort")]


def test_no_token_no_start(tiny_dir):
    env = {k: v for k, v in os.environ.items() if k != "U1SERVE_INTERNAL_TOKEN"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "services.understanding.server", "--model", tiny_dir],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "internal token is required" in p.stderr and "--internal-token-file" in p.stderr


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_but_health_needs_the_token(server, method, path):
    for headers in ({}, {"X-U1-Internal-Token": "wrong"}, {"X-U1-Internal-Token": "t\u00e9st".encode()},
                    {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, server.url + path, json={}, headers=headers, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == "unauthorized" and r.headers["x-request-id"]
    ok = httpx.request(method, server.url + path, json={}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert ok.status_code != 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_engine_that_cannot_start_exits_the_server(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            with open(broken / name, "r+b") as f:
                f.truncate(100)          # config and tokenizer load; the weights do not
    log = _failed_start_log(UndServer(str(broken), log_dir=str(tmp_path)))
    assert log.count("u1-und-engine-0") >= 1          # the engine's own error is in the server's output


def _failed_start_log(s: UndServer) -> str:
    """The log of a server whose engine cannot start: it exits 1, says so, and leaves no pool behind."""
    try:
        code = s.proc.wait(timeout=180)
    finally:
        s.stop()
    log = open(s.log_path).read()
    assert code == 1, log[-3000:]
    assert "the engine failed to start" in log
    assert not os.path.exists(f"/dev/shm/{s.pool_name}")
    return log


def test_a_healthy_start_is_quiet(tiny_dir, tmp_path):
    s = UndServer(tiny_dir, log_dir=str(tmp_path), log_level="info").wait_ready()
    try:
        for _ in range(10):
            s.health()
        r = httpx.post(s.url + "/v1/chat/completions", headers={**HEADERS, "x-request-id": "trace-1"}, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-1"
    finally:
        s.stop()
    lines = open(s.log_path).read().splitlines()
    assert not [ln for ln in lines if "/health" in ln], lines
    assert not [ln for ln in lines if '" 200' in ln or "HTTP/1.1" in ln], lines     # uvicorn's access log is off
    access = [ln for ln in lines if "POST /v1/chat/completions -> 200" in ln]
    assert len(access) == 1 and "[trace-1]" in access[0], lines
    assert not [ln for ln in lines if "WARNING" in ln or "ERROR" in ln or "Traceback" in ln], lines
    assert len(lines) <= 15, lines


def test_device_kv_transport_with_the_engine_in_another_process_exits_clearly(tiny_dir, tmp_path):
    """--kv-transport device puts the pool's pages on the service's device, which only its own process can address:
    the engine process (this mode's engine is not a thread of the server) refuses the pool at start, naming why."""
    log = _failed_start_log(UndServer(tiny_dir, "--kv-transport", "device", log_dir=str(tmp_path)))
    assert "cannot read or write them" in log and "fused colocate" in log
