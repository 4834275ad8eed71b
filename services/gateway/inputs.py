"""Input images: decode enough to validate them and learn their size; pass them on as base64."""
from __future__ import annotations

import base64
import binascii
import io
import re

from PIL import Image, UnidentifiedImageError

from .errors import bad_request

MAX_INPUT_PIXELS = 64 * 1024 * 1024       # refuse decompression bombs early
_DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]*)(;[\w=.-]+)*;base64,(?P<data>.*)$", re.S)


def check_image(data: bytes, param: str) -> tuple[int, int]:
    """(width, height) of a decodable image; a 400 for anything else."""
    if not data:
        raise bad_request(f"'{param}' is empty", param=param, code="invalid_image")
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > MAX_INPUT_PIXELS:
                raise bad_request(f"'{param}' is too large ({w}x{h})", param=param,
                                  code="invalid_image")
            im.load()   # decode fully: truncated files fail here, not in the engine
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise bad_request(f"'{param}' is not a readable image (PNG, JPEG, WebP, ...)",
                          param=param, code="invalid_image") from None
    if w < 1 or h < 1 or max(w, h) / min(w, h) >= 200:
        raise bad_request(f"'{param}' has an unsupported shape {w}x{h}", param=param,
                          code="invalid_image")
    return w, h


def decode_b64_or_data_url(text: str, param: str) -> bytes:
    """Accept a data URL or bare base64; remote URLs are refused (the gateway fetches nothing)."""
    if not isinstance(text, str):
        raise bad_request(f"'{param}' must be a data URL or base64 string", param=param,
                          code="invalid_type")
    if text.startswith(("http://", "https://")):
        raise bad_request(f"'{param}': remote image URLs are not supported; send a data URL "
                          "(data:image/png;base64,...)", param=param, code="invalid_image")
    m = _DATA_URL.match(text)
    payload = m.group("data") if m else text
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        raise bad_request(f"'{param}' is not valid base64", param=param,
                          code="invalid_image") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(b64_text: str, fmt: str) -> str:
    return f"data:image/{fmt};base64,{b64_text}"
