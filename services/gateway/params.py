"""Parse and validate image-request options into an ImageJob (JSON bodies and multipart forms).

Options are accepted at the top level, under `extra_body` (what a raw-HTTP user copies from the
SDK docs) and under `extra_args`; the same option given twice with different values is a 400.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from .config import GatewayConfig
from .errors import bad_request

CFG_NORMS = ("none", "global", "channel", "cfg_zero_star")
OUTPUT_FORMATS = ("png", "jpeg", "webp")
RESPONSE_FORMATS = ("b64_json", "url")

# alias -> canonical option name
ALIASES = {
    "steps": "num_inference_steps",
    "cfg_scale": "guidance_scale",
    "img_cfg_scale": "image_guidance_scale",
    "flow_shift": "timestep_shift",
    "think_mode": "think",
}


@dataclass
class ImageJob:
    kind: str                      # "t2i" | "edit"
    prompt: str
    width: int
    height: int
    n: int
    num_inference_steps: int
    guidance_scale: float
    image_guidance_scale: float
    cfg_norm: str
    timestep_shift: float
    t_eps: float
    cfg_interval: tuple[float, float]
    seed: int
    output_format: str
    response_format: str
    think: bool
    max_think_tokens: int
    stream: bool
    images: list[str] = field(default_factory=list)   # base64 of the input images (edit)
    cache: Any = None              # step caching options, validated by the generation service

    def prefix_body(self, request_id: str) -> dict[str, Any]:
        return {"request_id": request_id, "kind": self.kind, "prompt": self.prompt,
                "images": self.images, "guidance_scale": self.guidance_scale,
                "image_guidance_scale": self.image_guidance_scale, "think": self.think,
                "max_think_tokens": self.max_think_tokens, "stream": True}

    def generate_body(self, request_id: str, handles: dict) -> dict[str, Any]:
        return {"request_id": request_id, "handles": handles, "mode": self.kind,
                "width": self.width, "height": self.height, "n": self.n,
                "num_inference_steps": self.num_inference_steps,
                "guidance_scale": self.guidance_scale,
                "image_guidance_scale": self.image_guidance_scale,
                "cfg_norm": self.cfg_norm, "timestep_shift": self.timestep_shift,
                "t_eps": self.t_eps, "cfg_interval": list(self.cfg_interval),
                "seed": self.seed, "output_format": self.output_format,
                **({"cache": self.cache} if self.cache is not None else {})}

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def merge_options(body: dict[str, Any]) -> dict[str, Any]:
    """Flatten top-level, `extra_body` and `extra_args` options into one dict of canonical names."""
    merged: dict[str, Any] = {}
    sources = [body]
    for nested in ("extra_body", "extra_args"):
        extra = body.get(nested)
        if extra is None:
            continue
        if not isinstance(extra, dict):
            raise bad_request(f"'{nested}' must be an object", param=nested, code="invalid_type")
        sources.append(extra)
    for src in sources:
        for key, value in src.items():
            if key in ("extra_body", "extra_args"):
                continue
            name = ALIASES.get(key, key)
            if name in merged and merged[name] != value:
                raise bad_request(f"option '{name}' given twice with different values", param=name)
            merged[name] = value
    return merged


class Options:
    """Typed getters over merged options; `form=True` coerces multipart strings."""

    def __init__(self, values: dict[str, Any], form: bool = False):
        self.values = values
        self.form = form

    def raw(self, name: str) -> Any:
        v = self.values.get(name)
        if self.form and isinstance(v, str) and v.strip() == "":
            return None
        return v

    def str_(self, name: str, default: str | None = None) -> str | None:
        v = self.raw(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string", param=name, code="invalid_type")
        return v

    def int_(self, name: str, default: int, lo: int, hi: int) -> int:
        v = self.raw(name)
        if v is None:
            return default
        if self.form and isinstance(v, str):
            try:
                v = int(v.strip())
            except ValueError:
                raise bad_request(f"'{name}' must be an integer", param=name, code="invalid_type")
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"'{name}' must be an integer", param=name, code="invalid_type")
        if not lo <= v <= hi:
            raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
        return v

    def float_(self, name: str, default: float, lo: float, hi: float) -> float:
        v = self.raw(name)
        if v is None:
            return default
        if self.form and isinstance(v, str):
            try:
                v = float(v.strip())
            except ValueError:
                raise bad_request(f"'{name}' must be a number", param=name, code="invalid_type")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad_request(f"'{name}' must be a number", param=name, code="invalid_type")
        if not lo <= v <= hi:
            raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
        return float(v)

    def bool_(self, name: str, default: bool) -> bool:
        v = self.raw(name)
        if v is None:
            return default
        if self.form and isinstance(v, str):
            low = v.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be a boolean", param=name, code="invalid_type")
        return v

    def choice(self, name: str, default: str, allowed: tuple[str, ...]) -> str:
        v = self.str_(name, default)
        v = v.strip().lower()
        if v == "jpg":
            v = "jpeg"
        if v not in allowed:
            raise bad_request(f"'{name}' must be one of {', '.join(allowed)}; got {v!r}", param=name)
        return v

    def interval(self, name: str) -> tuple[float, float]:
        v = self.raw(name)
        if v is None:
            return (0.0, 1.0)
        if self.form and isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise bad_request(f"'{name}' must be a [lo, hi] list", param=name, code="invalid_type")
        ok = (isinstance(v, (list, tuple)) and len(v) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v))
        if not ok or not 0.0 <= v[0] <= v[1] <= 1.0:
            raise bad_request(f"'{name}' must be [lo, hi] with 0 <= lo <= hi <= 1", param=name)
        return (float(v[0]), float(v[1]))


def check_size(cfg: GatewayConfig, w: int, h: int, param: str = "size") -> tuple[int, int]:
    ok = (w % 32 == 0 and h % 32 == 0 and cfg.min_side <= w <= cfg.max_side
          and cfg.min_side <= h <= cfg.max_side and w * h <= cfg.max_pixels)
    if not ok:
        raise bad_request(f"unsupported size {w}x{h}: {cfg.size_range_text()}", param=param,
                          code="invalid_size")
    return w, h


def size_for_aspect(cfg: GatewayConfig, aspect: float) -> tuple[int, int]:
    """The default area at a given width/height ratio, sides rounded to multiples of 32."""
    area = cfg.default_size[0] * cfg.default_size[1]
    w = math.sqrt(area * aspect)
    h = area / w

    def snap(x: float) -> int:
        return int(min(cfg.max_side, max(cfg.min_side, round(x / 32) * 32)))

    w32, h32 = snap(w), snap(h)
    while w32 * h32 > cfg.max_pixels and max(w32, h32) > cfg.min_side:
        if w32 >= h32:
            w32 -= 32
        else:
            h32 -= 32
    return w32, h32


def parse_aspect(text: str) -> float:
    try:
        a, b = text.replace("/", ":").split(":")
        ratio = float(a) / float(b)
    except (ValueError, ZeroDivisionError):
        raise bad_request(f"aspect_ratio must look like '16:9', got {text!r}", param="aspect_ratio")
    if not (1 / 16 <= ratio <= 16):
        raise bad_request("aspect_ratio must be between 1:16 and 16:1", param="aspect_ratio")
    return ratio


def resolve_size(cfg: GatewayConfig, opts: Options,
                 first_image_wh: tuple[int, int] | None = None) -> tuple[int, int]:
    """size 'WxH' | 'auto' | width+height | aspect_ratio; default follows the first input image."""
    size = opts.raw("size")
    width, height = opts.raw("width"), opts.raw("height")
    if size is not None and not isinstance(size, str):
        raise bad_request("'size' must be a string like '1024x1024'", param="size", code="invalid_type")
    if size and size.strip().lower() != "auto":
        try:
            w, h = [int(x) for x in size.lower().strip().split("x")]
        except ValueError:
            raise bad_request(f"'size' must look like 'WIDTHxHEIGHT', got {size!r}; "
                              f"{cfg.size_range_text()}", param="size", code="invalid_size")
        return check_size(cfg, w, h)
    if width is not None or height is not None:
        w = opts.int_("width", cfg.default_size[0], 1, 1 << 20)
        h = opts.int_("height", cfg.default_size[1], 1, 1 << 20)
        return check_size(cfg, w, h, param="width")
    aspect = opts.str_("aspect_ratio")
    if aspect:
        return size_for_aspect(cfg, parse_aspect(aspect))
    if first_image_wh is not None:
        return size_for_aspect(cfg, first_image_wh[0] / first_image_wh[1])
    return cfg.default_size


def build_job(cfg: GatewayConfig, opts: Options, kind: str, prompt: Any,
              images: list[str] | None = None,
              first_image_wh: tuple[int, int] | None = None) -> ImageJob:
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", param="prompt", code="invalid_type")
    if not prompt.strip():
        raise bad_request("'prompt' must not be empty", param="prompt")
    if len(prompt) > cfg.max_prompt_chars:
        raise bad_request(f"'prompt' is longer than {cfg.max_prompt_chars} characters",
                          param="prompt", code="prompt_too_long")
    width, height = resolve_size(cfg, opts, first_image_wh)
    seed = opts.raw("seed")
    return ImageJob(
        kind=kind,
        prompt=prompt,
        width=width,
        height=height,
        n=opts.int_("n", 1, 1, cfg.max_n),
        num_inference_steps=opts.int_("num_inference_steps", cfg.default_steps, 1, cfg.max_steps),
        guidance_scale=opts.float_("guidance_scale", cfg.default_guidance, 0.0, 30.0),
        image_guidance_scale=opts.float_("image_guidance_scale", cfg.default_image_guidance, 0.0, 30.0),
        cfg_norm=opts.choice("cfg_norm", "none", CFG_NORMS),
        timestep_shift=opts.float_("timestep_shift", cfg.default_timestep_shift, 0.01, 100.0),
        t_eps=opts.float_("t_eps", cfg.default_t_eps, 1e-6, 1.0),
        cfg_interval=opts.interval("cfg_interval"),
        seed=(opts.int_("seed", 0, 0, 2**63 - 1) if seed is not None
              else random.randrange(0, 2**31)),
        output_format=opts.choice("output_format", "png", OUTPUT_FORMATS),
        response_format=opts.choice("response_format", "b64_json", RESPONSE_FORMATS),
        think=opts.bool_("think", False),
        max_think_tokens=opts.int_("max_think_tokens", cfg.default_max_think_tokens, 1,
                                   cfg.max_think_tokens),
        stream=opts.bool_("stream", False),
        images=images or [],
        cache=opts.raw("cache"),
    )
