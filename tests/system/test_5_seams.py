"""Seams between gateway, understanding and generation on the shared stack: request ids, error statuses,
and who frees the prefix pages when generation cannot take them (not the lease: that is minutes)."""
import concurrent.futures as cf
import os
import sys
import time

import httpx
import pytest

from services.kit import sse
from services.base.netutil import free_port
from .stackproc import Service


def pages_used(stack) -> int:
    from shm_transfer.pool import ShmKVPool
    pool = ShmKVPool.attach(stack.pool)
    try:
        return pool.stats()["pages_used"]
    finally:
        pool.close()


def settles_to_zero(stack, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pages_used(stack) == 0:
            return True
        time.sleep(0.1)
    return False


def _spawn(name: str, argv: list[str], stack) -> Service:
    """A service process beside the stack (its engines' token), logged in the stack's run directory."""
    return Service(name, argv, stack.run_dir, env={"U1SERVE_INTERNAL_TOKEN": stack.token}).start()


@pytest.fixture()
def side_gateway(stack):
    """start(gen_url) -> base URL of an extra gateway on the stack's understanding and that generation."""
    procs = []

    def start(gen_url: str) -> str:
        procs.append(_spawn(f"gw-side-{len(procs)}", [sys.executable, "-m", "services.gateway.server",
                                                       "--und-url", f"http://127.0.0.1:{stack.und_port}",
                                                       "--gen-url", gen_url, "--default-size", "64x64"], stack))
        procs[-1].wait_healthy(60, path="/v1/models")
        return procs[-1].url

    yield start
    for p in procs:
        p.stop()


def test_reused_client_request_id_does_not_cross_requests(stack):
    """Two concurrent requests with one client x-request-id: both complete (the engines key requests by
    the id the gateway sends; a shared one made one of them wait forever), each echoes the client's id."""
    def chat(i):
        return httpx.post(stack.base + "/v1/chat/completions", headers={"x-request-id": "same-id"},
                          json={"messages": [{"role": "user", "content": f"hello {i}"}],
                                "max_tokens": 64, "ignore_eos": True}, timeout=30)

    def image(i):
        return httpx.post(stack.base + "/v1/images/generations", headers={"x-request-id": "same-img"},
                          json={"prompt": f"p{i}", "num_inference_steps": 8, "size": "128x128"},
                          timeout=60)

    with cf.ThreadPoolExecutor(4) as ex:
        chats = list(ex.map(chat, range(2)))
        images = list(ex.map(image, range(2)))
    for r in chats:
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-id"
        assert r.json()["choices"][0]["finish_reason"] == "length"
    for r in images:
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-img"
    assert settles_to_zero(stack)


def test_stream_with_generation_down_is_a_503_and_frees_the_prefix(stack, side_gateway):
    base = side_gateway(f"http://127.0.0.1:{free_port()}")    # nothing listens there
    for path, body in (("/v1/images/generations", {"prompt": "x", "num_inference_steps": 1,
                                                   "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "modalities": ["image"], "stream": True,
                                                 "num_inference_steps": 1})):
        r = httpx.post(base + path, json=body, headers={"x-request-id": "gen-down-1"}, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "generation_unavailable"
        assert r.headers["x-request-id"] == "gen-down-1"
        assert settles_to_zero(stack)


def test_generation_without_the_pool_fails_fast_and_pages_are_freed(stack, side_gateway):
    """Generation accepted the job but cannot attach the pool (so it cannot free the pages either):
    the gateway gives them back at once instead of leaving them to the lease."""
    gen = _spawn("gen-nopool", [sys.executable, "-m", "services.generation.server", "--model", stack_model(stack),
                                "--device", "cpu", "--dtype", "float32", "--kv-pool-name", stack.pool + "-absent",
                                "--threads", "1"], stack)
    try:
        gen.wait_healthy(120)
        base = side_gateway(gen.url)
        r = httpx.post(base + "/v1/images/generations", json={"prompt": "x", "num_inference_steps": 1},
                       timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "kv_pool_unavailable"
        assert settles_to_zero(stack)
        with httpx.stream("POST", base + "/v1/images/generations", timeout=60,
                          json={"prompt": "x", "num_inference_steps": 1, "stream": True}) as s:
            evs = list(sse.events(s.iter_lines(), done=True))
        assert evs[-2]["status"] == 503 and evs[-2]["error"]["code"] == "kv_pool_unavailable", evs
        assert evs[-1] == sse.DONE
        assert settles_to_zero(stack)
    finally:
        gen.stop()


def stack_model(stack) -> str:
    argv = stack.proc.args
    return argv[argv.index("--model") + 1]


def _log_has(stack, name, text, timeout=5.0) -> bool:
    path = os.path.join(stack.run_dir, "logs", name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return True
        time.sleep(0.1)
    return False


def test_request_id_reaches_the_generation_log(stack):
    r = httpx.post(stack.base + "/v1/images/generations", headers={"x-request-id": "trace-gen-ok"},
                   json={"prompt": "x", "num_inference_steps": 1}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-gen-ok"
    assert _log_has(stack, "gen.log", "request trace-gen-ok.")
    # a rejection before any job exists is logged under the caller's id too
    r = httpx.post(f"http://127.0.0.1:{stack.gen_port}/internal/generate",
                   headers={"x-request-id": "trace-gen-bad", "X-U1-Internal-Token": stack.token},
                   json={"request_id": "trace-gen-bad", "handles": {}}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert _log_has(stack, "gen.log", "request trace-gen-bad rejected: 400")
