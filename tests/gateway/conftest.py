"""The gateway's own tests:

- `gateway`: a gateway process with NO engines behind it (validation must answer on its own, valid requests get
  503), and `client`: the same gateway in this process over an ASGI transport, for the tests that need no
  socket;
- `peer`: a scripted HTTP peer in this process, standing in for an engine where the gateway's outgoing bodies
  or an engine answer the real engines do not give (a 429) are what is under test;
- `side_gateway(und_url, gen_url, *flags)` (tests/conftest.py): extra gateway processes with their own flags.

Tests against a real `u1serve up` stack live in tests/system (its shared `stack`, tests/conftest.py).
"""
import inspect
import logging
import threading

import pytest
from services.base.netutil import free_port

from tests.system.stackproc import GatewayProc
from tests.waiting import wait_until

API_KEY = "sk-gateway-test"
API_KEY_2 = "sk-gateway-test-second"
# input image limits of the `gateway` fixture (small, so the tests' images stay small)
MAX_IMAGE_PIXELS = 1_000_000
MAX_REQUEST_PIXELS = 1_500_000
MAX_STEPS = 200                  # tighter than the contract's, to test operator limits
MAX_STEP_PIXELS = 2 * 2 * 1024 * 1024   # n x branches x pixels of one request: two CFG images of 1024²


@pytest.fixture(scope="session")
def dead_gateway_argv(tmp_path_factory) -> list[str]:
    """The flags of the engine-less gateway (`gateway`, `client`): two API keys, small limits, dead engine URLs."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# two keys: rotation\n{API_KEY}\n\n{API_KEY_2}\n")
    return ["--und-url", f"http://127.0.0.1:{free_port()}", "--gen-url", f"http://127.0.0.1:{free_port()}",
            "--api-key-file", str(keys), "--max-body-mb", "8", "--max-steps", str(MAX_STEPS),
            "--max-image-pixels", str(MAX_IMAGE_PIXELS), "--max-request-pixels", str(MAX_REQUEST_PIXELS),
            "--max-step-pixels", str(MAX_STEP_PIXELS)]


@pytest.fixture(scope="package")
def gateway(dead_gateway_argv, tmp_path_factory):
    """The engine-less gateway as a real process (its base URL): for the tests that need its socket (raw
    headers, the openai SDK, the served pages)."""
    und, gen = dead_gateway_argv[1], dead_gateway_argv[3]
    g = GatewayProc(und, gen, *dead_gateway_argv[4:], log_dir=str(tmp_path_factory.mktemp("gateway"))).wait_up()
    yield g.base
    out = g.stop()
    assert "Traceback" not in out, out


class LoggedTracebacks(logging.Handler):
    """Every gateway log record that carries a traceback (the in-process twin of "no Traceback in its log")."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="package")
def gateway_in_process(dead_gateway_argv):
    """The same engine-less gateway in this process, over an ASGI transport (no socket, no process): the
    app `services.gateway.server` serves, built from the same flags; a server error raises in the test."""
    from starlette.testclient import TestClient

    from services.gateway.app import create_app
    from services.gateway.config import build_arg_parser, config_from_args
    app = create_app(config_from_args(build_arg_parser().parse_args(
        [*dead_gateway_argv, "--default-size", "64x64"])))
    with TestClient(app, base_url="http://127.0.0.1", headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture()
def client(gateway_in_process):
    """An API-key client of the in-process engine-less gateway (httpx's client API); the test fails if the
    gateway logged a traceback meanwhile (as the process's log is checked)."""
    logged = LoggedTracebacks()
    logger = logging.getLogger("u1serve")
    logger.addHandler(logged)
    try:
        yield gateway_in_process
    finally:
        logger.removeHandler(logged)
    assert not logged.records, [r.getMessage() for r in logged.records]


# ------------------------------------------------------------------------------------------ scripted peer
class Peer:
    """A FastAPI app on loopback in a thread. It records every body it receives (`seen[path]`) and answers with
    `replies[path](body)` if set, else a default that behaves like the engine on that path."""

    def __init__(self):
        import uvicorn
        from fastapi import FastAPI, Request
        self.seen: dict[str, list] = {}
        self.replies: dict = {}
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/{path:path}")
        async def any_post(path: str, request: Request):
            body = await request.json()
            self.seen.setdefault("/" + path, []).append({"body": body, "headers": dict(request.headers)})
            reply = self.replies.get("/" + path) or DEFAULT_REPLIES.get("/" + path)
            result = reply(body) if reply else {}
            return await result if inspect.isawaitable(result) else result

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 20, interval=0.02)

    def bodies(self, path: str) -> list[dict]:
        return [s["body"] for s in self.seen.get(path, [])]

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def sse_response(*events, status: int = 200):
    from fastapi.responses import StreamingResponse

    from services.kit import sse

    def body():
        for ev in events:
            yield sse.encode(ev)
        yield sse.encode(sse.DONE)
    return StreamingResponse(body(), status_code=status, media_type="text/event-stream")


def fake_handles(prefix_body: dict) -> dict:
    from services.contract.image import PrefixRequest
    branches = PrefixRequest.model_validate(prefix_body).branches()
    return {b: {"handle_id": i + 1, "branch": b} for i, b in enumerate(branches)}


def tiny_png_b64() -> str:
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


DEFAULT_REPLIES = {
    "/v1/chat/completions": lambda body: {
        "id": "chatcmpl-peer", "object": "chat.completion", "created": 0, "model": "peer",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
    "/internal/image_prefix": lambda body: sse_response(
        {"type": "handles", "handles": fake_handles(body), "think_text": None}),
    "/internal/generate": lambda body: sse_response(
        {"type": "queued"}, {"type": "progress", "step": 1, "total": 1, "eta_s": 0.5},
        *[{"type": "image", "index": i, "b64": tiny_png_b64(), "format": body["output_format"],
           "width": body["width"], "height": body["height"], "seed": body["seed"], "nsfw": False}
          for i in range(body["n"])]),
    "/internal/release": lambda body: {"released_pages": 0},
    "/internal/abort": lambda body: {"request_id": body["request_id"], "aborted": 0},
}


@pytest.fixture()
def peer():
    p = Peer()
    yield p
    p.stop()
