"""Request bodies at the gateway, against real gateway processes (no engines needed): each route's size limit
(Content-Length and chunked), the JSON element budget counted before parsing, media types (415), nesting bounded
on every route, duplicate Authorization headers, chat image limits; and the liveness probe stays fast while a
32 MB body is refused."""
import base64
import io
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from PIL import Image

from services.contract import limits as L

from tests.system.stackproc import GatewayProc

from .conftest import API_KEY

CHAT = "/v1/chat/completions"
GEN = "/v1/images/generations"
EDIT = "/v1/images/edits"
MB = 1000 * 1000


def dead_url() -> str:
    from services.base.netutil import free_port
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A keyless gateway with the default body table, generations tightened by --route-body-mb."""
    g = GatewayProc(dead_url(), dead_url(), "--route-body-mb", f"{GEN}=0.5",
                    log_dir=str(tmp_path_factory.mktemp("bodies"))).wait_up()
    yield g
    assert "Traceback" not in g.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def raw_post(port: int, path: str, head: dict, body_chunks, chunked: bool) -> tuple[int, dict]:
    """POST over a plain socket, the body sent piece by piece until the server answers; (status, error body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in head.items())]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    s.setblocking(False)
    sent = 0
    try:
        for chunk in body_chunks:
            try:
                if s.recv(1, socket.MSG_PEEK):
                    break                              # the answer came before the body was all sent
            except BlockingIOError:
                pass
            data = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") if chunked else chunk
            s.setblocking(True)
            s.sendall(data)
            s.setblocking(False)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    s.setblocking(True)
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw) < raw.index(b"\r\n\r\n") + 4 + _length(raw):
        got = s.recv(65536)
        if not got:
            break
        raw += got
    s.close()
    head_text, _, rest = raw.partition(b"\r\n\r\n")
    return int(head_text.split()[1]), json.loads(rest[:_length(raw)] or b"{}")


def _length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


class Prober:
    """/health/live polled from a thread; the latency of each answer."""

    def __init__(self, base: str):
        self.base, self.times, self.failures = base, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        with httpx.Client(timeout=5) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    ok = c.get(self.base + "/health/live").status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    self.failures.append(repr(exc))
                if ok:
                    self.times.append(time.perf_counter() - t)
                time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def test_health_live_stays_fast_while_32mb_bodies_are_refused(plain):
    with Prober(plain.base) as quiet:
        time.sleep(1.5)
    rss_before = rss_mb(plain.proc.pid)
    many_objects = (b"{}," * (256 * 1024) for _ in range(43))              # 32 MB of [{},{},...]
    big_prompt = (b"a" * (256 * 1024) for _ in range(160))                 # 40 MB, over chat's 32 MiB
    with Prober(plain.base) as busy:
        # Content-Length over the route's limit: refused before a byte of the body is read
        status, err = raw_post(plain.port, CHAT, {"Content-Length": str(40 * MB)}, iter([b"{"] * 10), False)
        assert status == 413 and err["error"]["code"] == "request_too_large"
        # chunked: the element budget refuses [{},{},...] after a few hundred kB, the size limit a long string
        status, err = raw_post(plain.port, CHAT, {}, (c for c in [b'{"messages": [', *many_objects]), True)
        assert status == 400 and err["error"]["code"] == "json_too_complex", err
        status, err = raw_post(plain.port, CHAT, {}, (c for c in [b'{"x": "', *big_prompt]), True)
        assert status == 413 and "33554432" in err["error"]["message"], err
        status, err = raw_post(plain.port, GEN, {}, (c for c in [b'{"prompt": "', b"a" * MB]), True)
        assert status == 413 and "524288" in err["error"]["message"], err      # --route-body-mb
    assert not busy.failures and busy.times, busy.failures
    # the probe is answered as it is when nothing else runs (a fixed bound allows for a busy test machine)
    assert statistics.median(busy.times) < statistics.median(quiet.times) + 0.1, (quiet.times, busy.times)
    assert rss_mb(plain.proc.pid) < rss_before + 200


