"""Issue 30 against a real `u1serve up` stack on CPU (tiny checkpoint, loopback):

- 256 clients that send a streaming request and never read are cut after --stream-write-timeout-s, their work
  is cancelled, every slot comes back and other clients are served; no KV page, lease or job is left behind;
- a job queued in generation behind a long one ends as 429 queue_timeout (heartbeats keep the gateway's idle
  limit from answering 504 first);
- a second stack with the same --kv-pool-name fails at start and leaves the running stack's pool alone;
- after SIGKILL of the whole stack (launcher included), the next stack of that pool name reclaims the segment
  and the dead understanding's socket directory.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.base.netutil import free_port
from tests.system.stackproc import GatewayProc
from tests.system.stackproc import ROOT, RunningStack, group_alive, pid_alive, shm_entries
from tests.metrics import metric
from tests.waiting import wait_until

WRITE_TIMEOUT_S = 2
GATEWAY = f"--stream-write-timeout-s {WRITE_TIMEOUT_S} --stream-send-buffer-kb 1"
QUEUE_S = 9          # generation's queue limit (its heartbeats: every 1 s)
GEN = f"--max-running-jobs 1 --max-queue-wait-s {QUEUE_S} --stream-heartbeat-s 1"
UND = "--max-queue-wait-s 8"
IDLE_S = 6           # the idle limit of a second gateway in front of the same engines: below the queue limit
HOSTILE_CHATS, HOSTILE_IMAGES = 252, 4


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    s = RunningStack(tiny_model, "colocate", str(tmp_path_factory.mktemp("hostile")),
                     extra=["--gateway-args", GATEWAY, "--gen-args", GEN, "--und-args", UND])
    s.wait_ready()
    yield s
    if s.proc.poll() is None:            # (the last test kills it)
        assert s.stop() == 0, s.output()


def engines_idle(stack) -> bool:
    """No job, request, admission slot, KV page or lease left in either engine."""
    und = httpx.get(f"http://127.0.0.1:{stack.und_port}/health", timeout=30).json()
    gen = httpx.get(f"http://127.0.0.1:{stack.gen_port}/health", timeout=30).json()
    return (gen["queued"] == gen["running"] == 0 and und["running"] == und["waiting"] == und["inflight"] == 0
            and und["admission"]["in_flight"] == 0 and und["shm_pages_used"] == 0
            and und["shm_handles_live"] == 0)


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """A request whose client never reads its answer (and offers a small receive window)."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


# each answer is larger than what a connection absorbs with --stream-send-buffer-kb 1 (~10 KB): it stalls
# (a few tokens with their top-20 log-probs: big chunks for little engine work)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 10,
        "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 20}   # ~15 KB of SSE
IMAGE = {"prompt": "a fox", "size": "96x96", "n": 1, "stream": True, "num_inference_steps": 1,
         "response_format": "b64_json", "output_format": "png"}              # ~37 KB of SSE


def test_256_clients_that_never_read_give_their_slots_back(stack):
    openai = pytest.importorskip("openai")
    cut_before = metric(stack.base, "u1serve_gateway_slow_readers_cut_total", timeout=60)
    socks = [raw_request(stack.port, "/v1/chat/completions", CHAT) for _ in range(HOSTILE_CHATS)]
    socks += [raw_request(stack.port, "/v1/images/generations", IMAGE) for _ in range(HOSTILE_IMAGES)]
    try:
        # their work runs, then each stalls with its answer half sent and is cut WRITE_TIMEOUT_S later
        wait_until(lambda: metric(stack.base, "u1serve_gateway_requests_in_flight", timeout=60) <= 1, 300, interval=1)
        cut = metric(stack.base, "u1serve_gateway_slow_readers_cut_total", timeout=60) - cut_before
        assert cut >= HOSTILE_CHATS, cut
        # the slots are back: a reading client is served at once, not 429'd
        client = openai.OpenAI(base_url=stack.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(3):
            chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4)
            assert chat.choices[0].message is not None
        img = client.images.generate(model="m", prompt="a fox", size="64x64", response_format="b64_json",
                                     extra_body={"num_inference_steps": 1})
        assert img.data[0].b64_json
        assert wait_until(lambda: engines_idle(stack), 60, interval=0.5)
    finally:
        for s in socks:
            s.close()
    assert "Traceback" not in stack.output()


