"""Image requests: the denoiser's parameters (SamplerParams), the public request fields, and the two internal
bodies the gateway builds from them (PrefixRequest -> understanding, GenerateRequest -> generation).

One name per parameter from the API to the sampler; each field's type, range and default is declared here once.
The gateway validates a request completely before any work starts; the engines validate the same models again
(cheap) and otherwise check only invariants (handles, fingerprints, pool geometry).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from . import limits as L
from .types import INTERNAL, PUBLIC, CacheSalt, Float, Int

ImageSide = Annotated[Int, Field(ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)]   # pixels

CfgNorm = Literal["none", "global", "channel", "cfg_zero_star"]
OutputFormat = Literal["png", "jpeg", "webp"]
ResponseFormat = Literal["b64_json", "url"]
Branch = Literal["cond", "uncond", "img_cond"]
Mode = Literal["t2i", "edit"]
BRANCH_ORDER: tuple[str, ...] = ("cond", "uncond", "img_cond")

# Accepted spellings of the canonical names (other APIs and the official code use them).
ALIASES = {"steps": "num_inference_steps", "cfg_scale": "guidance_scale", "img_cfg_scale": "image_guidance_scale",
           "flow_shift": "timestep_shift", "think_mode": "think"}



# the LoRA adapter of an engine request (docs/lora.md): the name the request's `model` picked; None: base weights
LORA_FIELD = Field(None, min_length=1, max_length=L.MAX_LORA_NAME_CHARS,
                   description="LoRA adapter name (GET /v1/models lists them); None: the base weights")

class Guidance(BaseModel):
    """What decides the CFG branches (and so which prefixes understanding computes)."""
    model_config = INTERNAL
    mode: Mode = "t2i"
    guidance_scale: Float = Field(4.0, ge=0.0, le=L.MAX_GUIDANCE, description="text CFG scale (1 = no CFG)")
    image_guidance_scale: Float = Field(1.0, ge=0.0, le=L.MAX_GUIDANCE,
                                        description="image CFG scale for edits (1 = off)")

    def branches(self) -> list[str]:
        """The CFG prefixes this request needs, cond first (the official 1/2/3-branch rule)."""
        if self.mode == "t2i":
            return ["cond", "uncond"] if self.guidance_scale > 1 else ["cond"]
        g, gi = self.guidance_scale, self.image_guidance_scale
        if g == 1 and gi == 1:
            return ["cond"]
        if gi == 1:
            return ["cond", "img_cond"]
        if g == gi:
            return ["cond", "uncond"]
        return ["cond", "img_cond", "uncond"]


class SamplerParams(Guidance):
    """The denoiser's parameters under their API names; services.model.sampler reads exactly these."""
    num_inference_steps: Int = Field(50, ge=1, le=L.MAX_STEPS)
    cfg_norm: CfgNorm = Field("none", description="CFG renormalisation; cfg_zero_star only for text-to-image")
    timestep_shift: Float = Field(3.0, ge=0.01, le=100.0)
    t_eps: Float = Field(0.02, ge=1e-6, le=1.0)
    cfg_interval: tuple[Float, Float] = Field((0.0, 1.0), description="[lo, hi] of t where CFG applies")

    @field_validator("cfg_norm")
    @classmethod
    def _norm_for_mode(cls, v: str, info: ValidationInfo) -> str:
        if v == "cfg_zero_star" and info.data.get("mode") == "edit":
            raise ValueError("cfg_zero_star is only defined for text-to-image, not for edits")
        return v

    @field_validator("cfg_interval")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] <= v[1] <= 1.0:
            raise ValueError("cfg_interval must be [lo, hi] with 0 <= lo <= hi <= 1")
        return v


SAMPLER_FIELDS = tuple(SamplerParams.model_fields)

CacheMode = Literal["off", "first_block", "teacache"]


