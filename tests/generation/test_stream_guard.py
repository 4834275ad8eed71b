"""Generation's stream against clients that do not behave (issue 30): a queued job sends heartbeats, a client
that leaves before its stream's first byte still cancels its job and frees its pages (the stream's cleanup does
not live in the body generator alone), and a stream whose pixels pile up beyond --max-stream-backlog-mb is cut
with its job cancelled and nothing left in the pool."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.waiting import wait_until
from .conftest import make_pool
from .genhelp import HEADERS, TOKEN, GenServer, body, errors_of, generate, prefixes, publish
from .test_faults import LONG, running_job


@pytest.fixture(scope="module")
def env(tiny_dir, ref_model):
    pool = make_pool(ref_model[0])
    server = GenServer(tiny_dir, pool.name, "--max-running-jobs", "1", "--stream-heartbeat-s", "0.3",
                       "--max-stream-backlog-mb", "0.06", "--stream-send-buffer-kb", "1",
                       "--stream-write-timeout-s", "3").start()
    yield server, pool
    server.stop()
    pool.close()


def _pre(ref_model):
    return prefixes(ref_model, guidance_scale=4.0)


def _idle(server, pool) -> bool:
    h = server.health()[1]
    return h["queued"] == 0 and h["running"] == 0 and pool.stats()["pages_used"] == 0


def test_a_queued_job_sends_heartbeats(env, ref_model):
    server, pool = env
    a = running_job(server.url, body("hb-a", publish(pool, _pre(ref_model))))
    lines = []
    with httpx.stream("POST", server.url + "/internal/generate", headers=HEADERS, timeout=30,
                      json=body("hb-b", publish(pool, _pre(ref_model)))) as r:
        for line in r.iter_lines():
            lines.append(line)
            if sum(ln.startswith(":") for ln in lines) >= 3:
                break
    assert lines[0] == 'data: {"type":"queued"}' and ": keep-alive" in lines, lines
    for rid in ("hb-a", "hb-b"):
        httpx.post(server.url + "/internal/abort", json={"request_id": rid}, headers=HEADERS, timeout=10)
    a.join(30)
    assert wait_until(lambda: _idle(server, pool), 20)


def test_a_client_gone_before_the_first_byte_cancels_its_job(env, ref_model):
    """The request arrives whole, the client closes at once: the server sees the disconnect before its stream
    starts. The job (1000 steps) is cancelled at once rather than run, and its pages are freed."""
    server, pool = env
    before = server.metrics().get('u1_gen_requests_total{outcome="disconnected"}', 0.0)
    raw = json.dumps(body("early-leave", publish(pool, _pre(ref_model)), num_inference_steps=LONG)).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /internal/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"X-U1-Internal-Token: {TOKEN}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    assert wait_until(lambda: _idle(server, pool), 20)
    after = server.metrics().get('u1_gen_requests_total{outcome="disconnected"}', 0.0)
    assert after == before + 1
    status, events = generate(server.url, body("after-early-leave", publish(pool, _pre(ref_model))))
    assert status == 200 and not errors_of(events)


def _raw(server, b: dict) -> socket.socket:
    raw = json.dumps(b).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(b"POST /internal/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"X-U1-Internal-Token: {TOKEN}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


def test_a_stream_that_falls_behind_is_cut_and_frees_everything(env, ref_model):
    """A reader that takes nothing: the first image (64 KB of base64) blocks the stream (--stream-send-buffer-kb 1),
    the next ones pile up as pixels (48 KiB each) beyond --max-stream-backlog-mb 0.06: the job is cancelled; the
    write deadline then cuts the stream, and nothing stays in the pool."""
    server, pool = env
    key = "u1_gen_streams_fell_behind_total"
    before = server.metrics().get(key, 0.0)
    with _raw(server, body("backlog", publish(pool, _pre(ref_model)), n=4)):
        assert wait_until(lambda: server.metrics().get(key, 0.0) == before + 1, 60)
        assert wait_until(lambda: _idle(server, pool), 30)     # (the write deadline ends the stalled stream)
    status, events = generate(server.url, body("after-backlog", publish(pool, _pre(ref_model)), n=1))
    assert status == 200 and not errors_of(events)
