"""Input images for understanding: decode, smart_resize to multiples of 32, normalise, patchify."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .constants import VQA_MAX_PIXELS, VQA_MIN_PIXELS

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PATCH = 16
FACTOR = 32  # patch 16 x merge 2: one LLM token per 32x32 block
EDIT_MIN_PIXELS = 512 * 512
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An input image that cannot be used; the message says why (becomes a 400)."""


@dataclass
class ImageTensor:
    pixel_values: torch.Tensor  # [gh * gw, 768] fp32, 16-px patches row-major, (c, y, x) inside
    grid_hw: tuple[int, int]  # (gh, gw) on the 16-px grid

    @property
    def num_tokens(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1] // 4


def edit_max_pixels(num_images: int) -> int:
    return min(2048 * 2048, (4096 * 4096) // max(1, num_images))


# Largest source image (width x height from its header) we agree to decode; PIL's own decompression-bomb
# check (Image.MAX_IMAGE_PIXELS, ~89 Mpx) is a second line behind it.
MAX_SOURCE_PIXELS = 4096 * 4096
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError,
                  Image.DecompressionBombWarning)


def open_image(data: bytes, max_bytes: int | None = None, max_pixels: int = MAX_SOURCE_PIXELS,
               formats: tuple[str, ...] | None = None) -> Image.Image:
    """Open `data` lazily (PIL reads only the header) and check its size before any pixel is decoded: more
    than `max_pixels` pixels, a decompression bomb, an unreadable header or a format not in `formats` ('png',
    'jpeg', ...; None: any PIL reads) raise ImageError."""
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes, above the limit of {max_bytes}")
    try:
        img = Image.open(io.BytesIO(data), formats=[f.upper() for f in formats] if formats else None)
    except _DECODE_ERRORS as e:
        accepted = f" (accepted formats: {', '.join(formats)})" if formats else ""
        raise ImageError(f"cannot decode image{accepted}: {e}") from None
    if img.width * img.height > max_pixels:
        raise ImageError(f"image is {img.width}x{img.height} = {img.width * img.height} pixels, above the limit "
                         f"of {max_pixels} pixels per image")
    return img


def _decode_rgb(img: Image.Image) -> Image.Image:
    try:
        img.load()
        if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(bg, rgba)
        return img.convert("RGB")
    except MemoryError:
        raise ImageError("image too large to decode") from None
    except _DECODE_ERRORS as e:
        raise ImageError(f"cannot decode image: {e}") from None


def load_image(data, max_bytes: int | None = None, max_decoded_pixels: int = MAX_SOURCE_PIXELS) -> Image.Image:
    """bytes or PIL -> RGB PIL; transparent pixels go onto white (as upstream)."""
    if isinstance(data, Image.Image):
        return _decode_rgb(data)
    return _decode_rgb(open_image(data, max_bytes, max_decoded_pixels))


def load_resized(data: bytes, min_pixels: int, max_pixels: int, max_source_pixels: int = MAX_SOURCE_PIXELS,
                 max_bytes: int | None = None) -> Image.Image:
    """`load_image`, then already resized to the `smart_resize` size that `preprocess(img, min_pixels,
    max_pixels)` would pick, so the full-size copy is dropped at once (the result is the same image:
    `preprocess` then resizes nothing). Kept full size in the rare case where `smart_resize` would change a
    size it picked itself."""
    img = load_image(data, max_bytes, max_source_pixels)
    h, w = smart_resize(img.height, img.width, min_pixels, max_pixels)
    if (w, h) != img.size and smart_resize(h, w, min_pixels, max_pixels) == (h, w):
        img = img.resize((w, h), Image.BICUBIC)
    return img


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = FACTOR):
    """Qwen2.5-VL rule: nearest multiples of `factor`, then scale into [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ImageError("image has an empty side")
    if max(height, width) / min(height, width) >= MAX_ASPECT_RATIO:
        raise ImageError(f"aspect ratio must be below {MAX_ASPECT_RATIO}, got {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_normalized_tensor(img: Image.Image) -> torch.Tensor:
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (arr - mean) / std


def patchify16(x: torch.Tensor) -> torch.Tensor:
    """[3, H, W] -> [(H/16)*(W/16), 768], patches row-major, (channel, row, col) inside a patch."""
    c, h, w = x.shape
    gh, gw = h // PATCH, w // PATCH
    return x.view(c, gh, PATCH, gw, PATCH).permute(1, 3, 0, 2, 4).reshape(gh * gw, c * PATCH * PATCH)


def generation_input(image: ImageTensor) -> ImageTensor:
    """An input image of an image-generating request (edit, interleaved answer) as the official it2i_generate and
    interleave_gen feed it: the normalised pixels cast to bf16 whatever the model dtype (`.to(torch.bfloat16)`
    after load_image_native), then widened by the embedder. A no-op for a bf16 model; in fp32, skipping it moves
    the answer by up to a uint8 level on a few percent of pixels."""
    return ImageTensor(pixel_values=image.pixel_values.to(torch.bfloat16).float(), grid_hw=image.grid_hw)


def generated_image_tensor(x: torch.Tensor) -> ImageTensor:
    """A generated image [3, H, W] (the final Euler state in [-1, 1], unclamped, at its own size) as input of the
    und embedder, as the official interleave_gen feeds it back (interleave_spec §2.6): x*0.5+0.5, then ImageNet
    mean/std, every op rounded to bf16 whatever the model dtype; no uint8 round trip, no resize."""
    if x.dim() != 3 or x.shape[0] != 3 or x.shape[1] % FACTOR or x.shape[2] % FACTOR:
        raise ImageError(f"a generated image is [3, H, W] with sides multiple of {FACTOR}, got {tuple(x.shape)}")
    bf = torch.bfloat16
    y = x.detach().to(bf) * 0.5 + 0.5
    mean = torch.tensor(IMAGENET_MEAN, dtype=bf, device=y.device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=bf, device=y.device).view(3, 1, 1)
    y = (y - mean) / std
    return ImageTensor(pixel_values=patchify16(y).float().cpu().contiguous(),
                       grid_hw=(x.shape[1] // PATCH, x.shape[2] // PATCH))


def preprocess(img: Image.Image, min_pixels: int = VQA_MIN_PIXELS, max_pixels: int = VQA_MAX_PIXELS) -> ImageTensor:
    h, w = smart_resize(img.height, img.width, min_pixels, max_pixels)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    x = to_normalized_tensor(img)
    return ImageTensor(pixel_values=patchify16(x), grid_hw=(h // PATCH, w // PATCH))
