"""Faults on the shared stack (runs after test_1_api): client disconnects, a killed generation service."""
import os
import signal
import sys

import httpx

from services.kit import sse
from tests.metrics import metric
from tests.waiting import wait_until

from services.base.netutil import free_port
from .stackproc import Service


def gateway_metric(stack, name: str) -> float:
    return metric(stack.base, name, timeout=10, default=0.0)


def _gateway(run_dir, und_url: str, gen_url: str, token: str) -> Service:
    """An extra gateway process in front of the stack's engines (or dead addresses)."""
    return Service("gateway", [sys.executable, "-m", "services.gateway.server", "--und-url", und_url,
                               "--gen-url", gen_url, "--default-size", "64x64"], str(run_dir),
                   env={"U1SERVE_INTERNAL_TOKEN": token}).start()


def test_second_gateway_fails_over_from_dead_endpoints(stack, tmp_path):
    """Several endpoints per engine: a refused connection moves on to the next one."""
    dead = f"http://127.0.0.1:{free_port()}"
    gw = _gateway(tmp_path, f"{dead},http://127.0.0.1:{stack.und_port}",
                  f"{dead},http://127.0.0.1:{stack.gen_port}", stack.token)
    try:
        gw.wait_healthy(60, path="/v1/models")
        base = gw.url
        for _ in range(3):
            r = httpx.post(base + "/v1/images/generations", timeout=60,
                           json={"prompt": "x", "num_inference_steps": 1})
            assert r.status_code == 200, r.text
            r = httpx.post(base + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
        h = httpx.get(base + "/health", timeout=10)
        # one configured replica of each engine is down, the other serves: degraded, still 200
        assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
        assert [p["status"] for p in h.json()["understanding"]] == ["unavailable", "ok"]
    finally:
        gw.stop()


def test_gateway_with_a_wrong_internal_token_gets_a_clear_5xx(stack, tmp_path):
    gw = _gateway(tmp_path, f"http://127.0.0.1:{stack.und_port}", f"http://127.0.0.1:{stack.gen_port}",
                  "wrong")
    try:
        gw.wait_healthy(60, path="/v1/models")
        r = httpx.post(gw.url + "/v1/images/generations", timeout=60, json={"prompt": "x", "size": "64x64"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "internal_auth_failed", r.text
    finally:
        gw.stop()


def test_client_disconnect_cancels_and_stack_keeps_serving(stack):
    before = gateway_metric(stack, "u1serve_gateway_cancelled_total")
    body = {"prompt": "long job", "size": "256x256", "num_inference_steps": 200, "stream": True}
    with httpx.stream("POST", stack.base + "/v1/images/generations", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "image_generation.progress" in line:
                break          # leave mid-denoise
    assert wait_until(lambda: gateway_metric(stack, "u1serve_gateway_cancelled_total") > before, 30)
    # the engines are free again: a short job completes quickly
    r = httpx.post(stack.base + "/v1/images/generations", timeout=60,
                   json={"prompt": "after cancel", "size": "64x64", "num_inference_steps": 1})
    assert r.status_code == 200, r.text


def test_non_stream_client_disconnect_is_cancelled(stack):
    before = gateway_metric(stack, "u1serve_gateway_cancelled_total")
    body = {"prompt": "long job", "size": "256x256", "num_inference_steps": 200}
    try:
        httpx.post(stack.base + "/v1/images/generations", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    assert wait_until(lambda: gateway_metric(stack, "u1serve_gateway_cancelled_total") > before, 30)


def test_kill_generation_mid_request_then_restart(stack):
    gen_pid = stack.service_pids()["gen"]
    body = {"prompt": "doomed", "size": "256x256", "num_inference_steps": 200, "stream": True}
    events = []
    with httpx.stream("POST", stack.base + "/v1/images/generations", json=body, timeout=60) as r:
        assert r.status_code == 200
        for ev in sse.events(r.iter_lines()):
            events.append(ev)
            if ev["type"] == "image_generation.progress" and ev["step"] == 2:
                os.killpg(gen_pid, signal.SIGKILL)
    err = events[-1]
    assert err["type"] == "error" and 500 <= err["status"] < 600, err
    assert err["status"] == 503

    # /health reports the dead engine until the launcher has restarted it
    h = httpx.get(stack.base + "/health", timeout=10)
    assert h.status_code == 503
    assert any(g["status"] != "ok" for g in h.json()["generation"])
    # a request meanwhile gets a 503 too, not a hang or a 500
    r = httpx.post(stack.base + "/v1/images/generations", timeout=60,
                   json={"prompt": "meanwhile", "size": "64x64", "num_inference_steps": 1})
    assert r.status_code in (200, 503), r.text

    assert wait_until(lambda: httpx.get(stack.base + "/health", timeout=5).status_code == 200, 180), \
        stack.output()
    assert stack.service_pids()["gen"] != gen_pid
    stack.pids = stack.service_pids()     # teardown checks the new process group
    r = httpx.post(stack.base + "/v1/images/generations", timeout=60,
                   json={"prompt": "after restart", "size": "64x64", "num_inference_steps": 2})
    assert r.status_code == 200, r.text


def test_kill_understanding_then_restart_and_generation_reattaches(stack):
    """The KV pool's owner dies: image requests fail fast with 503, and after the launcher restarts it
    (a new pool under the same name) generation re-attaches and images work again."""
    und_pid = stack.service_pids()["und"]
    os.killpg(und_pid, signal.SIGKILL)
    r = httpx.post(stack.base + "/v1/images/generations", timeout=60,
                   json={"prompt": "while down", "size": "64x64", "num_inference_steps": 1})
    assert r.status_code in (200, 503), r.text     # 200 only if the restart already won the race
    assert wait_until(lambda: httpx.get(stack.base + "/health", timeout=5).status_code == 200, 180), \
        stack.output()
    stack.pids = stack.service_pids()
    assert stack.pids["und"] != und_pid
    r = httpx.post(stack.base + "/v1/images/generations", timeout=60,
                   json={"prompt": "after und restart", "size": "64x64", "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    r = httpx.post(stack.base + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
