"""A large trajectory (> 200 MB) through the real stack: the gateway relays it as a stream (its RSS stays bounded
while the bytes pass, and while a client stops reading), the bytes are the generation store's, a `Range` request
resumes, the client helper decodes it in place, and a client that disconnects mid-fetch leaves no stream open."""
import hashlib
import socket
import time

import httpx
import numpy as np
import pytest

from bench.bench_trajectory_fetch import PeakRss
from services.gateway.upstream import TOKEN_HEADER
from services.rl.client import RLClient
from tests.waiting import wait_until

MB = 1 << 20
# 1 prompt x G = 4 x 17 states of 512² fp32: 214 MB; no CFG, one SDE step, no images (a quick rollout)
BIG = {"prompts": [{"prompt": "a red cat"}], "group_size": 4, "size": "512x512", "num_inference_steps": 16,
       "guidance_scale": 1.0, "timestep_shift": 3.0, "seed": 3, "sde": {"kind": "flow", "steps": [0]},
       "return_images": False}
RSS_BOUND = 96 * MB        # the old gateway held the whole blob (twice: httpx's body and the Response's)


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
