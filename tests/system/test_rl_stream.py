"""A large trajectory (> 200 MB) through the real stack: the gateway relays it as a stream (its RSS stays bounded
while the bytes pass, and while a client stops reading), the bytes are the generation store's, a `Range` request
resumes (a 416 keeps its `Content-Range`), the client helper decodes it in place and resumes a cut transfer (a
cutting TCP proxy in front of the gateway), a client that disconnects mid-fetch leaves no stream open, and a
trajectory deleted mid-fetch still streams whole, then frees its memory."""
import argparse
import asyncio
import hashlib
import http.client
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load

from bench.bench_trajectory_fetch import PeakRss, _rss, measure, table
from services.kit.middleware import TOKEN_HEADER
from services.rl.client import FETCH_RESUMES, RLAPIError, RLClient
from tests.waiting import wait_until

MB = 1 << 20
# 1 prompt x G = 4 x 17 states of 512² fp32: 214 MB; no CFG, one SDE step, no images (a quick rollout)
BIG = {"prompts": [{"prompt": "a red cat"}], "group_size": 4, "size": "512x512", "num_inference_steps": 16,
       "guidance_scale": 1.0, "timestep_shift": 3.0, "seed": 3, "sde": {"kind": "flow", "steps": [0]},
       "return_images": False}
RSS_BOUND = 96 * MB        # the old gateway held the whole blob (twice: httpx's body and the Response's)
# 2 x 9 states of 256²: 14 MB, for the cut-and-resume tests; 2 x 9 states of 512²: 57 MB, to delete mid-fetch
SMALL = {**BIG, "group_size": 2, "size": "256x256", "num_inference_steps": 8}
MEDIUM = {**SMALL, "size": "512x512"}