class CacheOptions(BaseModel):
    """Step caching of the denoiser (services/model/step_cache.py), per CFG branch: `first_block` skips layers
    1.. and reuses their residual while the first block's output changes less than `threshold`; `teacache`
    skips every layer while the calibrated change of the stack's input, accumulated since the last computed
    step, stays below `threshold`. `cfg_truncation` ends CFG early (only the cond branch runs while
    t > value). Threshold 0 reproduces the exact output."""
    model_config = INTERNAL
    mode: CacheMode = "off"
    threshold: Float = Field(0.0, ge=0.0, le=10.0,
                             description="first_block: relative L1 change of the first block's residual; "
                                         "teacache: the accumulated, rescaled relative L1 change of the input")
    warmup_steps: Int = Field(1, ge=0, le=L.MAX_STEPS, description="steps always computed at the start")
    max_consecutive: Int = Field(0, ge=0, le=L.MAX_STEPS, description="reused steps in a row (0: no limit)")
    cfg_truncation: Optional[Float] = Field(None, ge=0.0, le=1.0, description="CFG only while t <= value")

    def over(self, defaults: "CacheOptions") -> "CacheOptions":
        """The fields this request set, over the server's defaults."""
        return defaults.model_copy(update=self.model_dump(exclude_unset=True))

    @property
    def reuses(self) -> bool:
        return self.mode != "off" and self.threshold > 0


def check_cache_for(mode: str, cfg_interval: tuple[float, float], cache: Optional[CacheOptions]) -> None:
    """A combination the denoiser cannot honour (ValueError). Evaluated once per hop: by the gateway on the
    client's options (ImageOptions.sampler), by generation on the job with its own defaults filled in
    (generation/inputs.parse_job); GenerateRequest itself does not repeat it."""
    if cache is not None and cache.cfg_truncation is not None and mode == "edit" and cfg_interval[0] == 0:
        raise ValueError("cache.cfg_truncation lowers cfg_interval's upper bound, which editing ignores while "
                         "the lower bound is 0")


def default(field: str) -> Any:
    """A field's declared default (the model's own defaults, e.g. for server-side defaults)."""
    for model in (SamplerParams, PrefixRequest, ImageOptions):
        if field in model.model_fields:
            return model.model_fields[field].get_default(call_default_factory=True)
    raise KeyError(field)


def merge_options(body: Any) -> Any:
    """Flatten top-level, `extra_body` and `extra_args` options into canonical names; the same option given
    twice with different values is an error (a ValueError whose `ctx["param"]` names the option)."""
    if not isinstance(body, dict):
        return body
    merged: dict[str, Any] = {}
    sources = [body]
    for nested in ("extra_body", "extra_args"):
        extra = body.get(nested)
        if extra is None:
            continue
        if not isinstance(extra, dict):
            raise PydanticCustomError("invalid_type", "'{param}' must be an object", {"param": nested})
        sources.append(extra)
    for src in sources:
        for key, value in src.items():
            if key in ("extra_body", "extra_args"):
                continue
            name = ALIASES.get(key, key)
            if name in merged and merged[name] != value:
                raise PydanticCustomError("duplicate_option", "option '{param}' given twice with different values",
                                          {"param": name})
            merged[name] = value
    return merged


