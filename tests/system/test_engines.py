"""Against real engines (a `u1serve up` stack on the tiny checkpoint, CPU). A hung engine (SIGSTOP) gives the
client a 504 (or an error event and [DONE] once a stream started), never a hang; the engine-side work is
cancelled as for a client that went away, and no exit path leaves a KV page behind (understanding's /health
`shm_pages_used`). Admission answers 429 with Retry-After. The openai SDK's typed calls work."""
import base64
import contextlib
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from services.kit import sse
from tests.metrics import metric
from tests.waiting import wait_until

from tests.gateway.conftest import API_KEY
from tests.system.stackproc import GatewayProc

IDLE_S = 4                    # the test gateways' --upstream-idle-timeout-s
SLACK_S = 10                  # CPU CI: the answer comes within IDLE_S + this
LONG_JOB = {"prompt": "a long job", "size": "256x256", "num_inference_steps": 1000, "seed": 1}


def und_health(stack) -> dict:
    return httpx.get(stack.und + "/health", timeout=10).json()


def und_generated_tokens(stack) -> float:
    return metric(stack.und, "u1_und_generation_tokens_total", {"X-U1-Internal-Token": stack.token}, timeout=10)


def pool_empty(stack) -> bool:
    h = und_health(stack)
    return h.get("shm_pages_used") == 0 and h.get("inflight", 0) == 0


def generation_idle(stack) -> bool:
    return httpx.get(stack.gen + "/health", timeout=10).json().get("running") == 0