@pytest.fixture(scope="module")
def big(stack):
    r = httpx.post(stack.base + "/v1/rl/rollout", json=BIG, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    yield out
    httpx.delete(f"{stack.base}/v1/rl/trajectories/{out['trajectory_id']}", timeout=30)


def streams(stack) -> int:
    return httpx.get(stack.gen + "/health", timeout=10).json()["rl_trajectories"]["streams"]


def test_big_trajectory_streams_with_bounded_gateway_memory(stack, big):
    tid, gw = big["trajectory_id"], stack.service_pids()["gateway"]
    direct = hashlib.sha256()
    with httpx.stream("GET", f"{stack.gen}/internal/rl/trajectories/{tid}", headers={TOKEN_HEADER: stack.token},
                      timeout=120) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            direct.update(chunk)
    got, relayed = 0, hashlib.sha256()
    with PeakRss(gw) as watch, httpx.stream("GET", f"{stack.base}/v1/rl/trajectories/{tid}", timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        size = int(r.headers["content-length"])
        assert r.headers["accept-ranges"] == "bytes"
        for chunk in r.iter_raw():
            relayed.update(chunk)
            got += len(chunk)
    assert size == got >= 200 * MB
    assert relayed.hexdigest() == direct.hexdigest()               # the store's bytes, unchanged
    assert watch.peak < RSS_BOUND, watch.peak / MB                    # above the gateway's RSS before the fetch
    # the client helper: one buffer, tensors viewing it, the rollout's numbers
    with RLClient(stack.base) as c:
        buf = c.trajectory_buffer(tid)
        assert hashlib.sha256(buf.numpy()).hexdigest() == direct.hexdigest()
        traj = c.trajectory(tid)
    assert tuple(traj.latents.shape) == (4, 17, 3, 512, 512)
    lp = np.array([[np.nan if x is None else x for x in s["logprobs"]] for s in big["samples"]], dtype=np.float32)
    np.testing.assert_array_equal(traj.logprobs.numpy(), lp)
    assert traj.metadata["u1serve"]["sde_steps"] == [0]
    # a resumed fetch: one range, 206 with Content-Range; past the end 416
    r = httpx.get(f"{stack.base}/v1/rl/trajectories/{tid}", headers={"range": f"bytes={size - 1000}-"}, timeout=60)
    assert r.status_code == 206 and r.headers["content-range"] == f"bytes {size - 1000}-{size - 1}/{size}"
    assert r.content == buf[size - 1000:].numpy().tobytes()
    r = httpx.get(f"{stack.base}/v1/rl/trajectories/{tid}", headers={"range": f"bytes={size}-"}, timeout=60)
    assert r.status_code == 416 and r.json()["error"]["code"] == "range_not_satisfiable", r.text
    assert r.headers["content-range"] == f"bytes */{size}"          # relayed from generation (RFC 9110 §15.5.17)


def test_a_stalled_then_vanished_client_leaves_nothing(stack, big):
    tid, gw = big["trajectory_id"], stack.service_pids()["gateway"]
    assert streams(stack) == 0
    watch = PeakRss(gw)                                 # the gateway's RSS now is the base
    host, port = stack.base.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    sock.sendall(f"GET /v1/rl/trajectories/{tid} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    got = 0
    while got < 16 * MB:                                # read a part, then stop reading: back-pressure
        got += len(sock.recv(MB))
    assert streams(stack) == 1
    with watch:
        time.sleep(1.5)
    assert watch.peak < RSS_BOUND, watch.peak / MB
    sock.close()                                        # the client goes away mid-fetch
    wait_until(lambda: streams(stack) == 0, 30, interval=0.1)   # generation's read was cancelled too
    r = httpx.get(f"{stack.base}/v1/rl/trajectories/{tid}", headers={"range": "bytes=0-7"}, timeout=30)
    assert r.status_code == 206 and len(r.content) == 8   # the trajectory itself stays


def rollout(stack, body) -> str:
    r = httpx.post(stack.base + "/v1/rl/rollout", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["trajectory_id"]


@pytest.fixture(scope="module")
def small(stack):
    tid = rollout(stack, SMALL)
    with httpx.Client(timeout=60) as c:
        r = c.get(f"{stack.gen}/internal/rl/trajectories/{tid}", headers={TOKEN_HEADER: stack.token})
    assert r.status_code == 200
    yield tid, r.content                                # the store's bytes, read from generation directly
    httpx.delete(f"{stack.base}/v1/rl/trajectories/{tid}", timeout=30)


class CuttingProxy:
    """A loopback TCP proxy in front of the gateway. It logs each connection's request line and Range header, and
    cuts its first `cuts` connections after `after` bytes of the response: both sides closed, so the client sees
    the end of its stream (`reset`: a connection reset instead) and the gateway a client gone. Later connections
    pass untouched."""

    def __init__(self, target: str, after: int, cuts: int, reset: bool = False):
        host, port = target.rsplit("/", 1)[-1].split(":")
        self.target, self.after, self.cuts_left, self.reset = (host, int(port)), after, cuts, reset
        self.requests: list[tuple[str, str | None]] = []        # (request line, Range header or None)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> "CuttingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return                                   # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        limit = self.after if self.cuts_left > 0 else None     # connections come one at a time here
        self.cuts_left -= 1
        up = threading.Thread(target=self._requests, args=(client, upstream), daemon=True)
        up.start()
        sent = 0
        try:
            while limit is None or sent < limit:
                data = upstream.recv(1 << 20)
                if not data:
                    break
                data = data if limit is None else data[:limit - sent]
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        if limit is not None and self.reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + bytes(4))
        self._close(client, upstream)
        up.join(30)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """client -> upstream, logging the request head; the end of either closes both."""
        head = b""
        try:
            while data := client.recv(1 << 16):
                if b"\r\n\r\n" not in head:
                    head += data
                    if b"\r\n\r\n" in head:
                        line, *fields = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
                        rng = [v.strip() for k, _, v in (f.partition(":") for f in fields) if k.lower() == "range"]
                        self.requests.append((line, rng[0] if rng else None))
                upstream.sendall(data)
        except OSError:
            pass
        self._close(client, upstream)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


@pytest.mark.parametrize("reset", [False, True], ids=["eof", "reset"])
def test_a_cut_fetch_resumes_with_a_range(stack, small, reset):
    tid, stored = small
    after = 3 * MB
    with CuttingProxy(stack.base, after, cuts=2, reset=reset) as proxy, RLClient(proxy.base, timeout=60) as c:
        traj = c.trajectory(tid)
    want = load(stored)
    for name, t in (("latents", traj.latents), ("logprobs", traj.logprobs), ("timesteps", traj.timesteps),
                    ("sde_mask", traj.sde_mask)):
        assert tuple(t.shape) == want[name].shape and t.numpy().tobytes() == want[name].tobytes(), name
    assert traj.metadata["u1serve"]["sde_steps"] == [0]
    assert [line for line, _ in proxy.requests] == [f"GET /v1/rl/trajectories/{tid} HTTP/1.1"] * 3, proxy.requests
    ranges = [rng for _, rng in proxy.requests]
    assert ranges[0] is None and all(rng.startswith("bytes=") and rng.endswith("-") for rng in ranges[1:]), ranges
    starts = [int(rng[len("bytes="):-1]) for rng in ranges[1:]]
    if reset:   # an RST discards what sat unread in the client's socket: it resumes from what it had read (maybe 0)
        assert 0 <= starts[0] < after and starts[0] <= starts[1] < starts[0] + after, ranges
    else:       # a clean close delivers everything sent before it: on from each cut
        assert 0 < starts[0] < after and starts[0] < starts[1] < starts[0] + after, ranges
    wait_until(lambda: streams(stack) == 0, 30, interval=0.1)         # every cut stream was closed upstream


def test_a_fetch_cut_more_often_than_it_resumes_fails_clearly(stack, small):
    tid, _ = small
    t0 = time.monotonic()
    with CuttingProxy(stack.base, MB, cuts=FETCH_RESUMES + 1) as proxy, RLClient(proxy.base, timeout=60) as c:
        with pytest.raises(RLAPIError, match=f"cut {FETCH_RESUMES + 1} times") as err:
            c.trajectory_buffer(tid)
    assert err.value.status == 502 and time.monotonic() - t0 < 30             # an error, not a hang
    assert len(proxy.requests) == FETCH_RESUMES + 1 and proxy.requests[-1][1] is not None
    wait_until(lambda: streams(stack) == 0, 30, interval=0.1)


def test_a_trajectory_deleted_mid_fetch_streams_whole_then_frees_its_memory(stack):
    tid = rollout(stack, MEDIUM)
    with RLClient(stack.base) as c:
        want = hashlib.sha256(c.trajectory_buffer(tid).numpy()).hexdigest()
    gen_pid = stack.service_pids()["gen"]
    held = 2 * 9 * 3 * 512 * 512 * 4 + 2 * 8 * 4                      # latents + logprobs

    def store() -> dict:
        return httpx.get(stack.gen + "/health", timeout=10).json()["rl_trajectories"]
    before = store()
    assert before["streams"] == 0 and before["draining_bytes"] == 0
    host, port = stack.base.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.connect()
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    conn.request("GET", f"/v1/rl/trajectories/{tid}")
    r = conn.getresponse()
    assert r.status == 200
    size = int(r.headers["content-length"])
    digest = hashlib.sha256(r.read(4 * MB))             # a part, then the client stops reading (back-pressure)
    assert store()["streams"] == 1
    rss_streaming = _rss(gen_pid)
    assert httpx.delete(f"{stack.base}/v1/rl/trajectories/{tid}", timeout=30).status_code == 200
    during = store()
    assert during["streams"] == 1 and during["trajectories"] == before["trajectories"] - 1
    assert during["bytes"] == before["bytes"] - held and during["draining_bytes"] == held
    again = httpx.get(f"{stack.base}/v1/rl/trajectories/{tid}", timeout=30)
    assert again.status_code == 404 and again.json()["error"]["code"] == "trajectory_not_found"
    while chunk := r.read(8 * MB):                      # the running fetch goes on, to the last byte
        digest.update(chunk)
    conn.close()
    assert r.length in (0, None) and digest.hexdigest() == want and size > 50 * MB
    wait_until(lambda: store()["streams"] == 0 and store()["draining_bytes"] == 0, 30, interval=0.1)
    # the arrays are gone with the stream: generation's RSS falls by (nearly) their size
    wait_until(lambda: rss_streaming - _rss(gen_pid) > 0.8 * held, 30, interval=0.1)


def test_the_fetch_bench_measures_on_the_stack(stack):
    """bench/bench_trajectory_fetch.py's measuring part against this stack (its own stack start would cost CI a
    minute): both ways of fetching timed, the gateway's RSS watched, the table written."""
    args = argparse.Namespace(prompts=1, group_size=2, size=64, steps=2, repeat=1,
                              log_dir=os.path.dirname(stack.run_dir))
    out = asyncio.run(measure(stack.base, args))
    assert [r["how"] for r in out["runs"]] == ["raw", "decoded"]
    assert all(r["mb"] > 0 and r["mb_per_s"] > 0 and r["gateway_peak_rss_mb"] >= 0 for r in out["runs"])
    assert "| cpu |" in table({"cpu": out}, args)
