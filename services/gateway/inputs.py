"""Input images at the edge (edit files, data URLs, chat image parts), checked before anything else is done with
them: format and pixel count from the header (a decompression bomb never gets decoded), a pixel budget per
request, then a decode that proves the data is complete. All of it runs in a small thread pool, off the event
loop; every failure is a 400 that says what is accepted."""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Union

from PIL import Image

from services.kit.errors import bad_request

from .config import ImageInputLimits

_DATA_URL = re.compile(r"^data:(?P<mime>[\w/+.-]*)(;[\w=.-]+)*;base64,(?P<data>.*)$", re.S)
_PIL_NAMES = {"jpg": "JPEG"}

Raw = Union[bytes, str]          # an uploaded file, or a data URL / bare base64 string


@dataclass(frozen=True)
class CheckedImage:
    b64: str                     # what the engines get (base64, no data-URL prefix)
    width: int
    height: int


def decode_ref(text: str, param: str) -> bytes:
    """A data URL or bare base64 -> bytes; remote URLs are refused (the gateway fetches nothing)."""
    if text.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not supported; send a data URL "
                          "(data:image/png;base64,...)", param=param, code="remote_images_disabled")
    m = _DATA_URL.match(text)
    if text.startswith("data:") and not m:
        raise bad_request(f"{param}: only base64 data URLs are supported", param=param, code="invalid_image")
    try:
        return base64.b64decode((m.group("data") if m else text).strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: broken base64 data", param=param, code="invalid_image") from None


def _formats(limits: ImageInputLimits) -> list[str]:
    return [_PIL_NAMES.get(f, f.upper()) for f in limits.formats]


def _open(data: bytes, param: str, limits: ImageInputLimits) -> Image.Image:
    """The image with only its header read; a 400 for anything not allowed."""
    allowed = ", ".join(limits.formats)
    if not data:
        raise bad_request(f"{param} is empty", param=param, code="invalid_image")
    if len(data) > limits.max_image_bytes:
        raise bad_request(f"{param} is {len(data)} bytes: at most {limits.max_image_bytes} per image", param=param,
                          code="image_too_large")
    try:
        im = Image.open(io.BytesIO(data), formats=_formats(limits))
    except Image.DecompressionBombError:
        raise bad_request(f"{param} has more than {limits.max_image_pixels} pixels", param=param,
                          code="image_too_large") from None
    except Exception:            # PIL's header parsers raise many types; all mean "not an image we take"
        raise bad_request(f"{param} is not a readable image ({allowed})", param=param,
                          code="invalid_image") from None
    w, h = im.size
    if w < 1 or h < 1 or w * h > limits.max_image_pixels:
        im.close()
        raise bad_request(f"{param} is {w}x{h}: at most {limits.max_image_pixels} pixels per image", param=param,
                          code="image_too_large")
    return im


def check_images(items: list[tuple[str, Raw]], limits: ImageInputLimits) -> list[CheckedImage]:
    """[(param, raw)] -> the checked images, in order (blocking: run it in the pool)."""
    blobs = [(param, raw if isinstance(raw, bytes) else decode_ref(raw, param)) for param, raw in items]
    opened: list[Image.Image] = []
    try:
        for param, data in blobs:
            opened.append(_open(data, param, limits))
        total = sum(im.size[0] * im.size[1] for im in opened)
        if total > limits.max_request_pixels:
            raise bad_request(f"the input images have {total} pixels together: at most {limits.max_request_pixels} "
                              "per request", param=blobs[0][0], code="image_too_large")
        for (param, _), im in zip(blobs, opened):
            try:
                im.load()        # bounded by the header checks above; a truncated or corrupt file fails here
            except Exception:
                raise bad_request(f"{param} is not a readable image: truncated or corrupt data", param=param,
                                  code="invalid_image") from None
        return [CheckedImage(base64.b64encode(data).decode("ascii"), *im.size)
                for (_, data), im in zip(blobs, opened)]
    finally:
        for im in opened:
            im.close()


class ImageChecker:
    """The bounded pool the checks run in."""

    def __init__(self, limits: ImageInputLimits, workers: int):
        Image.init()
        unknown = [f for f in _formats(limits) if f not in Image.OPEN]
        if unknown:
            raise ValueError(f"unknown image formats {unknown}; PIL reads {sorted(Image.OPEN)}")
        self.limits = limits
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="u1-gw-images")

    async def check(self, items: list[tuple[str, Raw]]) -> list[CheckedImage]:
        if not items:
            return []
        return await asyncio.get_running_loop().run_in_executor(self.pool, check_images, items, self.limits)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def data_url(b64_text: str, fmt: str) -> str:
    return f"data:image/{fmt};base64,{b64_text}"
