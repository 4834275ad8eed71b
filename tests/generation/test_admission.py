"""Admission control on the real server: a bounded queue (429 + Retry-After before the stream), a queue-wait
timeout (429 queue_timeout in the stream), the KV pages of every refused job freed, and an engine that cannot
start making the service exit at once with the reason (no restart loop)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.waiting import wait_until
from .conftest import make_pool
from .genhelp import REPO, TOKEN, GenServer, body, errors_of, generate, prefixes, publish
from .test_faults import Stream, running_job

WAIT_S = 4.0


@pytest.fixture(scope="module")
def adm(tiny_dir, ref_model):
    pool = make_pool(ref_model[0], size_mb=64)
    server = GenServer(tiny_dir, pool.name, "--max-running-jobs", "1", "--max-queued-requests", "2",
                       "--max-queue-wait-s", str(WAIT_S)).start()
    yield server, pool
    server.stop()
    pool.close()


def _cancel(server, rid):
    httpx.post(server.url + "/internal/abort", json={"request_id": rid}, headers={"X-U1-Internal-Token": TOKEN},
               timeout=10)


def test_full_queue_is_429_with_retry_after_and_frees_pages(adm, ref_model):
    server, pool = adm
    pre = prefixes(ref_model, guidance_scale=4.0)
    a = running_job(server.url, body("adm-a", publish(pool, pre)))
    queued = [Stream(server.url, body(f"adm-q{i}", publish(pool, pre))) for i in range(2)]
    for s in queued:
        s.start()
        assert s.queued.wait(30)
    assert server.health()[1]["queued"] == 2
    held = pool.stats()["pages_used"]
    status, err = generate(server.url, body("adm-over", publish(pool, pre)))
    assert status == 429 and err["error"]["code"] == "queue_full" and err["error"]["type"] == "rate_limit_error"
    r = httpx.post(server.url + "/internal/generate", json=body("adm-over2", publish(pool, pre)),
                   headers={"X-U1-Internal-Token": TOKEN}, timeout=30)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert wait_until(lambda: pool.stats()["pages_used"] == held, 10)   # the refused jobs' pages are free
    for s in queued:
        _cancel(server, s.b["request_id"])
    _cancel(server, "adm-a")
    for s in [a, *queued]:
        s.join(30)
        assert errors_of(s.events)[0]["error"]["code"] == "cancelled"
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)
    assert server.metrics()['u1_gen_requests_total{outcome="queue_full"}'] == 2


def test_queue_wait_timeout_is_429_in_the_stream(adm, ref_model):
    server, pool = adm
    pre = prefixes(ref_model, guidance_scale=4.0)
    a = running_job(server.url, body("to-a", publish(pool, pre)))
    b = Stream(server.url, body("to-b", publish(pool, pre)))
    t0 = time.monotonic()
    b.start()
    b.join(WAIT_S + 30)
    (err,) = errors_of(b.events)
    assert err["status"] == 429 and err["error"]["code"] == "queue_timeout", err
    assert b.events[-1] == "[DONE]" and time.monotonic() - t0 >= WAIT_S
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)     # b never imported: freed at once
    _cancel(server, "to-a")
    a.join(30)
    assert wait_until(lambda: server.health()[1]["queued"] == 0 and server.health()[1]["running"] == 0, 10)


def test_engine_that_cannot_start_exits_with_the_reason(tmp_path, tiny_dir):
    """A broken checkpoint: the engine fails to load, the server exits 3 within seconds (no restart loop)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            (broken / name).write_bytes(b"not a safetensors file")
    port = GenServer(str(broken), f"u1gen-none-{uuid.uuid4().hex[:6]}").port
    env = GenServer.env()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "services.generation.server", "--model", str(broken), "--port",
                        str(port), "--device", "cpu", "--dtype", "float32", "--kv-pool-name", "none"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    assert "failed to start: rank 0: LoadError" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("Traceback") == 1 and r.stderr.count(" ERROR ") <= 3, r.stderr   # said once, plainly


def test_the_service_needs_an_internal_token(tiny_dir):
    env = {k: v for k, v in os.environ.items() if k != "U1SERVE_INTERNAL_TOKEN"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-m", "services.generation.server", "--model", tiny_dir, "--device", "cpu"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "internal token" in r.stderr


def test_sigterm_ends_streams_with_503_and_exits_cleanly(adm, ref_model):
    """Shutdown does not wait for long jobs: their streams end with 503 shutting_down, the ranks stop, the server exits.
    (Runs last: it stops the module's server.)"""
    import signal
    server, pool = adm
    pre = prefixes(ref_model, guidance_scale=4.0)
    a = running_job(server.url, body("bye-a", publish(pool, pre)))
    b = Stream(server.url, body("bye-b", publish(pool, pre)))
    b.start()
    assert b.queued.wait(30)
    ranks = server.health()[1]["engine_pids"]
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) in (0, -signal.SIGTERM)   # uvicorn re-raises the signal it handled
    assert time.monotonic() - t0 < 20
    for s in (a, b):
        s.join(10)
        (err,) = errors_of(s.events)
        assert err["status"] == 503 and err["error"]["code"] == "shutting_down" and s.events[-1] == "[DONE]"
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in ranks), 10)
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)
