"""The service kit through a real ASGI app: strict JSON, auth, body limits, error shapes, SSE, restart budget."""
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from services.contract.chat import ChatCompletionRequest
from services.kit import errors, sse
from services.kit.middleware import ApiKeyAuth, InternalTokenAuth, ServiceMiddleware
from services.kit.restart import RestartBudget, RestartPolicy
from services.kit.web import json_body


class Body(BaseModel):
    x: int = Field(0, ge=0, le=10)


def make_app(auth=None, max_body=1 << 16):
    app = FastAPI()
    errors.install(app, "test")

    @app.post("/v1/raw")
    async def raw(request: Request):
        return {"got": await json_body(request)}

    @app.post("/v1/model")
    async def model(body: Body):
        return {"x": body.x}

    @app.post("/v1/chat")
    async def chat(body: ChatCompletionRequest):
        return {"greedy": body.greedy}

    @app.get("/health")
    async def health():
        return {"ok": True}

    app.add_middleware(ServiceMiddleware, service="test", max_body_bytes=max_body, auth=auth)
    return app


def post(client, path, data: bytes, **headers):
    return client.post(path, content=data, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("data, words", [
    (b'{"x": NaN}', "NaN"), (b'{"x": Infinity}', "Infinity"), (b'{"x": 1e999}', "out of range"),
    (b"[" * 5000 + b"]" * 5000, "nested"), (b'{"a":' * 40 + b"1" + b"}" * 40, "nested"),
    (b"{not json", "not valid JSON"), (b"", "empty"),
], ids=["nan", "inf", "overflow", "deep-list", "deep-object", "garbage", "empty"])
def test_hostile_json_is_a_400_everywhere(data, words):
    c = TestClient(make_app())
    for path in ("/v1/raw", "/v1/model"):
        r = post(c, path, data)
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["error"]["message"] and r.json()["error"]["code"] == "invalid_json"
        assert r.headers["x-request-id"]


def test_validation_errors_name_the_field():
    c = TestClient(make_app())
    r = post(c, "/v1/model", b'{"x": 11}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "x", r.text
    assert "less than or equal to 10" in r.json()["error"]["message"]
    r = post(c, "/v1/chat", b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = post(c, "/v1/chat", b'{"messages": [{"role": "user", "content": [{"type": "video"}]}]}')
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content")
    r = post(c, "/v1/chat", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-40}')
    assert r.status_code == 200 and r.json() == {"greedy": True}


def test_body_limit():
    c = TestClient(make_app(max_body=64))
    r = post(c, "/v1/raw", b'{"a": "' + b"x" * 100 + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key_auth_constant_time_and_non_ascii():
    c = TestClient(make_app(auth=ApiKeyAuth("sk-test")))
    assert post(c, "/v1/raw", b"{}").status_code == 401
    assert post(c, "/v1/raw", b"{}", authorization="Bearer sk-wrong").status_code == 401
    assert post(c, "/v1/raw", b"{}", authorization="Bearer sk-test").status_code == 200
    assert post(c, "/v1/raw", b"{}", authorization="Bearer sk-t\u00e9st".encode("utf-8")
                ).status_code == 401
    assert post(c, "/v1/raw", b"{}", authorization="Basic abc").status_code == 401
    assert c.get("/health").status_code == 200


def test_internal_token_on_every_route_but_health():
    c = TestClient(make_app(auth=InternalTokenAuth("tok")))
    assert c.get("/health").status_code == 200
    assert post(c, "/v1/raw", b"{}").status_code == 401
    assert post(c, "/v1/raw", b"{}", **{"x-u1-internal-token": "tok"}).status_code == 200
    assert post(c, "/v1/raw", b"{}", authorization="Bearer tok").status_code == 200
    assert post(c, "/v1/raw", b"{}", **{"x-u1-internal-token": "\u00ff\u00fe".encode("utf-8")}).status_code == 401


def test_request_ids_are_sanitised():
    c = TestClient(make_app())
    assert post(c, "/v1/raw", b"{}", **{"x-request-id": "abc.1"}).headers["x-request-id"] == "abc.1"
    assert post(c, "/v1/raw", b"{}", **{"x-request-id": "bad id\x01"}).headers["x-request-id"].startswith("req-")


def test_sse_roundtrip():
    lines = (sse.encode({"a": 1}) + b": comment\n\n" + sse.encode([1]) + sse.encode({"b": "\u00e9"}) +
             sse.encode(sse.DONE) + sse.encode({"after": True})).decode().splitlines()
    assert list(sse.events(lines)) == [{"a": 1}, {"b": "\u00e9"}]


def test_restart_budget_backs_off_then_gives_up():
    now = [0.0]
    b = RestartBudget(RestartPolicy(base_delay_s=1, max_delay_s=5, max_failures=4, window_s=60), clock=lambda: now[0])
    assert [b.failure("x") for _ in range(3)] == [1, 2, 4]
    assert b.failure("boom") is None and "4 failures" in b.gave_up and "boom" in b.gave_up
    b2 = RestartBudget(RestartPolicy(base_delay_s=1, max_failures=3, window_s=10), clock=lambda: now[0])
    for _ in range(5):               # failures spread beyond the window never exhaust the budget
        assert b2.failure("x") is not None
        b2.healthy()
        now[0] += 11


def test_overloaded_carries_retry_after():
    e = errors.overloaded("busy", 2.4)
    assert e.status == 429 and e.headers["Retry-After"] == "2" and e.type == "rate_limit_error"
    up = errors.from_upstream(429, e.body(), "generation", {"Retry-After": "3", "x": "y"})
    assert up.headers == {"Retry-After": "3"} and up.code == "overloaded"


class _FakeProc:
    """A unit around a real child process (`python -c ...`)."""

    def __init__(self, code: str):
        import subprocess
        import sys
        self.p = subprocess.Popen([sys.executable, "-c", code])

    def alive(self):
        return self.p.poll() is None

    def stop(self):
        if self.alive():
            self.p.kill()
        self.p.wait()

    def exit_reason(self):
        return f"exit code {self.p.returncode}"

    def stopped_on_purpose(self):
        return self.p.returncode == 143


def test_supervisor_restarts_with_backoff_then_gives_up():
    import time

    from services.kit.supervisor import Supervisor
    from tests.waiting import wait_until
    deaths, gave_up = [], []
    spawned = []

    def spawn():
        spawned.append(_FakeProc("import time; time.sleep(0.3); raise SystemExit(3)"))
        return spawned[-1]

    s = Supervisor("unit", spawn, policy=RestartPolicy(base_delay_s=0.05, max_failures=3, window_s=60),
                   on_death=deaths.append, on_give_up=gave_up.append, poll_s=0.02)
    t0 = time.monotonic()
    s.start()
    s.mark_ready()            # the first unit came up; the later ones die before they report ready
    wait_until(lambda: gave_up, timeout=30)
    assert s.state == "failed" and "3 failures" in s.failure and "exit code 3" in s.failure
    assert len(deaths) == 3 and s.restarts == 2 and time.monotonic() - t0 < 20
    s.stop()


def test_supervisor_never_ready_is_not_restarted():
    from services.kit.supervisor import Supervisor
    from tests.waiting import wait_until
    gave_up = []
    s = Supervisor("unit", lambda: _FakeProc("raise SystemExit(7)"), on_give_up=gave_up.append, poll_s=0.02)
    s.start()
    wait_until(lambda: gave_up, timeout=20)
    assert s.state == "failed" and s.restarts == 0 and "failed to start" in s.failure and "7" in s.failure


def test_sse_splices_base64_bytes():
    import base64
    blob = base64.b64encode(bytes(range(256)) * 3)
    for ev in ({"type": "image", "b64": blob, "index": 0}, {"b64": blob}, {"b64": blob, "preview": blob[:8]}):
        want = {k: v.decode() if isinstance(v, bytes) else v for k, v in ev.items()}
        assert list(sse.events(sse.encode(ev).decode().splitlines())) == [want]
    for bad in (b'ab"c', b"ab\\c", b"ab\nc", "é".encode()):
        with pytest.raises(ValueError, match="base64"):
            sse.encode({"b64": bad})


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_owned_stream_cleans_up_when_the_client_left_before_the_body_started(spec_version):
    """The client is gone before the first byte (ASGI 2.4: `send` raises OSError; 2.3: `receive` says
    http.disconnect at once): the body never runs, yet it is closed and `on_close` runs, once."""
    import asyncio

    from services.kit.streaming import OwnedStream
    ran, closed = [], []

    async def body():
        ran.append(True)
        yield b"data: {}\n\n"

    async def on_close():
        closed.append(True)

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        if spec_version == "2.4":
            raise OSError("client gone")
        await asyncio.sleep(0.05)

    async def run():
        stream = body()
        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        try:
            await OwnedStream(stream, on_close=on_close)(scope, receive, send)
        except Exception:
            pass                      # Starlette's ClientDisconnect (2.4): the server drops it
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()  # closed
    asyncio.run(run())
    assert closed == [True] and ran == []
