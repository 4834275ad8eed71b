"""Parse and validate one `/internal/generate` body into a `GenerateJob`.

Validation happens in the HTTP process, before the stream starts, so bad input gets a plain 4xx JSON
answer (OpenAI error shape) and never reaches the engine.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

BRANCH_ORDER = ("cond", "uncond", "img_cond")
CFG_NORMS = ("none", "global", "channel", "cfg_zero_star")
OUTPUT_FORMATS = ("png", "jpeg", "webp")
MAX_SIDE = 8192          # pixels; 16384 tokens at 4096^2 is the trained maximum
MAX_STEPS = 1000
MAX_IMAGES = 4


class ApiError(Exception):
    """An error that maps onto an HTTP status and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def to_event(self) -> dict:
        return {"type": "error", "status": self.status, **self.body()}


def error_event(status: int, message: str, code: str | None = None,
                type: str | None = None) -> dict:
    if type is None:
        type = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=type, code=code).to_event()


@dataclass
class GenerateJob:
    """Everything the engine needs for one request (plain data: it crosses process boundaries)."""
    request_id: str
    handles: dict[str, dict]          # branch -> KVHandle dict, in BRANCH_ORDER
    mode: str
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
    cache: dict | None = None         # step caching (services/model/step_cache.CacheOptions fields)
    partial_images: int = 0           # previews (previews.py)
    noise_draw: int = 0               # which draw of the seeded generator the noise is
    export_image: bool = False        # the float result into the KV pool (float_image.py)

    @property
    def num_tokens(self) -> int:
        """Image tokens per image (32 px per token side)."""
        return (self.width // 32) * (self.height // 32)

    @property
    def branches(self) -> list[str]:
        return [b for b in BRANCH_ORDER if b in self.handles]

    @property
    def batch_tokens(self) -> int:
        """Rows this job adds to every forward when all its branches run on one rank."""
        return self.num_tokens * self.n * len(self.handles)


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{key}' must be a number", key, "invalid_type")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise _bad(f"'{key}' must be an integer", key, "invalid_type")
        value = int(value)
    else:
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise _bad(f"'{key}' must be finite", key)
    if lo is not None and value < lo:
        raise _bad(f"'{key}' must be >= {lo} (got {value})", key)
    if hi is not None and value > hi:
        raise _bad(f"'{key}' must be <= {hi} (got {value})", key)
    return value


def parse_generate(body: Any, fingerprint: str | None = None, cache_defaults=None) -> GenerateJob:
    """Validate a request body. `fingerprint` (the loaded model's) rejects foreign handles early;
    `cache_defaults` (a step_cache.CacheOptions) are the server's step-caching defaults."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
        raise _bad("'request_id' must be a non-empty string (<= 256 chars)", "request_id",
                   "invalid_type")

    mode = body.get("mode", "t2i")
    if mode not in ("t2i", "edit"):
        raise _bad("'mode' must be 't2i' or 'edit'", "mode")

    handles = body.get("handles")
    if not isinstance(handles, dict) or "cond" not in handles:
        raise _bad("'handles' must be an object with at least a 'cond' handle", "handles")
    unknown = set(handles) - set(BRANCH_ORDER)
    if unknown:
        raise _bad(f"unknown handle branch(es): {sorted(unknown)}", "handles")
    for branch, h in handles.items():
        if not isinstance(h, dict):
            raise _bad(f"handle '{branch}' must be a KVHandle object", f"handles.{branch}")
        if fingerprint is not None and h.get("model_fingerprint", fingerprint) != fingerprint:
            raise ApiError(400, f"handle '{branch}' was produced by a different model "
                           f"(fingerprint {h.get('model_fingerprint')!r}, this service serves "
                           f"{fingerprint!r})", param=f"handles.{branch}",
                           code="kv_fingerprint_mismatch")
    if mode == "t2i" and "img_cond" in handles:
        raise _bad("'img_cond' handle is only valid for mode 'edit'", "handles")

    width = _number(body, "width", 1024, int, 32, MAX_SIDE)
    height = _number(body, "height", 1024, int, 32, MAX_SIDE)
    for key, v in (("width", width), ("height", height)):
        if v % 32:
            raise _bad(f"'{key}' must be a multiple of 32 (got {v})", key)
    n = _number(body, "n", 1, int, 1, MAX_IMAGES)
    steps = _number(body, "num_inference_steps", 50, int, 1, MAX_STEPS)
    guidance_scale = _number(body, "guidance_scale", 4.0, float, 0.0, 100.0)
    image_guidance_scale = _number(body, "image_guidance_scale", 1.0, float, 0.0, 100.0)
    shift = _number(body, "timestep_shift", 3.0, float, 1e-3, 100.0)
    t_eps = _number(body, "t_eps", 0.02, float, 1e-6, 1.0)

    cfg_norm = body.get("cfg_norm", "none") or "none"
    if cfg_norm not in CFG_NORMS:
        raise _bad(f"'cfg_norm' must be one of {list(CFG_NORMS)}", "cfg_norm")
    if cfg_norm == "cfg_zero_star" and mode != "t2i":
        raise _bad("'cfg_zero_star' is only defined for text-to-image", "cfg_norm")

    interval = body.get("cfg_interval", [0.0, 1.0])
    if interval is None:
        interval = [0.0, 1.0]
    if (not isinstance(interval, (list, tuple)) or len(interval) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in interval)
            or not 0.0 <= interval[0] <= interval[1] <= 1.0):
        raise _bad("'cfg_interval' must be [lo, hi] with 0 <= lo <= hi <= 1", "cfg_interval")

    seed = body.get("seed")
    if seed is None:
        seed = random.randrange(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
        raise _bad("'seed' must be an integer in [0, 2^63)", "seed", "invalid_type")

    fmt = (body.get("output_format") or "png").lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in OUTPUT_FORMATS:
        raise _bad(f"'output_format' must be one of {list(OUTPUT_FORMATS)}", "output_format")

    from services.contract.image import CacheOptions, check_cache_for
    try:
        given = body.get("cache")
        defaults = cache_defaults or CacheOptions()
        cache = CacheOptions.model_validate(given).over(defaults) if given is not None else defaults
        check_cache_for(mode, (float(interval[0]), float(interval[1])), cache)
    except ValueError as e:
        raise _bad(f"cache: {e}", "cache") from None

    partial_images = _number(body, "partial_images", 0, int, 0, 3)
    noise_draw = _number(body, "noise_draw", 0, int, 0, 16)
    export_image = body.get("export_image", False)
    if not isinstance(export_image, bool) or (export_image and n != 1):
        raise _bad("'export_image' is a boolean and takes n = 1", "export_image")

    ordered = {b: handles[b] for b in BRANCH_ORDER if b in handles}
    return GenerateJob(request_id=request_id, handles=ordered, mode=mode, width=width,
                       height=height, n=n, num_inference_steps=steps, guidance_scale=guidance_scale,
                       image_guidance_scale=image_guidance_scale, cfg_norm=cfg_norm, timestep_shift=shift,
                       t_eps=t_eps, cfg_interval=(float(interval[0]), float(interval[1])),
                       seed=seed, output_format=fmt, cache=cache.model_dump(), partial_images=partial_images,
                       noise_draw=noise_draw, export_image=export_image)
