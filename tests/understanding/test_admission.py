"""Admission control and the image-prefix pages, on a server with one running slot, two queued, a 5 s queue
wait and a small shm pool (one request may hold half of it):

- beyond running + queued a request gets 429 + Retry-After; a queued request that waits longer than the
  queue limit fails with 429 `queue_timeout` instead of waiting forever; /health reports the admission state;
- a prefix larger than its share of the pool is a 400 that says the limit; a full pool is a 429 + Retry-After;
- every exit of an image prefix leaves `shm_pages_used` where it was: pool full after a partial allocation,
  queue timeout, abort / disconnect (test_image_prefix, test_load), engine death (test_engine_restart); pages
  handed out in the `handles` event belong to the client until it releases them.
The server reads its token from --internal-token-file."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.kit import sse
from .conftest import HEADERS, TOKEN, UndServer

QUEUE_WAIT_S = 5.0
# the hog's length: it must outlast two queue waits in a row (~10.3 s). The suite's default 4,096-token context
# ran out in ~9 s on an idle 2-core machine (a flaky 200 for the queued prefix); 8,000 tokens take ~21 s there
HOG_TOKENS = 8000


@pytest.fixture(scope="module")
def small(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("und-small")
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    s = UndServer(tiny_dir, "--chunked-prefill-size", "0", "--max-running-requests", "1",
                  "--max-queued-requests", "2", "--max-queue-wait-s", str(QUEUE_WAIT_S),
                  "--max-prefix-pool-share", "0.5", "--prefix-pages-wait-s", "0", "--max-model-len",
                  str(HOG_TOKENS + 64), pool_gb=0.0016,
                  log_dir=str(d),
                  token_args=("--internal-token-file", str(token_file))).wait_ready()
    yield s
    s.stop()


def _chat(max_tokens=4, **kw):
    return {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens, "temperature": 0, **kw}


def _prefix(rid, **kw):
    return {"request_id": rid, "mode": "t2i", "prompt": "a small house", "guidance_scale": 4.0, **kw}


class _LongStream(threading.Thread):
    """A streaming chat that runs until closed or HOG_TOKENS tokens; it holds the only running slot."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url, self.started, self.stop = url, threading.Event(), threading.Event()

    def run(self):
        body = _chat(HOG_TOKENS, ignore_eos=True, stream=True)
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=120) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    self.started.set()
                if self.stop.is_set():
                    return


def _in_background(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.update(r=fn(*args), t=time.monotonic()), daemon=True)
    t.start()
    return t, box


def _post(server, path, body, timeout=60):
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=timeout)


def _admission(server):
    return server.health()["admission"]


def test_health_reports_admission(small):
    a = _admission(small)
    assert a["limit"] == 3 and a["in_flight"] == 0 and a["queued"] == 0 and a["queue_wait_limit_s"] == QUEUE_WAIT_S


def test_more_choices_than_the_gate_holds_is_400(small):
    r = _post(small, "/v1/chat/completions", _chat(n=4))        # limit 3: a 429 here could never clear
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert _post(small, "/v1/chat/completions", _chat(n=3)).status_code == 200
    assert _admission(small)["in_flight"] == 0


def test_full_queue_is_429_and_a_long_wait_times_out(small):
    hog = _LongStream(small.url)
    hog.start()
    try:
        assert hog.started.wait(60)
        t0 = time.monotonic()
        waiting = [_in_background(_post, small, "/v1/chat/completions", _chat()) for _ in range(2)]
        small_h = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            small_h = _admission(small)
            if small_h["in_flight"] == 3 and small_h["queued"] == 2:
                break
            time.sleep(0.05)
        assert small_h["in_flight"] == 3 and small_h["queued"] == 2, small_h
        for path, body in [("/v1/chat/completions", _chat()), ("/internal/image_prefix", _prefix("over")),
                           ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})]:
            r = _post(small, path, body)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, (path, r.text)
            assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "rate_limit_error"
        for t, box in waiting:
            t.join(30)
            r = box["r"]
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout", r.text
            assert int(r.headers["retry-after"]) >= 1 and box["t"] - t0 >= QUEUE_WAIT_S - 0.5
        # an image prefix queued behind the hog times out too, and gives its pages back
        assert hog.is_alive(), "the hog must still hold the running slot"
        r = _post(small, "/internal/image_prefix", _prefix("queued-prefix"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout", r.text
        assert small.health()["shm_pages_used"] == 0
        assert _admission(small)["rejected"] >= 3
    finally:
        hog.stop.set()
        hog.join(60)
    h = small.wait_idle()
    assert h["admission"]["in_flight"] == 0


def test_prefix_over_its_share_of_the_pool_is_400(small):
    r = _post(small, "/internal/image_prefix", _prefix("too-big", think=True, max_think_tokens=1024))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_request_too_large" and "at most" in err["message"] and "--kv-pool-gb" in err["message"]
    assert small.health()["shm_pages_used"] == 0


def test_pool_full_after_a_partial_allocation_gives_everything_back(small):
    """The test itself holds all but the cond branch's pages: cond is allocated, uncond is not -> 429, and the
    cond pages go back at once. (guidance 1.0 = the cond branch alone: one engine request, no queueing.)"""
    from shm_transfer import ShmKVPool
    ok = _post(small, "/internal/image_prefix", _prefix("sizes", guidance_scale=1.0))
    assert ok.status_code == 200, ok.text
    handles = ok.json()["handles"]
    cond_pages = len(handles["cond"]["page_ids"])
    assert _post(small, "/internal/release", {"handles": list(handles.values())}).json()["released_pages"] > 0
    pool = ShmKVPool.attach(small.pool_name)
    try:
        total = pool.num_pages
        held = pool.allocate((total - cond_pages) * pool.layout.page_tokens, 120, branch="cond")
        r = _post(small, "/internal/image_prefix", _prefix("partial"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "kv_pool_full", r.text
        assert int(r.headers["retry-after"]) >= 1
        assert small.health()["shm_pages_used"] == total - cond_pages
        pool.release(held)
    finally:
        pool.close()
    assert small.wait_idle()["shm_pages_used"] == 0
    after = _post(small, "/internal/image_prefix", _prefix("after", guidance_scale=1.0))      # and it recovers
    assert after.status_code == 200, after.text
    _post(small, "/internal/release", {"handles": list(after.json()["handles"].values())})
    assert small.wait_idle()["shm_pages_used"] == 0


def test_handles_sent_in_the_stream_belong_to_the_client(small):
    handles = None
    with httpx.stream("POST", small.url + "/internal/image_prefix", json=_prefix("mine", stream=True, guidance_scale=1.0),
                      headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200
        for ev in sse.events(r.iter_lines()):
            if ev["type"] == "handles":
                handles = ev["handles"]
                break             # the client goes away right after the handles event
    assert handles
    time.sleep(0.5)
    used = small.health()["shm_pages_used"]
    assert used >= sum(len(h["page_ids"]) for h in handles.values())
    freed = _post(small, "/internal/release", {"handles": list(handles.values())}).json()["released_pages"]
    assert freed == sum(len(h["page_ids"]) for h in handles.values())
