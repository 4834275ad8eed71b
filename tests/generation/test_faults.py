"""Faults: bad input, missing pool, cancellation (running, queued, client gone), the engine killed
mid-job (error reaches the client, restart works), the whole service killed (pages reclaimed by lease
expiry, a restarted service works), producer restart (stale handles rejected, re-attach), wrong
fingerprint."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid

import httpx
import torch
import pytest
from .conftest import make_pool
from tests.waiting import wait_until
from .genhelp import HEADERS, TOKEN, GenServer, body, errors_of, generate, images_of, prefixes, publish

LONG = 1000  # steps (the maximum): a job that only ends when cancelled or killed
OOM_MARKER = "oom-fault"   # U1SERVE_FAULT_STEP_OOM of the fault server: such a job runs out of memory in a step
READ_TIMEOUT_S = 8.0       # U1SERVE_WEIGHTS_READ_TIMEOUT_S of the fault server (its reads take a minute)


@pytest.fixture(scope="module")
def fault_env(tiny_dir, ref_model, tmp_path_factory):
    """A server started BEFORE its pool exists (it waits --kv-pool-wait-s for it, then attaches lazily), one job at
    a time. Injected faults: a job whose id holds OOM_MARKER runs out of memory in its 2nd step; a weight update's
    read takes a minute (a slow mount) against a read timeout of READ_TIMEOUT_S."""
    name = f"u1gen-fault-{uuid.uuid4().hex[:8]}"
    updates = tmp_path_factory.mktemp("weights-updates")
    server = GenServer(tiny_dir, name, "--max-running-jobs", "1", "--kv-pool-wait-s", "1", knobs={
        "U1SERVE_FAULT_STEP_OOM": OOM_MARKER, "U1SERVE_FAULT_WEIGHTS_READ_S": "60",
        "U1SERVE_WEIGHTS_READ_TIMEOUT_S": str(READ_TIMEOUT_S), "U1SERVE_WEIGHTS_ALLOWED_DIRS": str(updates)}).start()
    env = {"server": server, "name": name, "pool": None, "updates": updates}
    yield env
    env["server"].stop()
    if env["pool"] is not None:
        env["pool"].close()


class Stream(threading.Thread):
    """A generate request in the background, recording its events."""

    def __init__(self, url, b, stop_after_step=None):
        super().__init__(daemon=True)
        self.url, self.b, self.stop_after_step = url, b, stop_after_step
        self.events, self.status = [], None
        self.progress = threading.Event()
        self.queued = threading.Event()

    def on_event(self, ev):
        self.events.append(ev)
        if ev.get("type") == "queued":
            self.queued.set()
        if ev.get("type") == "progress" and ev["step"] >= 2:
            self.progress.set()
            if self.stop_after_step is not None:
                return True  # the client goes away
        return False

    def run(self):
        try:
            self.status, evs = generate(self.url, self.b, on_event=self.on_event, timeout=120)
        except httpx.HTTPError as e:  # the whole service died under us
            self.events.append({"type": "transport_error", "error": repr(e)})
            return
        if self.status != 200:
            self.events.append({"type": "http_error", "status": self.status, "body": evs})
        elif evs and evs[-1] == "[DONE]":
            self.events.append("[DONE]")


def running_job(url: str, b: dict) -> Stream:
    """A job that runs (its first steps are done) until it is cancelled or killed."""
    s = Stream(url, dict(b, num_inference_steps=LONG))
    s.start()
    assert s.progress.wait(60)
    return s


def _pre(ref_model):
    return prefixes(ref_model, guidance_scale=4.0)


def test_pool_missing_is_503_then_attaches(fault_env, ref_model):
    server = fault_env["server"]
    kv_pool = server.health()[1]["kv_pool"]        # ready anyway, after the bounded wait
    assert not kv_pool["attached"] and kv_pool["waited_s"] >= 1 and "first request" in kv_pool["detail"]
    tmp = make_pool(ref_model[0])  # handles from another pool: the named one does not exist yet
    try:
        status, events = generate(server.url, body("nopool", publish(tmp, _pre(ref_model))))
    finally:
        tmp.close()
    assert status == 200
    (err,) = errors_of(events)
    assert err["status"] == 503 and err["error"]["code"] == "kv_pool_unavailable"
    assert events[-1] == "[DONE]"
    fault_env["pool"] = make_pool(ref_model[0], name=fault_env["name"])
    # the idle engine opens it once it is there (and warms its import), before any job needs it
    wait_until(lambda: server.health()[1]["kv_pool"]["attached"], 30)
    kv_pool = server.health()[1]["kv_pool"]
    assert not kv_pool["before_ready"] and kv_pool["pool"] == fault_env["name"]
    assert kv_pool["warm_import_seconds"] is not None
    status, events = generate(server.url, body("pool-now", publish(fault_env["pool"],
                                                                   _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1


def test_bad_requests_are_4xx_and_free_their_pages(fault_env, ref_model):
    """Every rejection before the stream is an OpenAI-shaped 4xx that names the field, and frees the KV pages
    the request brought (the gateway frees them too; release is idempotent)."""
    server, pool = fault_env["server"], fault_env["pool"]
    url = server.url + "/internal/generate"

    def post(make, headers=HEADERS, raw=None):
        handles = publish(pool, _pre(ref_model))
        b = make(handles) if raw is None else None
        r = httpx.post(url, json=b, content=raw, headers={**headers, "content-type": "application/json"},
                       timeout=30)
        e = r.json()
        assert set(e["error"]) == {"message", "type", "param", "code"} and r.headers["x-request-id"]
        sent = {h.get("handle_id") for h in ((b or {}).get("handles") or {}).values()}
        for h in handles.values():   # not sent, or unauthenticated (which may not free anything): the test frees
            if r.status_code == 401 or h["handle_id"] not in sent:
                pool.release(__import__("shm_transfer").KVHandle.from_dict(h))
        assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10), (r.status_code, e)
        return r.status_code, e

    s, e = post(lambda h: body("x", h), headers={})
    assert s == 401 and e["error"]["code"] == "unauthorized"
    s, e = post(lambda h: body("x", h), headers={"X-U1-Internal-Token": "t\u00e9st".encode()})
    assert s == 401
    s, e = post(lambda h: {"handles": h})
    assert s == 400 and e["error"]["param"] == "request_id"
    s, e = post(lambda h: body("x", h, width=100))
    assert s == 400 and e["error"]["param"] == "width" and "multiple of 32" in e["error"]["message"]
    s, e = post(lambda h: body("x", h, n=9))
    assert s == 400 and e["error"]["param"] == "n"
    s, e = post(lambda h: body("x", h, cfg_norm="bogus"))
    assert s == 400 and e["error"]["param"] == "cfg_norm"
    s, e = post(lambda h: body("x", h, seed=2**64))
    assert s == 400 and e["error"]["param"] == "seed"
    s, e = post(lambda h: body("x", {"cond": h["cond"]}))  # cfg 4 needs uncond too
    assert s == 400 and "need handles" in e["error"]["message"]
    s, e = post(lambda h: body("x", dict(h, cond={**h["cond"], "model_fingerprint": "0123456789abcdef"})))
    assert s == 400 and e["error"]["code"] == "kv_fingerprint_mismatch"
    assert "different model" in e["error"]["message"]
    s, e = post(lambda h: body("x", dict(h, cond={"page_ids": [1]})))
    assert s == 400 and e["error"]["code"] == "kv_malformed_handle"
    for raw, words in ((b'{"request_id": "x", "guidance_scale": NaN}', "NaN"),
                       (b'{"a":' * 40 + b"1" + b"}" * 40, "nested"), (b"[" * 5000 + b"]" * 5000, "nested")):
        s, e = post(None, raw=raw)
        assert s == 400 and e["error"]["code"] == "invalid_json" and words in e["error"]["message"]
    r = httpx.post(server.url + "/internal/abort", content=b"{}", headers=HEADERS, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert server.health()[0] == 200


def test_nonfinite_prefix_and_image_are_500s_not_a_black_png(fault_env, ref_model):
    """A prefix KV holding NaN is refused at admission (500 nonfinite_prefix, naming the layer, K/V and token: whether
    understanding's prefill or the transport made it); a finite prefix that overflows in the layers makes the image
    NaN, answered 500 nonfinite_output (a fault the client may retry, in the logs and the 5xx counts) instead of a
    silent black PNG. Either way the pages are freed and the next request is served normally."""
    from types import SimpleNamespace
    server, pool = fault_env["server"], fault_env["pool"]
    for name, value, code in (("nan-prefix", float("nan"), "nonfinite_prefix"), ("huge-prefix", 3e38, "nonfinite_output")):
        poisoned = {b: SimpleNamespace(num_tokens=p.num_tokens, t_offset=p.t_offset, kv=torch.full_like(p.kv, value))
                    for b, p in _pre(ref_model).items()}
        status, events = generate(server.url, body(name, publish(pool, poisoned)))
        assert status == 200 and events[-1] == "[DONE]" and not images_of(events)
        (err,) = errors_of(events)
        assert err["status"] == 500 and err["error"]["code"] == code, err
        if code == "nonfinite_prefix":
            assert "(first: layer 0, K, token 0 of" in err["error"]["message"], err
        assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)
    status, events = generate(server.url, body("after-nan", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1


def test_out_of_memory_in_a_step_fails_that_job_not_the_engine(fault_env, ref_model):
    """An out-of-memory inside a denoise step (injected: U1SERVE_FAULT_STEP_OOM) fails the job of that step with
    503 engine_oom naming it (a capacity refusal, as at admission); a request queued behind it and a later one are served by the same engine (no
    restart), and no page of the pool is left held."""
    server, pool = fault_env["server"], fault_env["pool"]
    before = server.health()[1]
    doomed = Stream(server.url, body(f"{OOM_MARKER}-a", publish(pool, _pre(ref_model)), num_inference_steps=6))
    behind = Stream(server.url, body("oom-behind", publish(pool, _pre(ref_model))))
    doomed.start()
    behind.start()      # one job at a time: it waits behind the doomed one, then runs
    for s in (doomed, behind):
        s.join(120)
        assert s.status == 200 and s.events[-1] == "[DONE]", s.events
    (err,) = errors_of(doomed.events)
    assert err["status"] == 503 and err["error"]["code"] == "engine_oom", err
    assert "out of memory in a denoise step of this job" in err["error"]["message"]
    assert not images_of(doomed.events) and any(isinstance(e, dict) and e.get("type") == "progress" for e in doomed.events)
    assert not errors_of(behind.events) and len(images_of(behind.events)) == 1
    status, events = generate(server.url, body("oom-after", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1
    after = server.health()[1]
    assert after["engine_pids"] == before["engine_pids"] and after["restarts"] == before["restarts"]
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)


def test_a_slow_weight_read_never_stalls_the_steps_and_times_out(fault_env, ref_model):
    """A weight update whose files read slowly (injected: U1SERVE_FAULT_WEIGHTS_READ_S, a minute) is read in a
    thread of the rank, off its step loop: images are served while it reads, and the stage fails 504
    weights_read_timeout after U1SERVE_WEIGHTS_READ_TIMEOUT_S; the engine keeps its weights and serves on."""
    from safetensors.torch import save_file
    server, pool = fault_env["server"], fault_env["pool"]
    before = server.health()[1]
    update = str(fault_env["updates"] / "update.safetensors")
    save_file({"fm_modules.fm_head.2.weight": torch.zeros(1)}, update)
    staged = {}

    def stage():
        t0 = time.monotonic()
        r = httpx.post(server.url + "/internal/weights/stage", json={"id": "slow", "version": "9", "path": update},
                       headers=HEADERS, timeout=120)
        staged.update(response=r, seconds=time.monotonic() - t0)
    t = threading.Thread(target=stage, daemon=True)
    t.start()
    time.sleep(0.5)                                   # the read has begun
    status, events = generate(server.url, body("during-read", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1
    assert t.is_alive()                               # the image came while the update still waited for its read
    t.join(60)
    r = staged["response"]
    assert r.status_code == 504 and r.json()["error"]["code"] == "weights_read_timeout", r.text
    assert "U1SERVE_WEIGHTS_READ_TIMEOUT_S" in r.json()["error"]["message"]
    assert READ_TIMEOUT_S <= staged["seconds"] < READ_TIMEOUT_S + 10
    after = server.health()[1]
    assert after["engine_pids"] == before["engine_pids"] and after["weights_version"] == before["weights_version"]
    status, events = generate(server.url, body("after-read", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)


def test_cancel_running_and_queued_frees_everything(fault_env, ref_model):
    server, pool = fault_env["server"], fault_env["pool"]
    a = running_job(server.url, body("cancel-a", publish(pool, _pre(ref_model))))
    b = Stream(server.url, body("cancel-b", publish(pool, _pre(ref_model))))
    b.start()
    assert b.queued.wait(30)
    time.sleep(0.3)
    assert pool.stats()["pages_used"] > 0  # b waits behind a (one job at a time) with its pages
    r = httpx.post(server.url + "/internal/abort", json={"request_id": "cancel-b"},
                   headers=HEADERS, timeout=10)
    assert r.json()["aborted"] == 1
    b.join(30)
    assert errors_of(b.events)[0]["error"]["code"] == "cancelled" and b.events[-1] == "[DONE]"
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)  # freed now, not at expiry
    httpx.post(server.url + "/internal/abort", json={"request_id": "cancel-a"}, headers=HEADERS)
    a.join(30)
    assert errors_of(a.events)[0]["error"]["code"] == "cancelled" and a.events[-1] == "[DONE]"
    wait_until(lambda: server.health()[1]["running"] == 0, 10)
    wait_until(lambda: server.metrics()["u1_gen_running_jobs"] == 0, 10)


def test_queued_job_keeps_its_lease_through_a_stalled_engine(fault_env, ref_model):
    """A job queued far longer than its prefix lease still runs, even while the engine makes no progress at all
    (SIGSTOP: a step that takes 3 s): the HTTP process claimed its pages at acceptance (not the engine loop)."""
    server, pool = fault_env["server"], fault_env["pool"]
    a = running_job(server.url, body("lease-a", publish(pool, _pre(ref_model))))
    b = Stream(server.url, body("lease-b", publish(pool, _pre(ref_model), lease_s=1.0)))
    b.start()
    assert b.queued.wait(30)
    rank0 = server.health()[1]["engine_pids"][0]
    os.kill(rank0, signal.SIGSTOP)
    try:
        time.sleep(3.0)  # far past b's 1 s lease (the pool tells a lapsed lease by its deadline, read when asked)
        assert pool.stats()["pages_expired"] == 0
    finally:
        os.kill(rank0, signal.SIGCONT)
    httpx.post(server.url + "/internal/abort", json={"request_id": "lease-a"}, headers=HEADERS)
    a.join(30)
    b.join(60)
    assert b.status == 200 and not errors_of(b.events), b.events[-3:]
    assert len(images_of(b.events)) == 1
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)


def test_client_disconnect_cancels(fault_env, ref_model):
    server, pool = fault_env["server"], fault_env["pool"]
    s = Stream(server.url, body("gone", publish(pool, _pre(ref_model)), num_inference_steps=LONG),
               stop_after_step=2)
    s.start()
    s.join(60)
    assert s.progress.is_set()
    wait_until(lambda: server.health()[1]["running"] == 0, 15)
    # the engine is free again: the next job runs to the end
    status, events = generate(server.url, body("after-gone", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events)


def _post_and_leave(port: int, path: str, payload: dict) -> None:
    """Send a whole request, then close the connection without reading a byte of the answer."""
    data = json.dumps(payload).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-U1-Internal-Token: {TOKEN}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + data)
        s.shutdown(socket.SHUT_WR)


def test_client_gone_before_its_stream_starts_leaks_nothing(fault_env, ref_model):
    """Clients that leave right after sending (an image job and an RL rollout, queued behind a running job): the
    HTTP process claimed their pages at acceptance, so only the stream's own cleanup can free them; it runs
    even when the body never started (kit.streaming.OwnedStream), and the jobs leave the table."""
    server, pool = fault_env["server"], fault_env["pool"]
    a = running_job(server.url, body("early-a", publish(pool, _pre(ref_model))))
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)       # a imported (and freed) its pages
    before = server.metrics().get('u1_gen_requests_total{outcome="disconnected"}', 0.0)
    _post_and_leave(server.port, "/internal/generate", body("early-b", publish(pool, _pre(ref_model))))
    _post_and_leave(server.port, "/internal/rl/rollout", body("early-rl", publish(pool, _pre(ref_model)),
                                                              rl={"seeds": [3]}))
    assert wait_until(lambda: server.metrics().get('u1_gen_requests_total{outcome="disconnected"}', 0.0)
                      == before + 1, 15)                                # b reached the app and ended there
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 15)       # b's and the rollout's pages
    assert pool.stats()["pages_expired"] == 0                           # freed, not left to a lease
    assert wait_until(lambda: server.health()[1]["queued"] == 0, 10)
    assert server.health()[1]["running"] == 1                           # a only
    httpx.post(server.url + "/internal/abort", json={"request_id": "early-a"}, headers=HEADERS)
    a.join(30)
    assert wait_until(lambda: server.health()[1]["running"] == 0, 10)


def test_engine_killed_mid_job(fault_env, ref_model):
    """The engine process dies: the error reaches every client in flight, the HTTP process frees the
    pages of jobs that never imported, a fresh engine takes over."""
    server, pool = fault_env["server"], fault_env["pool"]
    pids = server.health()[1]["engine_pids"]
    a = running_job(server.url, body("kill-a", publish(pool, _pre(ref_model))))
    c = Stream(server.url, body("kill-c", publish(pool, _pre(ref_model))))
    c.start()
    assert c.queued.wait(30)
    time.sleep(0.3)
    assert pool.stats()["pages_used"] > 0  # c's pages: never imported
    os.kill(pids[0], signal.SIGKILL)
    for s in (a, c):
        s.join(30)
        (err,) = errors_of(s.events)
        assert err["status"] == 503 and err["error"]["code"] == "engine_failed"
        assert s.events[-1] == "[DONE]"
    wait_until(lambda: pool.stats()["pages_used"] == 0, 10)
    assert pool.stats()["pages_expired"] == 0  # freed by the server, not by lease expiry
    health = server.wait_healthy(120)
    assert health["restarts"] >= 1 and health["engine_pids"] != pids
    status, events = generate(server.url, body("after-kill", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1
    assert server.metrics()["u1_gen_engine_restarts_total"] >= 1


def test_whole_service_killed_pages_expire(fault_env, tiny_dir, ref_model):
    """The whole generation service dies (SIGKILL to its process group) holding a queued job's
    pages: the client sees the stream break, the pages come back by lease expiry, and a restarted
    service works."""
    server, pool = fault_env["server"], fault_env["pool"]
    a = running_job(server.url, body("svc-a", publish(pool, _pre(ref_model))))
    c = Stream(server.url, body("svc-c", publish(pool, _pre(ref_model), lease_s=2.0)))
    c.start()
    assert c.queued.wait(30)
    time.sleep(0.3)
    held = pool.stats()["pages_used"]
    assert held > 0
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    for s in (a, c):
        s.join(30)
        assert s.events[-1] != "[DONE]"  # no clean end: the client knows it failed
    wait_until(lambda: pool.stats()["pages_used"] == 0, 10)
    assert pool.stats()["pages_expired"] >= held
    fault_env["server"] = new = GenServer(tiny_dir, fault_env["name"], "--max-running-jobs", "1").start()
    status, events = generate(new.url, body("after-svc", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events) and len(images_of(events)) == 1


def test_producer_restart_rejects_stale_handles(fault_env, ref_model):
    server = fault_env["server"]
    old = publish(fault_env["pool"], _pre(ref_model))
    fault_env["pool"].close()  # the producer restarts: same name, new generation
    fault_env["pool"] = make_pool(ref_model[0], name=fault_env["name"])
    status, events = generate(server.url, body("stale", old))
    (err,) = errors_of(events)
    assert err["status"] == 410 and err["error"]["code"] == "kv_stale_generation"
    status, events = generate(server.url, body("fresh", publish(fault_env["pool"],
                                                                _pre(ref_model))))
    assert status == 200 and not errors_of(events)
