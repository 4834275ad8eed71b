"""Input images are checked on their headers before any pixel is decoded, and decoded in a bounded pool:
sixteen 4000x4000 1-bit PNGs (2 KB each) in one request are a 400, a decompression bomb is a 400 (never a
500), two of them fit the per-request budget and are decoded, and 30 parallel requests of either kind leave
the server's memory bounded (peak RSS growth under RSS_BOUND_MB) and the server answering."""
from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image

from services.model import images as IM

from .conftest import HEADERS, IMG_MAX, IMG_MIN
from .helpers import make_image

RSS_BOUND_MB = 400      # measured ~130: 2 decode threads x (16 Mpx x 3 B RGB + 1-bit source + resize buffers)


def png_1bit(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, "PNG")
    return buf.getvalue()


def png_bomb(w: int, h: int) -> bytes:
    """A valid 1-bit PNG of w x h black pixels written row by row (tens of KB for 400 Mpx)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    z = zlib.compressobj(9)
    row = b"\x00" * (1 + (w + 7) // 8)
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(images: list[str], max_tokens: int = 1) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": "?"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}


def post(server, body, timeout=120):
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=timeout)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class PeakRSS:
    """Samples a process's RSS in the background; `.peak` is the highest seen."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, rss_mb(pid), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


# ---- the model's image helpers, in process ------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_open_checks_the_header_before_decoding():
    with pytest.raises(IM.ImageError, match="above the limit"):
        IM.open_image(png_1bit(4000, 4000), max_pixels=4000 * 4000 - 1)
    assert IM.open_image(png_1bit(4000, 4000)).size == (4000, 4000)
    for w, h in [(10000, 10000), (20000, 20000)]:     # over PIL's bomb warning / error thresholds
        with pytest.raises(IM.ImageError):
            IM.load_image(png_bomb(w, h))
    with pytest.raises(IM.ImageError, match="cannot decode"):
        IM.load_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)


@pytest.mark.parametrize("size", [(130, 40), (4000, 3000), (40, 7000), (33, 33)])
def test_load_resized_is_the_same_image_preprocess_sees(size):
    pil, url = make_image(7, *size) if size[0] * size[1] < 10**6 else (None, None)
    raw = base64.b64decode(url.split(",", 1)[1]) if url else png_1bit(*size)
    want = IM.preprocess(IM.load_image(raw), IMG_MIN, IMG_MAX)
    got = IM.preprocess(IM.load_resized(raw, IMG_MIN, IMG_MAX), IMG_MIN, IMG_MAX)
    assert got.grid_hw == want.grid_hw
    assert torch.equal(got.pixel_values, want.pixel_values)


# ---- through the real server ---------------------------------------------------------------------------------
def test_sixteen_large_images_are_refused_before_decoding(server):
    img = data_url(png_1bit(4000, 4000))
    assert len(img) < 4096
    r = post(server, chat([img] * 16))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "image_budget_exceeded" and err["param"] == "messages[0].content[2].image_url"
    assert "pixels per request" in err["message"]
    r = post(server, chat([data_url(png_1bit(8, 8))] * 17))
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images", r.text


@pytest.mark.parametrize("w,h", [(5000, 5000), (10000, 10000), (20000, 20000)])
def test_decompression_bombs_are_400(server, w, h):
    r = post(server, chat([data_url(png_bomb(w, h))]))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_image" and "pixels" in r.json()["error"]["message"]


def test_thirty_parallel_requests_keep_memory_bounded(server):
    big = data_url(png_1bit(4000, 4000))
    over = chat([big] * 16)                 # refused on the headers
    within = chat([big] * 2)                # 32 Mpx: decoded (and resized) inside the budget
    pid = server.proc.pid
    post(server, within)                    # warm up the decode path once before taking the baseline
    base = rss_mb(pid)
    t0 = time.monotonic()
    with PeakRSS(pid) as rss, ThreadPoolExecutor(30) as ex:
        codes = list(ex.map(lambda i: post(server, over if i % 2 else within, timeout=300).status_code, range(30)))
    assert codes.count(400) == 15 and codes.count(200) == 15, codes
    assert rss.peak - base < RSS_BOUND_MB, (base, rss.peak)
    r = post(server, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and time.monotonic() - t0 < 300
    assert server.wait_idle()["kv_in_use"] == 0
