"""Input images at the edge: checked from the header (format, pixels per image, pixels per request) before any
decoding, then decoded in a bounded pool to prove they are complete. Hostile files are 400s, never 500s; good
images pass (and meet the dead engines: 503). The gateway under test is conftest's `gateway` (no engines)."""
import base64
import io
import struct
import zlib

import httpx
import pytest
from PIL import Image

from .conftest import MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS
from .test_validation import CHAT, EDIT, assert_error


def chunk(kind: bytes, data: bytes, crc: int | None = None) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) if crc is None
                                                                    else crc)


def png_bytes(w: int, h: int, *, bit_depth: int = 8, color_type: int = 2, rows: int | None = None,
              ihdr_crc: int | None = None, idat: bytes | None = None) -> bytes:
    """A PNG whose header says w x h; `rows` rows of pixel data (all of them by default), or `idat` as is."""
    channels = {0: 1, 2: 3}[color_type]
    row_bytes = 1 + (w * channels * bit_depth + 7) // 8
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    if idat is None:
        idat = zlib.compress(b"\0" * row_bytes * (h if rows is None else rows), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr, ihdr_crc) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def encoded(w: int, h: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (90, 120, 30)).save(buf, format=fmt)
    return buf.getvalue()


def as_data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def edit(client: httpx.Client, *images: bytes) -> httpx.Response:
    files = [("image[]", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]
    return client.post(EDIT, data={"prompt": "x"}, files=files)


def test_decompression_bomb_is_refused_from_its_header(client):
    bomb = png_bytes(40000, 40000, bit_depth=1, color_type=0, rows=8)
    assert len(bomb) < 4096
    err = assert_error(edit(client, bomb), 400, "pixels")
    assert err["code"] == "image_too_large" and err["param"] == "image[0]"
    # the same as a data URL in JSON, and as a chat image part
    assert_error(client.post(EDIT, json={"prompt": "x", "image": [as_data_url(bomb)]}), 400, "pixels")
    msg = {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                       {"type": "image_url", "image_url": {"url": as_data_url(bomb)}}]}
    for extra in ({}, {"modalities": ["image"]}):
        assert_error(client.post(CHAT, json={"messages": [msg], **extra}), 400, "pixels")


def test_images_over_the_limits(client):
    side = int(MAX_IMAGE_PIXELS ** 0.5) + 32                 # just over the per-image limit
    err = assert_error(edit(client, png_bytes(side, side, bit_depth=1, color_type=0, rows=1)), 400,
                       f"at most {MAX_IMAGE_PIXELS} pixels per image")
    assert err["param"] == "image[0]"
    each = int((MAX_REQUEST_PIXELS * 0.6) ** 0.5)          # two of them fit one by one, not together
    assert each * each <= MAX_IMAGE_PIXELS and 2 * each * each > MAX_REQUEST_PIXELS
    err = assert_error(edit(client, encoded(each, each), encoded(each, each)), 400,
                       f"at most {MAX_REQUEST_PIXELS} per request")
    assert err["code"] == "image_too_large"


@pytest.mark.parametrize("name,data", [
    ("truncated", encoded(96, 64)[:80]),
    ("data-cut-short", png_bytes(64, 64, idat=zlib.compress(b"\0" * 193 * 64)[:16])),
    ("data-not-what-the-header-says", png_bytes(64, 64, idat=b"not zlib at all" * 8)),
    ("impossible-header", png_bytes(64, 64, bit_depth=3)),
    ("broken-header-crc", png_bytes(64, 64, ihdr_crc=1234)),
    ("truncated-jpeg", encoded(96, 64, "JPEG")[:300]),
    ("not-an-image", b"GIF89a but not really"),
    ("gif-not-allowed", encoded(32, 32, "GIF")),
    ("bmp-not-allowed", encoded(32, 32, "BMP")),
    ("empty", b""),
], ids=lambda v: v if isinstance(v, str) else "")
def test_broken_lying_or_unsupported_files_are_400(client, name, data):
    err = assert_error(edit(client, encoded(64, 64), data), 400)
    assert err["param"] == "image[1]" and err["code"] == "invalid_image", err
    if name.endswith("not-allowed"):
        assert "png, jpeg, webp" in err["message"]


@pytest.mark.parametrize("ref,code", [("data:image/png;base64,@@@", "invalid_image"),
                                      ("data:image/png,plain", "invalid_image"),
                                      ("https://example.invalid/a.png", "remote_images_disabled")])
def test_bad_image_references(client, ref, code):
    err = assert_error(client.post(EDIT, json={"prompt": "x", "image": ref}), 400)
    assert err["code"] == code and err["param"] == "image[0]"


def test_multipart_limits(client):
    many = [("image[]", (f"{i}.png", b"x", "image/png")) for i in range(9)]
    assert_error(client.post(EDIT, data={"prompt": "x"}, files=many), 400, "multipart")
    big_field = {"prompt": "x" * (2 * 1024 * 1024)}
    assert_error(client.post(EDIT, data=big_field, files={"image": ("a.png", encoded(32, 32), "image/png")}), 400)


def test_small_header_over_a_zlib_bomb_is_decoded_bounded(client):
    """A header that says 8x8 over 50 MB of compressed zeros: the decode stops at 8x8 (the engines see 8x8)."""
    lying = png_bytes(8, 8, idat=zlib.compress(b"\0" * (50 * 1024 * 1024), 9))
    r = edit(client, lying)
    assert_error(r, 503)
    assert r.elapsed.total_seconds() < 5


def test_good_images_pass_the_edge(client):
    """Every accepted format, as files, data URLs and bare base64, gets through to the (dead) engines."""
    for fmt in ("PNG", "JPEG", "WEBP"):
        data = encoded(96, 64, fmt)
        r = client.post(EDIT, data={"prompt": "x"}, files={"image": ("a", data, "application/octet-stream")})
        assert_error(r, 503)
        r = client.post(EDIT, json={"prompt": "x", "image[]": [as_data_url(data), base64.b64encode(data).decode()]})
        assert_error(r, 503)
