"""A validated image request as an ImageJob: the two internal bodies (PrefixRequest for understanding, the
GenerateRequest fields for generation) and how to answer the client. Everything is checked here, before any
work starts: the contract's models, then this server's tighter limits and the output size."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import ValidationError

from services.contract import limits as L
from services.contract.image import GenerateRequest, ImageOptions, PrefixRequest, SamplerParams
from services.kit.errors import APIError, bad_request

from .config import GatewayConfig, parse_size
from .routing import image_key


class GenerationTarget:
    """What the orchestrator asks of every job about its generation call (ImageJob, interleave.Segment; RL jobs in
    rl_jobs.py override both)."""

    def generate_path(self) -> str:
        """Generation's route for this job."""
        return "/internal/generate"

    def expected_images(self) -> int:
        """Image events generation owes this job."""
        return self.n


@dataclass(frozen=True)
class ImageJob(GenerationTarget):
    prefix: PrefixRequest
    generate: dict[str, Any]         # GenerateRequest fields but the handles (checked with placeholder handles)
    response_format: str
    stream: bool
    prefix_path: ClassVar[str] = "/internal/image_prefix"

    @property
    def request_id(self) -> str:
        return self.prefix.request_id

    width = property(lambda self: self.generate["width"])
    height = property(lambda self: self.generate["height"])
    n = property(lambda self: self.generate["n"])
    seed = property(lambda self: self.generate["seed"])
    output_format = property(lambda self: self.generate["output_format"])

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def prefix_body(self) -> dict[str, Any]:
        return self.prefix.model_dump(mode="json")

    @staticmethod
    def route_key(prefix_body: dict) -> int:
        """Which understanding replica's prefix cache to prefer: what the prompt starts with."""
        return image_key(prefix_body)

    def generate_body(self, handles: dict) -> dict[str, Any]:
        """The /internal/generate body with understanding's handles (which must match the CFG branches)."""
        return generate_body(self.generate, handles)



def _at_most(value: int | None, limit: int, param: str) -> None:
    if value is not None and value > limit:
        raise bad_request(f"{param}: at most {limit} on this server, got {value}", param=param)


def parse_aspect(text: str) -> float:
    try:
        a, b = text.replace("/", ":").split(":")
        ratio = float(a) / float(b)
    except (ValueError, ZeroDivisionError):
        raise bad_request(f"aspect_ratio must look like '16:9', got {text!r}", param="aspect_ratio") from None
    if not (math.isfinite(ratio) and 1 / 16 <= ratio <= 16):
        raise bad_request("aspect_ratio must be between 1:16 and 16:1", param="aspect_ratio")
    return ratio


def size_for_aspect(cfg: GatewayConfig, aspect: float) -> tuple[int, int]:
    """The default area at a given width/height ratio, sides rounded to multiples of the image block."""
    area = cfg.default_size[0] * cfg.default_size[1]
    w = math.sqrt(area * aspect)
    h = area / w
    block = L.IMAGE_BLOCK

    def snap(x: float) -> int:
        return int(min(cfg.max_side, max(cfg.min_side, round(x / block) * block)))

    w32, h32 = snap(w), snap(h)
    while w32 * h32 > cfg.max_pixels and max(w32, h32) > cfg.min_side:
        if w32 >= h32:
            w32 -= block
        else:
            h32 -= block
    return w32, h32


def _checked(cfg: GatewayConfig, w: int, h: int, param: str) -> tuple[int, int]:
    problem = cfg.size_problem(w, h)
    if problem:
        raise bad_request(f"unsupported size {w}x{h}: {problem}", param=param, code="invalid_size")
    return w, h


def resolve_size(cfg: GatewayConfig, opts: ImageOptions,
                 first_image_wh: tuple[int, int] | None = None) -> tuple[int, int]:
    """size 'WxH' | 'auto' | width+height | aspect_ratio; the default follows the first input image's aspect
    ratio at the default area, else the default size."""
    if opts.size and opts.size.strip().lower() != "auto":
        try:
            w, h = parse_size(opts.size)
        except ValueError:
            raise bad_request(f"size must be 'WIDTHxHEIGHT' or 'auto', got {opts.size!r}: "
                              f"{cfg.size_rule()}", param="size", code="invalid_size") from None
        return _checked(cfg, w, h, "size")
    if opts.width is not None or opts.height is not None:
        return _checked(cfg, opts.width or cfg.default_size[0], opts.height or cfg.default_size[1], "width")
    if opts.aspect_ratio:
        return size_for_aspect(cfg, parse_aspect(opts.aspect_ratio))
    if first_image_wh is not None:
        return size_for_aspect(cfg, first_image_wh[0] / first_image_wh[1])
    return cfg.default_size


