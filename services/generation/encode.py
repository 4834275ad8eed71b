"""uint8 RGB arrays -> base64 PNG / JPEG / WebP (runs in the HTTP process, off the engine loop).

PNG is written here rather than by Pillow: rows get PNG's "sub" filter (numpy, one pass), the
filtered bytes are deflated with zlib level 1 / Z_RLE in horizontal strips on a thread pool (zlib
releases the GIL), and the strips are joined into one zlib stream (sync-flushed raw deflate, one
Adler-32). Measured on a 2048² photo-like image on a 2-core box: Pillow level 1 0.71 s / 8.1 MB,
this 0.20 s / 7.1 MB on one thread (docs/benchmarks/generation.md, "the non-denoising path").
"""
from __future__ import annotations

import base64
import io
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

_SAVE_ARGS = {
    "jpeg": {"format": "JPEG", "quality": 90},
    "webp": {"format": "WEBP", "quality": 90, "method": 0},
}
PNG_STRIP_BYTES = 1 << 20          # ~1 MB of filtered rows per deflate task
_STRIP_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="u1-png")


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(tag)))


def encode_png(pixels: np.ndarray, parallel: bool = True) -> bytes:
    """[H, W, 3] uint8 -> PNG bytes (8-bit RGB, sub filter, deflate level 1 / RLE)."""
    h, w, _ = pixels.shape
    rows = pixels.reshape(h, w * 3)
    filtered = np.empty((h, w * 3 + 1), dtype=np.uint8)
    filtered[:, 0] = 1                                    # filter type "sub"
    filtered[:, 1:4] = rows[:, :3]
    np.subtract(rows[:, 3:], rows[:, :-3], out=filtered[:, 4:])   # wraps mod 256, as PNG wants
    raw = filtered.data
    per = max(1, PNG_STRIP_BYTES // (w * 3 + 1)) * (w * 3 + 1)
    strips = [raw[i:i + per] for i in range(0, filtered.nbytes, per)]

    def deflate(i: int) -> bytes:
        c = zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_RLE)
        return c.compress(strips[i]) + c.flush(zlib.Z_FINISH if i == len(strips) - 1 else zlib.Z_SYNC_FLUSH)

    parts = list(_STRIP_POOL.map(deflate, range(len(strips)))) if parallel and len(strips) > 1 \
        else [deflate(i) for i in range(len(strips))]
    stream = b"\x78\x01" + b"".join(parts) + struct.pack(">I", zlib.adler32(raw))
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", stream) + _chunk(b"IEND", b""))


def encode_bytes(pixels: np.ndarray, fmt: str) -> bytes:
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8, got {pixels.shape} {pixels.dtype}")
    if fmt == "png":
        return encode_png(np.ascontiguousarray(pixels))
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, **_SAVE_ARGS[fmt])
    return buf.getvalue()


def encode_image(pixels: np.ndarray, fmt: str) -> str:
    """`pixels`: [H, W, 3] uint8. Returns the encoded image as base64 text."""
    return base64.b64encode(encode_bytes(pixels, fmt)).decode("ascii")


def decode_image(b64: str) -> np.ndarray:
    """Inverse of `encode_image` (lossless only for PNG); used by tests and clients."""
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB"))