class ImageOptions(BaseModel):
    """Image fields a client may set (images API, or `image_config` of a chat request). None = server default."""
    model_config = PUBLIC
    n: Int = Field(1, ge=1, le=L.MAX_IMAGES_PER_REQUEST, description="images from one noise draw")
    size: Optional[str] = Field(None, description="'WxH' (multiples of 32) or 'auto'")
    width: Optional[Int] = Field(None, ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)
    height: Optional[Int] = Field(None, ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)
    aspect_ratio: Optional[str] = Field(None, description="e.g. '16:9' at the default area")
    num_inference_steps: Optional[Int] = Field(None, ge=1, le=L.MAX_STEPS)
    guidance_scale: Optional[Float] = Field(None, ge=0.0, le=L.MAX_GUIDANCE)
    image_guidance_scale: Optional[Float] = Field(None, ge=0.0, le=L.MAX_GUIDANCE)
    cfg_norm: Optional[CfgNorm] = None
    timestep_shift: Optional[Float] = Field(None, ge=0.01, le=100.0)
    t_eps: Optional[Float] = Field(None, ge=1e-6, le=1.0)
    cfg_interval: Optional[tuple[Float, Float]] = None
    seed: Optional[Int] = Field(None, ge=0, le=L.SEED_MAX, description="random when absent")
    output_format: OutputFormat = "png"
    response_format: ResponseFormat = "b64_json"
    think: bool = Field(False, description="reason before drawing (think text comes back as revised_prompt)")
    max_think_tokens: Optional[Int] = Field(None, ge=1, le=L.MAX_THINK_TOKENS)
    stream: bool = False
    partial_images: Int = Field(0, ge=0, le=L.MAX_PARTIAL_IMAGES,
                                description="previews streamed while denoising (x0 estimates at evenly spaced steps)")
    cache: Optional[CacheOptions] = Field(None, description="step caching (None: the server's defaults)")

    @model_validator(mode="before")
    @classmethod
    def _flatten(cls, data: Any) -> Any:
        data = merge_options(data)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v.strip() == "" and k != "prompt")}
            fmt = data.get("output_format")
            if isinstance(fmt, str):
                fmt = fmt.strip().lower()
                data["output_format"] = "jpeg" if fmt == "jpg" else fmt
            iv = data.get("cfg_interval")
            if isinstance(iv, str):        # multipart forms send it as JSON text
                try:
                    data["cfg_interval"] = json.loads(iv)
                except ValueError:
                    pass
        return data

    def sampler(self, mode: str, defaults: SamplerParams) -> SamplerParams:
        """The request's SamplerParams: given fields over the server's defaults (validated as a whole)."""
        given = {k: getattr(self, k) for k in SAMPLER_FIELDS if k != "mode" and getattr(self, k, None) is not None}
        params = SamplerParams(**{**defaults.model_dump(exclude={"mode"}), **given, "mode": mode})
        check_cache_for(mode, params.cfg_interval, self.cache)
        return params


class ImageGenerationRequest(ImageOptions):
    """POST /v1/images/generations (OpenAI fields + u1serve extensions, at the top level or under extra_body)."""
    prompt: str = Field(min_length=1, max_length=L.MAX_PROMPT_CHARS)
    model: Optional[str] = None
    cache_salt: CacheSalt = None

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        return not_blank(v)


def not_blank(prompt: str) -> str:
    """A prompt's check (image and RL requests)."""
    if not prompt.strip():
        raise ValueError("prompt must not be empty")
    return prompt


class ImageEditRequest(ImageGenerationRequest):
    """POST /v1/images/edits: the fields of a generation plus 1..4 input images (multipart files or data URLs)."""
    image: list[str] = Field(default_factory=list, max_length=L.MAX_IMAGES_PER_REQUEST,
                             description="data URLs or base64 (JSON); files under image / image[] (multipart)")

    @model_validator(mode="before")
    @classmethod
    def _one_or_many(cls, data: Any) -> Any:
        """`image` or `image[]` (the SDK's multipart name), one string or a list."""
        if isinstance(data, dict) and ("image[]" in data or isinstance(data.get("image"), str)):
            data = dict(data)
            if "image[]" in data:
                if "image" in data:
                    raise PydanticCustomError("duplicate_option", "send the images as 'image' or 'image[]', "
                                              "not both", {"param": "image"})
                data["image"] = data.pop("image[]")
            if isinstance(data["image"], str):
                data["image"] = [data["image"]]
        return data