def check_options(cfg: GatewayConfig, opts: ImageOptions, mode: str, prompt: str,
                  prompt_param: str = "prompt") -> SamplerParams:
    """Everything about a request but its input images: this server's limits, an explicit size, and the
    sampler parameters over the server's defaults. A 400 naming the field for anything this server does not
    make (a pydantic ValidationError raised here is the client's too: the exception handler makes it a 400).
    `prompt_param`: where the prompt stands in the request (an RL request has several)."""
    if len(prompt) > cfg.max_prompt_chars:
        raise bad_request(f"{prompt_param}: at most {cfg.max_prompt_chars} characters on this server",
                          param=prompt_param, code="prompt_too_long")
    _at_most(opts.num_inference_steps, cfg.max_steps, "num_inference_steps")
    _at_most(opts.max_think_tokens, cfg.max_think_tokens, "max_think_tokens")
    resolve_size(cfg, opts)
    return opts.sampler(mode, cfg.sampler)


def check_step_pixels(cfg: GatewayConfig, sampler: SamplerParams, n: int, width: int, height: int,
                      param: str = "n") -> None:
    """One denoise step of a request holds n x branches x its image's tokens as rows (every image of the request
    and each CFG branch in one forward): on a card whose memory plan counts fewer (--max-step-pixels), a 400
    before any work rather than an out-of-memory step."""
    branches = len(sampler.branches())
    need = n * branches * width * height
    if cfg.max_step_pixels and need > cfg.max_step_pixels:
        fit = cfg.max_step_pixels // (branches * width * height)
        hint = f"n <= {fit}" if fit >= 1 else "a smaller size"
        raise bad_request(f"{n} image(s) of {width}x{height} with {branches} guidance branch(es) take "
                          f"{need} pixels in one denoise step; this server's memory plan allows {cfg.max_step_pixels} "
                          f"(--max-step-pixels): ask {hint}, or guidance_scale 1", param=param,
                          code="request_too_large")


def generate_fields(cfg: GatewayConfig, opts: ImageOptions, *, mode: str, prompt: str,
                    first_image_wh: tuple[int, int] | None = None, checked: SamplerParams | None = None,
                    **extra: Any) -> dict[str, Any]:
    """The GenerateRequest fields of a validated request but request_id and handles: the one declaration of
    how an image's generation body is made (image jobs and each image of an interleaved answer). The sampler
    parameters over the server's defaults, the size, the seed (random when absent), the output, the step cache
    (only the fields the client set: generation fills in its own defaults). Checked now with placeholder handles
    (one per CFG branch) and `extra` (fields the caller adds per image), not after the prefix work. `checked`:
    what check_options already answered for these options (a route checks them before decoding input images)."""
    sampler = checked if checked is not None else check_options(cfg, opts, mode, prompt)
    width, height = resolve_size(cfg, opts, first_image_wh)
    check_step_pixels(cfg, sampler, opts.n, width, height)
    fields = {**sampler.model_dump(), "width": width, "height": height, "n": opts.n,
              "seed": opts.seed if opts.seed is not None else random.randrange(0, 2**31),
              "output_format": opts.output_format, "partial_images": opts.partial_images}
    if opts.cache is not None:
        fields["cache"] = opts.cache.model_dump(exclude_unset=True)
    GenerateRequest(**{"request_id": "check", **fields, **extra}, handles={b: {} for b in sampler.branches()})
    return fields


def generate_body(fields: dict[str, Any], handles: dict, model: type[GenerateRequest] = GenerateRequest,
                  **extra: Any) -> dict[str, Any]:
    """The /internal/generate body (or an RL job's: `model`): `fields` (generate_fields) with understanding's
    handles, which must match the CFG branches (else a 502: understanding broke the protocol)."""
    try:
        body = model(**fields, **extra, handles=handles).model_dump(mode="json")
    except ValidationError as exc:
        raise APIError(502, f"understanding service sent handles that do not fit the job: "
                       f"{exc.errors()[0]['msg']}", code="upstream_protocol_error") from None
    if "cache" in fields:      # as the client set it, not the model's defaults (generation has its own)
        body["cache"] = fields["cache"]
    else:
        body.pop("cache", None)
    return body


def build_job(cfg: GatewayConfig, opts: ImageOptions, *, mode: str, prompt: str, request_id: str,
              images: list[str] | None = None, first_image_wh: tuple[int, int] | None = None,
              cache_salt: str | None = None, lora: str | None = None,
              image_offsets: list[int] | None = None, checked: SamplerParams | None = None) -> ImageJob:
    """The job of a validated request (see check_options for what is refused; `checked`: its answer, when the
    route asked it already); `image_offsets`: where each image stands in the prompt (a chat request's part
    order; none: images first)."""
    generate = {**generate_fields(cfg, opts, mode=mode, prompt=prompt, first_image_wh=first_image_wh,
                                  checked=checked), "request_id": request_id}
    prefix = PrefixRequest(request_id=request_id, mode=mode, prompt=prompt, images=images or [],
                           image_offsets=image_offsets,
                           guidance_scale=generate["guidance_scale"],
                           image_guidance_scale=generate["image_guidance_scale"], think=opts.think,
                           max_think_tokens=opts.max_think_tokens or cfg.default_think_tokens, stream=True,
                           cache_salt=cache_salt, lora=lora)
    if lora is not None:         # the adapter (routers/lora.py) on both engines
        generate["lora"] = lora
    return ImageJob(prefix, generate, opts.response_format, opts.stream)