@pytest.mark.parametrize("path", [CHAT, GEN, EDIT])
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-u1+json", "application/x-www-form-urlencoded",
                                   None])
def test_other_media_types_are_415(plain, path, ctype):
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(plain.base + path, content=b'{"prompt": "x", "num_inference_steps": NaN}', headers=headers,
                   timeout=10)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_multipart_only_where_the_route_takes_it(plain):
    files = {"image": ("a.png", png(64, 64), "image/png")}
    assert httpx.post(plain.base + GEN, data={"prompt": "x"}, files=files, timeout=10).status_code == 415
    r = httpx.post(plain.base + EDIT, data={"prompt": "x", "size": "64x64"}, files=files, timeout=10)
    assert r.status_code == 503, r.text            # accepted and checked; no engine behind this gateway


@pytest.mark.parametrize("depth", [3, 30, 200, 5000])
def test_a_deeply_nested_field_is_a_400_on_every_route(plain, depth):
    msgs = [{"role": "user", "content": "x"}]
    image = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
    deep = "DEEP"
    for path, body in [(GEN, {"prompt": "x", "cfg_interval": deep}),
                       (EDIT, {"prompt": "x", "image": [image], "cfg_interval": deep}),
                       (CHAT, {"messages": msgs, "modalities": ["image"], "image_config": {"cfg_interval": deep}}),
                       (CHAT, {"messages": msgs, "modalities": ["text", "image"], "cfg_interval": deep}),
                       (CHAT, {"messages": msgs, "stop": deep})]:
        raw = json.dumps(body).replace('"DEEP"', "[" * depth + "0.5" + "]" * depth)
        r = httpx.post(plain.base + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, (path, r.text)


def test_duplicate_authorization_headers_are_refused(gateway):
    headers = [("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer other")]
    r = httpx.get(gateway + "/v1/models", headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_header"
    headers = [("Authorization", f"Bearer {API_KEY}"), ("Authorization", f"Bearer {API_KEY}")]
    assert httpx.get(gateway + "/v1/models", headers=headers, timeout=10).status_code == 400


def png(w: int, h: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format=fmt)
    return buf.getvalue()


def chat_with(images: list[bytes], mime: str = "image/png") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(b).decode()}"}}
             for b in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]}


def test_chat_image_count_and_formats(plain):
    small = png(32, 32)
    r = httpx.post(plain.base + CHAT, json=chat_with([small] * (L.MAX_CHAT_IMAGES + 1)), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images", r.text
    assert r.json()["error"]["param"] == f"messages[0].content[{L.MAX_CHAT_IMAGES}]"
    for fmt in ("GIF", "BMP", "TIFF"):
        r = httpx.post(plain.base + CHAT, json=chat_with([png(32, 32, fmt)]), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", (fmt, r.text)
    # 4097 x 4097 pixels (a few kB of PNG): refused from its header, as understanding refuses it
    r = httpx.post(plain.base + CHAT, json=chat_with([png(4097, 4097)]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large", r.text
    r = httpx.post(plain.base + CHAT, json=chat_with([small] * L.MAX_CHAT_IMAGES), timeout=30)
    assert r.status_code == 503, r.text                     # within the limits: on to understanding (down here)


def test_every_post_route_reads_the_body_the_middleware_parsed():
    """A route that FastAPI would parse again (leniently, on the event loop) cannot slip in: e.g. a new router
    without `route_class=ParsedJsonRoute`."""
    from fastapi.routing import APIRoute

    from services.gateway.app import create_app
    from services.gateway.config import GatewayConfig
    from services.kit.web import ParsedJsonRoute
    def routes(items):          # newer FastAPI keeps included routers as routes of their own
        for r in items:
            inner = getattr(r, "original_router", None)
            yield from routes(inner.routes) if inner is not None else [r]
    posts = [r for r in routes(create_app(GatewayConfig()).routes) if isinstance(r, APIRoute) and "POST" in r.methods]
    assert posts and all(isinstance(r, ParsedJsonRoute) for r in posts), [r.path for r in posts]
