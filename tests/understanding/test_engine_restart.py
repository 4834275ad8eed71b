"""Engine crash recovery: SIGKILL an engine rank mid-request -> in-flight requests get a 503-class error
(streaming: an error event then [DONE]; non-streaming: 503 JSON), unfinished image-prefix pages go back to
the shm pool (same pool generation), /health is 503 while a fresh engine starts and 200 again with
`restarts` = 1, and the new engine's greedy output equals the reference. TP=1 (kill rank 0) and TP=2
(kill rank 1); both servers start side by side. The restarts are the kit Supervisor's: after the restart budget
(here 2 deaths) the engine stays down and /health and the log say why, while the HTTP process keeps serving
/health."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from services.kit import sse
from .conftest import TOKEN, _start
from .helpers import chat_body, mixed_requests, reference_ids

H = {"X-U1-Internal-Token": TOKEN}


@pytest.fixture(scope="module")
def crash_servers(tiny_dir, tmp_path_factory):
    s1 = _start(tiny_dir, tmp_path_factory, "--chunked-prefill-size", "64", "--engine-max-failures", "2")
    s2 = _start(tiny_dir, tmp_path_factory, "--chunked-prefill-size", "48", tp=2)
    try:
        yield s1.wait_ready(), s2.wait_ready(240)
    finally:
        s1.stop()
        s2.stop()


class _Stream(threading.Thread):
    """A long streaming chat read in the background; `first` is set once a content chunk arrived."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.events, self.status = url, [], None
        self.first = threading.Event()

    def run(self):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 3000, "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=H, timeout=120) as r:
            self.status = r.status_code
            for ev in sse.events(r.iter_lines(), done=True):
                self.events.append(ev)
                if isinstance(ev, dict) and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                    self.first.set()
        self.first.set()


def _await(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _health(server):
    r = httpx.get(server.url + "/health", timeout=10)
    return r.status_code, r.json()


def _check_stream_failed(st: _Stream):
    st.join(30)
    assert not st.is_alive() and st.status == 200
    assert st.events[-1] == "[DONE]", st.events[-3:]
    err = st.events[-2]
    assert isinstance(err, dict) and "error" in err, st.events[-3:]
    assert err["error"]["code"] == "engine_dead" and err["error"]["type"] == "service_unavailable"


def _check_recovered(server, ref, old_pids, generation, seed):
    seen_503 = []

    def ready():
        code, h = _health(server)
        if code != 200:
            seen_503.append(h["status"])
        return h if code == 200 else None

    h = _await(ready, 60, "the engine to come back")
    assert seen_503 and set(seen_503) <= {"restarting", "loading", "error"}, seen_503
    assert h["restarts"] == 1 and h["engine_ready"] is True
    assert len(h["engine_pids"]) == len(old_pids) and not set(h["engine_pids"]) & set(old_pids)
    assert h["shm_pool_generation"] == generation and h["shm_pages_used"] == 0
    assert h["running"] == 0 and h["inflight"] == 0
    for pid in old_pids:   # every rank of the old engine is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    req = mixed_requests(2, seed=seed)[1]   # with an image
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(req), headers=H, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference_ids(ref, req)
    m = httpx.get(server.url + "/metrics", headers=H, timeout=10).text
    assert "u1_und_engine_restarts_total 1.0" in m


def test_engine_sigkill_recovers(crash_servers, ref):
    server = crash_servers[0]
    code, h = _health(server)
    assert code == 200 and h["restarts"] == 0 and len(h["engine_pids"]) == 1
    pid, generation = h["engine_pids"][0], h["shm_pool_generation"]

    st = _Stream(server.url)
    st.start()
    assert st.first.wait(60)
    os.kill(pid, signal.SIGSTOP)          # freeze the engine so the requests below are surely in flight
    results = {}

    def post(name, path, body, headers=None):
        results[name] = httpx.post(server.url + path, json=body, headers=headers, timeout=120)

    chat = threading.Thread(target=post, args=("chat", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, H))
    prefix = threading.Thread(target=post, args=("prefix", "/internal/image_prefix", {
        "request_id": "crash-prefix", "mode": "t2i", "prompt": "a red cube", "guidance_scale": 4.0}, H))
    chat.start()
    prefix.start()
    try:
        _await(lambda: (lambda h: h["inflight"] >= 4 and h["shm_pages_used"] > 0)(_health(server)[1]), 30,
               "the requests to reach the engine")
    finally:
        os.kill(pid, signal.SIGKILL)

    _check_stream_failed(st)
    chat.join(30)
    prefix.join(30)
    for name in ("chat", "prefix"):
        r = results[name]
        assert r.status_code == 503, (name, r.text)
        assert r.json()["error"]["code"] == "engine_dead", (name, r.text)
    _check_recovered(server, ref, [pid], generation, seed=5)


def test_engine_tp2_rank1_sigkill_recovers(crash_servers, ref):
    server = crash_servers[1]
    code, h = _health(server)
    assert code == 200 and h["restarts"] == 0 and len(h["engine_pids"]) == 2
    pids, generation = h["engine_pids"], h["shm_pool_generation"]
    st = _Stream(server.url)
    st.start()
    assert st.first.wait(60)
    os.kill(pids[1], signal.SIGKILL)
    _check_stream_failed(st)
    _check_recovered(server, ref, pids, generation, seed=6)


def test_engine_stays_down_after_its_restart_budget(crash_servers):
    """--engine-max-failures 2: the second death within the window is the last; the HTTP process stays up."""
    server = crash_servers[0]
    for _ in range(2):
        h = _await(lambda: (lambda c, h: h if c == 200 or h["status"] == "failed" else None)(*_health(server)),
                   60, "a ready or failed engine")
        if h["status"] == "failed":
            break
        os.kill(h["engine_pids"][0], signal.SIGKILL)
        _await(lambda: _health(server)[0] == 503, 30, "the death to be seen")
    h = _await(lambda: (lambda c, h: h if h["status"] == "failed" else None)(*_health(server)), 30, "give-up")
    assert "2 failures" in h["error"] and "not restarting" in h["error"], h
    assert h["engine_ready"] is False and h["last_engine_error"]
    r = httpx.post(server.url + "/v1/chat/completions", headers=H, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    assert "not restarting" in r.json()["error"]["message"]
    assert server.proc.poll() is None
    assert "not restarting" in open(server.log_path).read()