class PrefixRequest(Guidance):
    """Gateway -> understanding POST /internal/image_prefix: compute each CFG branch's prefix KV."""
    request_id: str = Field(min_length=1, max_length=L.MAX_REQUEST_ID_CHARS)
    prompt: str = Field(max_length=L.MAX_PROMPT_CHARS)
    images: list[str] = Field(default_factory=list, max_length=L.MAX_IMAGES_PER_REQUEST)
    image_offsets: Optional[list[Int]] = Field(
        None, description="where each image stands in `prompt` (character offsets, in order: the content parts' "
                          "order of a chat request); none, or all 0: the official placement, images first")
    think: bool = False
    max_think_tokens: Int = Field(L.DEFAULT_THINK_TOKENS, ge=1, le=L.MAX_THINK_TOKENS)
    stream: bool = False
    cache_salt: CacheSalt = None
    lora: Optional[str] = LORA_FIELD
    # RL (docs/rl.md): sample the think block instead of greedy decoding, returning each token's log-prob under
    # the processed distribution; or re-prefill an exact think block (scoring)
    think_temperature: Optional[Float] = Field(None, ge=L.GREEDY_TEMPERATURE, le=L.MAX_TEMPERATURE,
                                               description="sample the think text (None: greedy)")
    think_top_p: Float = Field(1.0, gt=0.0, le=1.0)
    think_seed: Optional[Int] = Field(None, ge=0, le=L.SEED_MAX)
    think_token_ids: Optional[list[Int]] = Field(None, max_length=L.MAX_THINK_TOKENS,
                                                 description="prefill this think block as is (no decoding)")

    @model_validator(mode="after")
    def _images_for_mode(self) -> "PrefixRequest":
        if self.mode == "edit" and not self.images:
            raise ValueError(f"an edit takes 1 to {L.MAX_IMAGES_PER_REQUEST} images")
        if self.mode == "t2i" and self.images:
            raise ValueError("text-to-image takes no images")
        if self.think_token_ids is not None and not self.think:
            raise ValueError("think_token_ids needs think")
        offsets = self.image_offsets
        if offsets is not None and (len(offsets) != len(self.images) or sorted(offsets) != offsets
                                    or any(not 0 <= o <= len(self.prompt) for o in offsets)):
            raise ValueError("image_offsets: one character offset into the prompt per image, in order")
        return self


class GenerateRequest(SamplerParams):
    """Gateway -> generation POST /internal/generate: denoise from the prefix handles."""
    request_id: str = Field(min_length=1, max_length=L.MAX_REQUEST_ID_CHARS)
    handles: dict[Branch, dict] = Field(description="KVHandle dicts, one per CFG branch")
    width: Int = Field(ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)
    height: Int = Field(ge=L.MIN_IMAGE_SIDE, le=L.MAX_IMAGE_SIDE)
    n: Int = Field(1, ge=1, le=L.MAX_IMAGES_PER_REQUEST)
    seed: Int = Field(ge=0, le=L.SEED_MAX)
    output_format: OutputFormat = "png"
    cache: Optional[CacheOptions] = Field(None, description="step caching (None: the server's defaults)")
    partial_images: Int = Field(0, ge=0, le=L.MAX_PARTIAL_IMAGES,
                                description="`partial_image` events: the x0 estimate at evenly spaced steps")
    noise_draws: list[tuple[ImageSide, ImageSide]] = Field(
        default_factory=list, max_length=L.MAX_INTERLEAVE_IMAGES,
        description="(width, height) of each draw taken from the seeded generator before this noise: an "
                    "interleaved answer's image k follows the draws of images 0..k-1, each at its own size")
    export_image: bool = Field(False, description="also write the final float image into the KV pool and return "
                                                  "its handle (`image_handle`): an interleaved answer reads it back")
    lora: Optional[str] = LORA_FIELD

    @field_validator("width", "height")
    @classmethod
    def _block_multiple(cls, v: int, info: ValidationInfo) -> int:
        if v % L.IMAGE_BLOCK:
            raise ValueError(f"{info.field_name} must be a multiple of {L.IMAGE_BLOCK}")
        return v

    @model_validator(mode="after")
    def _handles_match_branches(self) -> "GenerateRequest":
        need = self.branches()
        if set(self.handles) != set(need):
            raise ValueError(f"these sampling parameters need handles {sorted(need)}, got {sorted(self.handles)}")
        self.handles = {b: self.handles[b] for b in BRANCH_ORDER if b in self.handles}
        if self.export_image and self.n != 1:
            raise ValueError("export_image takes n = 1")
        return self

    def sampler(self) -> SamplerParams:
        return SamplerParams(**{k: getattr(self, k) for k in SAMPLER_FIELDS})

    @property
    def num_tokens(self) -> int:
        """Image tokens of one image."""
        return (self.width // L.IMAGE_BLOCK) * (self.height // L.IMAGE_BLOCK)
