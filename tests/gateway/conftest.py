"""Real gateway processes for the gateway tests:

- `gateway`: a gateway with NO engines behind it (validation must answer on its own, valid requests get 503);
- `stack`: a real `u1serve up` stack on the tiny checkpoint (CPU), for timeouts, admission and KV cleanup;
- `side_gateway(und_url, gen_url, *flags)`: extra gateway processes with their own flags;
- `peer`: a scripted HTTP peer in this process, standing in for an engine where the gateway's outgoing bodies
  or an engine answer the real engines do not give (a 429) are what is under test.
"""
import inspect
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from services.netutil import free_port
from services.kit.proc import preexec_die_with_parent  # a killed test run leaves no server behind

from tests.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "sk-gateway-test"
API_KEY_2 = "sk-gateway-test-second"
# input image limits of the `gateway` fixture (small, so the tests' images stay small)
MAX_IMAGE_PIXELS = 1_000_000
MAX_REQUEST_PIXELS = 1_500_000
MAX_STEPS = 200                  # tighter than the contract's, to test operator limits


class GatewayProc:
    """`python -m services.gateway.server` on loopback; its output is kept for assertions."""

    def __init__(self, und_urls: str, gen_urls: str, *flags: str, env: dict | None = None, log_dir: str = "/tmp",
                 host: str | None = "127.0.0.1"):
        """host None: no --host flag (the gateway's own default)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "services.gateway.server", *(["--host", host] if host else []),
                "--port", str(self.port),
                "--und-url", und_urls, "--gen-url", gen_urls, "--default-size", "64x64", *flags]
        self.log_path = os.path.join(log_dir, f"gateway-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_die_with_parent)

    def wait_up(self, timeout: float = 60.0) -> "GatewayProc":
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(self.base + "/health/live", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            wait_until(up, timeout, interval=0.1)
        except TimeoutError:
            raise RuntimeError("gateway did not start:\n" + self.stop()) from None
        return self

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.output()


@pytest.fixture(scope="session")
def gateway(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# two keys: rotation\n{API_KEY}\n\n{API_KEY_2}\n")
    dead = f"http://127.0.0.1:{free_port()}"
    g = GatewayProc(dead, f"http://127.0.0.1:{free_port()}", "--api-key-file", str(keys), "--max-body-mb", "8",
                    "--max-steps", str(MAX_STEPS), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
                    "--max-request-pixels", str(MAX_REQUEST_PIXELS)).wait_up()
    yield g.base
    out = g.stop()
    assert "Traceback" not in out, out


@pytest.fixture()
def client(gateway):
    with httpx.Client(base_url=gateway, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


# ------------------------------------------------------------------------------------------ real engines
@pytest.fixture(scope="package")
def stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import RunningStack
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("gw-stack")),
                     extra=["--enable-rl", "--enable-runtime-lora", "--allowed-local-dirs", "/tmp"])
    s.wait_ready()
    s.und = f"http://127.0.0.1:{s.und_port}"
    s.gen = f"http://127.0.0.1:{s.gen_port}"
    yield s
    for pid in s.service_pids().values():      # never leave an engine stopped
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    s.stop_clean()


@pytest.fixture()
def side_gateway(tmp_path):
    """start(und_url, gen_url, *flags, env=...) -> a started GatewayProc; all are stopped after the test."""
    procs = []

    def start(und_url: str, gen_url: str, *flags: str, env: dict | None = None,
              host: str | None = "127.0.0.1") -> GatewayProc:
        procs.append(GatewayProc(und_url, gen_url, *flags, env=env, log_dir=str(tmp_path), host=host))
        return procs[-1].wait_up()

    yield start
    for p in procs:
        out = p.stop()
        assert "Traceback" not in out, out


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
