"""The service's PNG writer (sub filter, RLE deflate in strips joined into one zlib stream) decodes to
the same pixels in any decoder that follows the PNG spec (Pillow here)."""
from __future__ import annotations

import io
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from services.generation import encode
from services.generation.encode import decode_image, encode_image, encode_png


@pytest.mark.parametrize("h,w", [(1, 1), (7, 3), (64, 96), (300, 257), (1100, 1000)])
@pytest.mark.parametrize("parallel", [False, True])
def test_png_round_trip(h, w, parallel, monkeypatch):
    monkeypatch.setattr(encode, "PNG_STRIP_BYTES", 4096)   # many strips even for small images
    rng = np.random.default_rng(h * w)
    px = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    px[: h // 2] = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None]   # smooth half, noisy half
    with ThreadPoolExecutor(3) as pool:
        data = encode_png(px, parallel=parallel, pool=pool)
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.size == (w, h)
        assert np.array_equal(np.asarray(im), px)
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    assert len(zlib.decompress(idat)) == h * (3 * w + 1)     # one valid zlib stream, checksum included


def test_strips_are_whole_rows_that_cover_the_image(monkeypatch):
    monkeypatch.setattr(encode, "PNG_STRIP_BYTES", 4096)
    filtered = np.zeros((300, 3 * 257 + 1), dtype=np.uint8)
    strips = encode._strips(filtered)
    row = filtered.shape[1]
    assert len(strips) == -(-300 // (4096 // row))                     # 5 rows per strip: 60 strips
    assert all(s.ndim == 1 and s.nbytes % row == 0 and s.nbytes for s in strips)
    assert sum(s.nbytes for s in strips) == filtered.nbytes


def test_adler32_of_strips_combines_to_the_whole():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 70001, dtype=np.uint8).tobytes(), rng.integers(0, 256, 9, dtype=np.uint8).tobytes()
    for x, y in ((a, b), (b, a), (b"", a), (a, b"")):
        assert encode._adler32_combine(zlib.adler32(x), zlib.adler32(y), len(y)) == zlib.adler32(x + y)


def test_png_threads_follow_the_usable_cpus(monkeypatch):
    assert 1 <= encode.usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.delenv(encode.PNG_THREADS_ENV, raising=False)
    assert encode.png_threads() == min(8, encode.usable_cpus())
    monkeypatch.setenv(encode.PNG_THREADS_ENV, "3")
    assert encode.png_threads() == 3


def test_formats_through_encode_image():
    px = np.random.default_rng(0).integers(0, 256, (64, 48, 3), dtype=np.uint8)
    assert np.array_equal(decode_image(encode_image(px, "png")), px)
    for fmt in ("jpeg", "webp"):
        assert decode_image(encode_image(px, fmt)).shape == (64, 48, 3)
    with pytest.raises(ValueError):
        encode_image(px.astype(np.float32), "png")