@contextlib.contextmanager
def stopped(pid: int):
    """The engine's HTTP process frozen (alive, accepting connections, answering nothing)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def sse_lines(r: httpx.Response):
    return sse.events(r.iter_lines(), done=True)


def png_bytes(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (40, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def gw(stack, tmp_path_factory):
    """A gateway with API keys from a file, the internal token from a file and a short idle limit."""
    d = tmp_path_factory.mktemp("gw-engines")
    (d / "keys").write_text(API_KEY + "\n")
    (d / "token").write_text(stack.token + "\n")
    g = GatewayProc(stack.und, stack.gen, "--api-key-file", str(d / "keys"), "--internal-token-file",
                    str(d / "token"), "--upstream-idle-timeout-s", str(IDLE_S), log_dir=str(d),
                    env={"U1SERVE_INTERNAL_TOKEN": ""}).wait_up()
    yield g
    out = g.stop()
    assert "Traceback" not in out, out


@pytest.fixture()
def client(gw):
    with httpx.Client(base_url=gw.base, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_openai_sdk_typed_calls(gw, stack):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=gw.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = c.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                  temperature=0.0, seed=3, extra_body={"top_k": 5, "cache_salt": "t1"})
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="m", max_tokens=4, stream=True,
                                            messages=[{"role": "user", "content": "count"}]))
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
    img = c.images.generate(model="m", prompt="a fox", n=2, size="64x32",
                            extra_body={"num_inference_steps": 2, "seed": 7, "flow_shift": 2.0})
    assert [Image.open(io.BytesIO(base64.b64decode(d.b64_json))).size for d in img.data] == [(64, 32)] * 2
    edit = c.images.edit(model="m", prompt="make it blue", image=[("a.png", png_bytes(64, 64), "image/png")],
                         extra_body={"num_inference_steps": 2})
    assert Image.open(io.BytesIO(base64.b64decode(edit.data[0].b64_json))).size == (64, 64)
    events = list(c.images.generate(model="m", prompt="a kite", size="64x64", stream=True,
                                    extra_body={"num_inference_steps": 2}))
    assert [e.type for e in events][-1] == "image_generation.completed"
    with pytest.raises(openai.BadRequestError):
        c.images.generate(model="m", prompt="x", size="64x64", extra_body={"seed": 2**63})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert wait_until(lambda: pool_empty(stack), 30)


def test_hung_understanding_is_a_504_then_nothing_is_left(client, stack):
    before = und_health(stack)["restarts"]

    def timed(path: str, body: dict) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        return client.post(path, json=body), time.monotonic() - t0

    with stopped(stack.service_pids()["und"]):
        # at once (each request's own idle limit, timed on its own): one idle limit of the run, not four
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda a: timed(*a), (
                ("/v1/images/generations", {"prompt": "x", "size": "64x64"}),
                ("/v1/images/generations", {"prompt": "x", "size": "64x64", "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                          "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a cat"}],
                                          "modalities": ["image"], "stream": True}))))
        for r, seconds in answers:
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "upstream_timeout"
            assert IDLE_S - 0.5 <= seconds < IDLE_S + SLACK_S
    # understanding wakes up to requests whose clients are gone: it aborts them and frees their pages
    assert wait_until(lambda: pool_empty(stack), 60), und_health(stack)
    assert und_health(stack)["restarts"] == before
    assert client.post("/v1/images/generations", json={"prompt": "after", "size": "64x64",
                                                       "num_inference_steps": 1}).status_code == 200


def test_hung_generation_is_a_504_and_the_gateway_frees_the_prefix(client, stack):
    with stopped(stack.service_pids()["gen"]):
        t0 = time.monotonic()
        r = client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64", "num_inference_steps": 2})
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout", r.text
        assert time.monotonic() - t0 < IDLE_S + SLACK_S
        # generation cannot confirm a cancel, so the gateway releases the pages itself, with generation still frozen
        assert wait_until(lambda: pool_empty(stack), 30), und_health(stack)
    assert wait_until(lambda: generation_idle(stack), 60)
    r = client.post("/v1/images/generations", json={"prompt": "after", "size": "64x64", "num_inference_steps": 1})
    assert r.status_code == 200, r.text
    assert wait_until(lambda: pool_empty(stack), 30)


def test_generation_hanging_mid_stream_ends_the_stream_with_an_error_event(client, stack):
    events = []
    with client.stream("POST", "/v1/images/generations", json={**LONG_JOB, "stream": True}) as r:
        assert r.status_code == 200
        for ev in sse_lines(r):
            events.append(ev)
            if ev != "[DONE]" and ev["type"] == "image_generation.progress" and len(events) == 1:
                os.kill(stack.service_pids()["gen"], signal.SIGSTOP)
                t0 = time.monotonic()
    try:
        assert events[-1] == "[DONE]"
        err = events[-2]
        assert err["type"] == "error" and err["status"] == 504 and err["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - t0 < IDLE_S + SLACK_S
    finally:
        os.kill(stack.service_pids()["gen"], signal.SIGCONT)
    # generation sees the dropped stream and cancels the job
    assert wait_until(lambda: generation_idle(stack), 60)
    assert wait_until(lambda: pool_empty(stack), 30)


def test_request_deadline_cancels_the_work(stack, side_gateway):
    g = side_gateway(stack.und, stack.gen, "--request-timeout-s", "3", env={"U1SERVE_INTERNAL_TOKEN": stack.token})
    t0 = time.monotonic()
    r = httpx.post(g.base + "/v1/images/generations", json=LONG_JOB, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    assert time.monotonic() - t0 < 3 + SLACK_S
    assert wait_until(lambda: generation_idle(stack), 30)
    assert wait_until(lambda: pool_empty(stack), 30)
    # a non-streamed chat has no idle limit (its answer comes in one piece): the deadline bounds it
    with stopped(stack.service_pids()["und"]):
        r = httpx.post(g.base + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    assert wait_until(lambda: pool_empty(stack), 60)
    metrics = httpx.get(g.base + "/metrics", timeout=10).text
    assert 'u1serve_gateway_upstream_timeouts_total{code="deadline_exceeded"} 2.0' in metrics


def test_admission_answers_429_with_retry_after(stack, side_gateway):
    g = side_gateway(stack.und, stack.gen, "--max-concurrent-requests", "1",
                     env={"U1SERVE_INTERNAL_TOKEN": stack.token})
    quick = {"prompt": "quick", "size": "64x64", "num_inference_steps": 1}
    with httpx.stream("POST", g.base + "/v1/images/generations", json={**LONG_JOB, "stream": True}, timeout=60) as r:
        events = sse_lines(r)           # kept referenced: a dropped line iterator closes the connection
        for ev in events:
            if ev != "[DONE]" and ev["type"] == "image_generation.progress":
                break                   # the slot is taken while this stream runs
        busy = httpx.post(g.base + "/v1/images/generations", json=quick, timeout=30)
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1, busy.text
        assert busy.json()["error"]["type"] == "rate_limit_error" and busy.headers["x-request-id"]
        assert httpx.post(g.base + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 429
        assert httpx.get(g.base + "/v1/models", timeout=10).status_code == 200     # GETs are not admitted
        events.close()
    # the stream is gone: its slot is free again and its job was cancelled
    assert wait_until(lambda: httpx.post(g.base + "/v1/images/generations", json=quick,
                                         timeout=60).status_code == 200, 60)
    assert wait_until(lambda: generation_idle(stack), 30)


def test_client_going_away_in_each_phase_leaves_no_pages(client, stack):
    """During think (understanding still working) and during denoise: the stream is closed after its first
    event of that phase; the engines stop and every page comes back."""
    for body, first in (({"prompt": "think long", "size": "64x64", "think": True, "max_think_tokens": 4000,
                          "stream": True}, "image_generation.think_delta"),
                        ({**LONG_JOB, "stream": True}, "image_generation.progress")):
        with client.stream("POST", "/v1/images/generations", json=body) as r:
            assert r.status_code == 200
            for ev in sse_lines(r):
                if ev != "[DONE]" and ev["type"] == first:
                    break
        assert wait_until(lambda: pool_empty(stack) and und_health(stack)["running"] == 0, 60), und_health(stack)
        assert wait_until(lambda: generation_idle(stack), 60)
    r = client.post("/v1/images/generations", json={"prompt": "done", "size": "64x64", "num_inference_steps": 1})
    assert r.status_code == 200
    assert wait_until(lambda: pool_empty(stack), 30)


def _stream_chat(g, max_tokens: int, on_first) -> list:
    """A streamed chat through gateway `g`, `on_first()` called at its first event; its events."""
    body = {"messages": [{"role": "user", "content": "count slowly"}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", g.base + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for ev in sse_lines(r):
            events.append(ev)
            if len(events) == 1:
                on_first()
    return events


def test_sigterm_drains_a_streamed_chat_within_the_grace_period(stack, side_gateway):
    """--graceful-shutdown-s: a chat in flight when SIGTERM comes (understanding frozen a moment meanwhile, so it
    surely is) is relayed to its end, then the gateway exits."""
    g = side_gateway(stack.und, stack.gen, "--graceful-shutdown-s", "30", env={"U1SERVE_INTERNAL_TOKEN": stack.token})

    def sigterm_while_in_flight():
        with stopped(stack.service_pids()["und"]):
            g.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert g.proc.poll() is None          # draining, not gone
    # long enough that the engine cannot have decoded it all between the first event and the freeze (24 tokens
    # could, on a loaded machine: the whole answer then sat in the socket and the gateway had nothing to drain)
    tokens = 400
    events = _stream_chat(g, tokens, sigterm_while_in_flight)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "length"
    assert events[-2]["usage"]["completion_tokens"] == tokens
    assert g.proc.wait(30) in (0, -signal.SIGTERM)       # uvicorn re-raises the signal it handled


def test_sigterm_ends_a_stream_that_outlasts_the_grace_period_cleanly(stack, side_gateway):
    """A stream still running near the end of the grace period ends with a 503 shutting_down error event and
    [DONE] (not a cut connection), before uvicorn would cancel it; understanding's work is aborted."""
    grace = 2.0
    g = side_gateway(stack.und, stack.gen, "--graceful-shutdown-s", str(grace),
                     env={"U1SERVE_INTERNAL_TOKEN": stack.token})
    und_pid = stack.service_pids()["und"]
    t0 = []
    tokens_before = und_generated_tokens(stack)

    def hang_then_sigterm():
        os.kill(und_pid, signal.SIGSTOP)
        t0.append(time.monotonic())
        g.proc.send_signal(signal.SIGTERM)
    try:
        events = _stream_chat(g, 2000, hang_then_sigterm)
        elapsed = time.monotonic() - t0[0]
    finally:
        os.kill(und_pid, signal.SIGCONT)
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert err["type"] == "error" and err["status"] == 503 and err["error"]["code"] == "shutting_down", err
    # ended by the drain's deadline, not at once (the error event above shows uvicorn did not cut it; no tight upper
    # bound: a loaded machine may deliver the last event late)
    assert elapsed > grace / 2, elapsed
    assert g.proc.wait(30) in (0, -signal.SIGTERM)
    # understanding sees the relay gone and aborts the chat instead of decoding its 2000 tokens
    assert wait_until(lambda: und_health(stack)["running"] == 0, 30), und_health(stack)
    assert und_generated_tokens(stack) - tokens_before < 2000
