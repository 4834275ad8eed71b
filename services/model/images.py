"""Input images for understanding: decode, smart_resize to multiples of 32, normalise, patchify."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PATCH = 16
FACTOR = 32  # patch 16 x merge 2: one LLM token per 32x32 block
VQA_MIN_PIXELS, VQA_MAX_PIXELS = 65536, 4194304
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


def load_image(data, max_bytes: int | None = None, max_decoded_pixels: int = 64_000_000) -> Image.Image:
    """bytes or PIL -> RGB PIL; transparent pixels go onto white (as upstream)."""
    if isinstance(data, Image.Image):
        img = data
    else:
        if max_bytes is not None and len(data) > max_bytes:
            raise ImageError(f"image is {len(data)} bytes, above the limit of {max_bytes}")
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > max_decoded_pixels:
                raise ImageError(f"image is {img.width}x{img.height}, above {max_decoded_pixels} pixels")
            img.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise ImageError(f"cannot decode image: {e}") from None
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, rgba)
    return img.convert("RGB")


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


def preprocess(img: Image.Image, min_pixels: int = VQA_MIN_PIXELS, max_pixels: int = VQA_MAX_PIXELS) -> ImageTensor:
    h, w = smart_resize(img.height, img.width, min_pixels, max_pixels)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    x = to_normalized_tensor(img)
    return ImageTensor(pixel_values=patchify16(x), grid_hw=(h // PATCH, w // PATCH))
