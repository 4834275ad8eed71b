"""uint8 RGB arrays -> base64 PNG / JPEG / WebP (runs in the HTTP process, off the engine loop).

PNG is written here rather than by Pillow: rows get PNG's "sub" filter (numpy, one pass), the
filtered bytes are deflated with zlib level 1 / Z_RLE in horizontal strips of whole rows on a thread
pool (zlib releases the GIL), and the strips are joined into one zlib stream (sync-flushed raw
deflate, one Adler-32). Measured on a 2048² photo-like image on a 2-core box: Pillow level 1
0.71 s / 8.1 MB, this 0.20 s / 7.1 MB on one thread (docs/benchmarks/generation.md, "the non-denoising
path"). The pool has one thread per CPU this process may use (affinity and cgroup quota, at most 8):
a container sees every host core but threads beyond its quota only get throttled.
(GPU run 1 measured "strips" slower than one thread: the strips were cut from a 2-D memoryview, so
the first one held every row and the others were empty; fixed, `_strips`.)
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

from services.base import knobs

_SAVE_ARGS = {
    "jpeg": {"format": "JPEG", "quality": 90},
    "webp": {"format": "WEBP", "quality": 90, "method": 0},
}
PNG_STRIP_BYTES = 1 << 20          # ~1 MB of filtered rows per deflate task
PNG_THREADS_ENV = knobs.PNG_THREADS.name


def usable_cpus() -> int:
    """CPUs this process can keep busy: its affinity mask, capped by a cgroup CPU quota (v2 cpu.max,
    v1 cfs_quota_us / cfs_period_us)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    for path, split in (("/sys/fs/cgroup/cpu.max", None),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(path) as f:
                fields = f.read().split()
            if split:
                with open(split) as f:
                    fields = fields[:1] + f.read().split()[:1]
            quota, period = fields[0], fields[1]
            if quota not in ("max", "-1") and int(period) > 0:
                n = min(n, max(1, int(quota) // int(period)))
            break
        except (OSError, ValueError, IndexError):
            continue
    return max(1, n)


def png_threads() -> int:
    return max(1, knobs.PNG_THREADS.get() or min(8, usable_cpus()))


_STRIP_POOL = ThreadPoolExecutor(max_workers=png_threads(), thread_name_prefix="u1-png")


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(tag)))


def _strips(filtered: np.ndarray) -> list[memoryview]:
    """The filtered rows [h, 1 + 3w] as byte strips of whole rows, about PNG_STRIP_BYTES each."""
    raw = memoryview(filtered).cast("B")          # 1-D: byte offsets, not rows
    row = filtered.shape[1]
    per = max(1, PNG_STRIP_BYTES // row) * row
    return [raw[i:i + per] for i in range(0, len(raw), per)]


def _adler32_combine(adler1: int, adler2: int, len2: int) -> int:
    """Adler-32 of A + B from those of A and B (len2 = len(B)); zlib's adler32_combine."""
    base = 65521
    rem = len2 % base
    s1 = adler1 & 0xFFFF
    s2 = (rem * s1) % base
    s1 = (s1 + (adler2 & 0xFFFF) + base - 1) % base
    s2 = (s2 + (adler1 >> 16) + (adler2 >> 16) + base - rem) % base
    return s1 | (s2 << 16)


def encode_png(pixels: np.ndarray, parallel: bool = True, pool: ThreadPoolExecutor | None = None) -> bytes:
    """[H, W, 3] uint8 -> PNG bytes (8-bit RGB, sub filter, deflate level 1 / RLE). `parallel`: strips
    deflated on `pool` (default: the module's pool of `png_threads()`), else on this thread."""
    h, w, _ = pixels.shape
    rows = pixels.reshape(h, w * 3)
    filtered = np.empty((h, w * 3 + 1), dtype=np.uint8)
    filtered[:, 0] = 1                                    # filter type "sub"
    filtered[:, 1:4] = rows[:, :3]
    np.subtract(rows[:, 3:], rows[:, :-3], out=filtered[:, 4:])   # wraps mod 256, as PNG wants
    strips = _strips(filtered)

    def deflate(i: int) -> tuple[bytes, int]:
        c = zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_RLE)
        data = c.compress(strips[i]) + c.flush(zlib.Z_FINISH if i == len(strips) - 1 else zlib.Z_SYNC_FLUSH)
        return data, zlib.adler32(strips[i])

    parts = list((pool or _STRIP_POOL).map(deflate, range(len(strips)))) if parallel and len(strips) > 1 \
        else [deflate(i) for i in range(len(strips))]
    adler = parts[0][1]
    for (_, a), s in zip(parts[1:], strips[1:]):
        adler = _adler32_combine(adler, a, s.nbytes)
    stream = b"\x78\x01" + b"".join(p for p, _ in parts) + struct.pack(">I", adler)
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


def encode_image(pixels: np.ndarray, fmt: str) -> bytes:
    """`pixels`: [H, W, 3] uint8. Returns the encoded image as base64 (ASCII bytes: `sse.encode` splices
    them into an event without a pass through `json.dumps`)."""
    return base64.b64encode(encode_bytes(pixels, fmt))


def warm(size: tuple[int, int] | None = None) -> None:
    """What a process's first images would set up, done at start-up (GenerationState.start, on the encoder pool
    while the engine loads): the PNG strip pool's threads (an image of one strip per thread), Pillow's JPEG /
    WebP plugins (previews are JPEG by default) and, given the default `size` (w, h), one image of it as noise
    encodes to PNG and base64: the first image's buffers of that size (the allocator's large blocks) then cost
    no more than a later one's (first 1024² request's encode 44 ms vs 31 steady on the H100, 2026-12-07)."""
    width = 512
    encode_png(np.zeros((png_threads() * (PNG_STRIP_BYTES // (3 * width) + 1), width, 3), np.uint8))
    for fmt in _SAVE_ARGS:
        encode_bytes(np.zeros((16, 16, 3), np.uint8), fmt)
    if size is not None:
        w, h = size
        encode_image(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8), "png")


def decode_image(b64: str) -> np.ndarray:
    """Inverse of `encode_image` (lossless only for PNG); used by tests and clients."""
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.asarray(im.convert("RGB"))