def test_a_queued_image_ends_as_429_queue_timeout_not_504(stack, tmp_path):
    """Behind a gateway whose idle limit (6 s) is below generation's queue limit (9 s): generation's heartbeats
    (1 s) keep the queued job's stream alive, so its own 429 answers, not the gateway's 504."""
    openai = pytest.importorskip("openai")
    gw = GatewayProc(f"http://127.0.0.1:{stack.und_port}", f"http://127.0.0.1:{stack.gen_port}",
                     "--upstream-idle-timeout-s", str(IDLE_S), env={"U1SERVE_INTERNAL_TOKEN": stack.token},
                     log_dir=str(tmp_path)).wait_up()
    try:
        _queued_job_gets_429(stack, gw.base, openai)
    finally:
        assert "Traceback" not in gw.stop()


def _queued_job_gets_429(stack, base: str, openai) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    long_job = {**IMAGE, "size": "256x256", "num_inference_steps": 1000}
    started = threading.Event()

    def long_stream(stop: threading.Event):
        with httpx.stream("POST", base + "/v1/images/generations", json=long_job, timeout=120) as r:
            for line in r.iter_lines():
                if '.progress"' in line:             # image_generation.progress
                    started.set()
                if stop.is_set():
                    return                   # the client leaves: the job is cancelled

    stop = threading.Event()
    t = threading.Thread(target=long_stream, args=(stop,), daemon=True)
    t.start()
    try:
        assert started.wait(120)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:      # one job at a time: this one waits in the queue
            client.images.generate(model="m", prompt="a cat", size="64x64", extra_body={"num_inference_steps": 1})
        waited = time.monotonic() - t0
        err = info.value
        assert err.status_code == 429 and err.code == "queue_timeout", err
        assert err.response.headers.get("retry-after")
        assert waited >= QUEUE_S - 1, waited        # generation's queue limit, not the gateway's idle limit
    finally:
        stop.set()
        t.join(60)
    assert wait_until(lambda: engines_idle(stack), 60, interval=0.5)


def _up(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "tiny", "--device", "cpu",
                           "--host", "127.0.0.1", *flags], capture_output=True, text=True, cwd=ROOT, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_a_second_stack_with_the_same_pool_fails_and_leaves_it_alone(stack, tmp_path):
    r = _up("--port", str(free_port()), "--kv-pool-name", stack.pool, "--run-dir", str(tmp_path), "--grace", "3")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"{stack.pool!r}" in out and "belongs to a live process" in out and "starting und" not in out, out
    assert stack.pool in shm_entries()
    img = httpx.post(stack.base + "/v1/images/generations", timeout=120,
                     json={"prompt": "still here", "size": "64x64", "num_inference_steps": 1})
    assert img.status_code == 200 and img.json()["data"][0]["b64_json"], img.text


def _und_dirs_of(pid: int) -> list[str]:
    import tempfile
    root = tempfile.gettempdir()
    out = []
    for entry in os.listdir(root):
        path = os.path.join(root, entry, ".owner")
        if entry.startswith("u1und-") and os.path.exists(path):
            with open(path) as f:
                if f.read().strip() == str(pid):
                    out.append(os.path.dirname(path))
    return out


def test_after_sigkill_of_the_whole_stack_the_next_one_reclaims_its_segment(stack, tiny_model, tmp_path):
    pids = stack.service_pids()
    socket_dirs = _und_dirs_of(pids["und"])
    assert socket_dirs
    os.kill(stack.proc.pid, signal.SIGSTOP)             # the launcher can neither restart nor clean up
    for pid in pids.values():
        os.killpg(pid, signal.SIGKILL)
    stack.proc.kill()
    stack.proc.wait(10)
    assert wait_until(lambda: not any(group_alive(p) or pid_alive(p) for p in pids.values()), 30)
    assert stack.pool in shm_entries() and all(os.path.isdir(d) for d in socket_dirs)   # left behind
    nxt = RunningStack(tiny_model, "colocate", str(tmp_path), extra=["--kv-pool-name", stack.pool])
    nxt.pool = stack.pool                               # the next stack of that name
    try:
        nxt.wait_ready()
        img = httpx.post(nxt.base + "/v1/images/generations", timeout=120,
                         json={"prompt": "reclaimed", "size": "64x64", "num_inference_steps": 1})
        assert img.status_code == 200, img.text
        assert not any(os.path.isdir(d) for d in socket_dirs)
    finally:
        assert nxt.stop() == 0, nxt.output()
    assert stack.pool not in shm_entries()
