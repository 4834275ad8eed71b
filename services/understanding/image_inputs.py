"""Request images -> decoded PIL images, within limits checked before any pixel is decoded.

Every image of a request is base64-decoded and its header read first (PIL opens lazily): the count, the
per-image pixel limit and the per-request pixel budget are checked on the header sizes, so a decompression
bomb or sixteen 4000x4000 images are a 400 before a single pixel is decoded. Decoding (and the CPU-heavy
prompt building that follows) then runs in a bounded thread pool off the event loop, one image at a time per
request, and each image is resized to its model size in the worker, so the full-size copy dies at once.
Peak decode memory is about `threads` x (largest source image x 4 bytes + its resized copy)."""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import anyio
import anyio.to_thread

from services.contract import limits as L
from services.kit.errors import bad_request
from services.model import images as IM

T = TypeVar("T")


@dataclass(frozen=True)
class ImageBudget:
    """The contract's input-image limits (the gateway checks the same ones), or tighter."""
    max_images: int = L.MAX_CHAT_IMAGES                          # per request
    max_image_bytes: int = L.MAX_INPUT_IMAGE_BYTES               # encoded size of one image
    max_pixels_per_image: int = L.MAX_INPUT_IMAGE_PIXELS         # source pixels (header), one image
    max_pixels_per_request: int = L.MAX_INPUT_REQUEST_PIXELS     # source pixels (headers), all images of a request
    formats: tuple[str, ...] = L.INPUT_IMAGE_FORMATS


def _raw_bytes(ref: Any, max_bytes: int, param: str) -> bytes:
    """A data URL or bare base64 string -> bytes; 400 with the reason otherwise."""
    if not isinstance(ref, str) or not ref:
        raise bad_request(f"{param} must be a data URL or base64 string", param)
    if ref.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are disabled on this server; send a data URL "
                          "(data:image/png;base64,...)", param, "remote_images_disabled")
    data = ref
    if ref.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep or ";base64" not in head:
            raise bad_request(f"{param}: only base64 data URLs are supported", param)
    if len(data) > max_bytes * 4 // 3 + 8:
        raise bad_request(f"{param}: image is larger than {max_bytes} bytes", param, "image_too_large")
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: broken base64 data", param, "invalid_base64") from None


class ImageDecoder:
    def __init__(self, budget: ImageBudget, threads: int):
        self.budget = budget
        self.limiter = anyio.CapacityLimiter(max(1, threads))

    async def run(self, fn: Callable[..., T], *args) -> T:
        """CPU- and memory-heavy work (decode, resize, normalise, tokenise) in the bounded pool."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def _check(self, refs: list[tuple[str, Any]]) -> list[tuple[str, bytes]]:
        """Base64 and headers of every image against the count, per-image and per-request limits."""
        b = self.budget
        if len(refs) > b.max_images:
            raise bad_request(f"{len(refs)} images in one request; at most {b.max_images} are allowed",
                              refs[b.max_images][0], "too_many_images")
        out, total = [], 0
        for param, ref in refs:
            raw = _raw_bytes(ref, b.max_image_bytes, param)
            try:
                img = IM.open_image(raw, b.max_image_bytes, b.max_pixels_per_image, b.formats)
            except IM.ImageError as e:
                raise bad_request(f"{param}: {e}", param, "invalid_image") from None
            total += img.width * img.height
            img.close()
            if total > b.max_pixels_per_request:
                raise bad_request(f"{param}: the request's images have {total} pixels in all, above the limit of "
                                  f"{b.max_pixels_per_request} pixels per request", param, "image_budget_exceeded")
            out.append((param, raw))
        return out

    async def decode(self, refs: list[tuple[str, Any]], min_pixels: int, max_pixels: int) -> list:
        """[(param, data URL or base64)] -> RGB PIL images already at their `smart_resize` size for
        (min_pixels, max_pixels). 400 naming the offending image otherwise."""
        if not refs:
            return []
        checked = await self.run(self._check, refs)
        pils = []
        for param, raw in checked:
            try:
                pils.append(await self.run(IM.load_resized, raw, min_pixels, max_pixels,
                                           self.budget.max_pixels_per_image))
            except IM.ImageError as e:
                raise bad_request(f"{param}: {e}", param, "invalid_image") from None
        return pils
