"""RL requests (docs/rl.md, issue 24): the public rollout / score bodies, their responses, and the internal bodies
the gateway sends to generation (a rollout job, a score job). Names are fixed by the RL API agreed between the
serving, weights and training work; the weights models live in the block at the end of this file.

Flow convention, SDE kinds and the log-prob reduction: services/model/flow_sde.py (the one implementation).
"""
from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from . import limits as L
from .image import CfgNorm, GenerateRequest, ImageOptions, OutputFormat, default, not_blank
from .types import INTERNAL, PUBLIC, Float, Int

MAX_RL_PROMPTS = 64
MAX_GROUP_SIZE = 64
MAX_RL_SAMPLES = 256               # prompts x group_size of one rollout
MAX_TRAJECTORY_ID_CHARS = 128
MAX_TRAJECTORY_UPLOAD_BYTES = 64 << 20     # an uploaded trajectory generation stores for a score
# the public score body: that upload as base64, plus the rest of the request (prompts, think tokens)
MAX_SCORE_BODY_BYTES = 4 * -(-MAX_TRAJECTORY_UPLOAD_BYTES // 3) + (4 << 20)
DEFAULT_WEIGHTS_VERSION = "0"      # the version a stack starts with (rl-weights' updates move it)
SdeKind = Literal["flow", "dance", "cps"]
WeightsChoice = Literal["current", "reference"]
_SIZE = re.compile(r"\s*([0-9]{2,5})\s*[xX]\s*([0-9]{2,5})\s*")
_TRAJ_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
# Who owns a stored trajectory (issue 37): the gateway's hash of the tenant's key (never the key), in the job
# bodies (`owner`) and as this header on the trajectory routes; OPEN_OWNER on a keyless gateway.
OWNER_HEADER = "x-u1-owner"
OPEN_OWNER = "open"
OWNER_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (W, H), both multiples of 32 within the image limits (ValueError otherwise)."""
    m = _SIZE.fullmatch(text or "")
    if not m:
        raise ValueError(f"size must look like 'WIDTHxHEIGHT', got {text!r}")
    w, h = int(m.group(1)), int(m.group(2))
    for side in (w, h):
        if side % L.IMAGE_BLOCK or not L.MIN_IMAGE_SIDE <= side <= L.MAX_IMAGE_SIDE:
            raise ValueError(f"size {w}x{h}: each side must be a multiple of {L.IMAGE_BLOCK} in "
                             f"[{L.MIN_IMAGE_SIDE}, {L.MAX_IMAGE_SIDE}]")
    return w, h


class SdeWindow(BaseModel):
    """MixGRPO's window: SDE on steps [start, start + size) (clipped before the last step), ODE elsewhere."""
    model_config = PUBLIC
    start: Int = Field(ge=0, le=L.MAX_STEPS)
    size: Int = Field(ge=1, le=L.MAX_STEPS)


class SdeOptions(BaseModel):
    """Which stochastic transition (services/model/flow_sde.py) and on which steps."""
    model_config = PUBLIC
    kind: SdeKind = Field("flow", description="flow: Flow-GRPO (marginal-preserving, g = a*sqrt((1-t)/t)); "
                                              "dance: DanceGRPO (constant eta = a); cps: coefficient-preserving")
    noise_level: Float = Field(0.7, ge=0.0, le=10.0, description="a (eta for dance)")
    window: Optional[SdeWindow] = Field(None, description="MixGRPO: SDE only inside [start, start+size)")
    steps: Optional[list[Int]] = Field(None, max_length=L.MAX_STEPS,
                                       description="explicit SDE step indices (default: every step but the last)")

    @model_validator(mode="after")
    def _one_selector(self) -> "SdeOptions":
        if self.window is not None and self.steps is not None:
            raise ValueError("give sde.window or sde.steps, not both")
        return self

    def window_tuple(self) -> Optional[tuple[int, int]]:
        return None if self.window is None else (self.window.start, self.window.size)


class ThinkOptions(BaseModel):
    """Sampled think text (MixGRPO): token log-probs come from the processed distribution (after temperature and
    top-p), i.e. the distribution the token was drawn from."""
    model_config = PUBLIC
    enabled: bool = False
    temperature: Float = Field(1.0, ge=L.GREEDY_TEMPERATURE, le=L.MAX_TEMPERATURE)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: Int = Field(256, ge=1, le=L.MAX_THINK_TOKENS)


class RLPrompt(BaseModel):
    model_config = PUBLIC
    prompt: str = Field(min_length=1, max_length=L.MAX_PROMPT_CHARS)
    images: list[str] = Field(default_factory=list, max_length=L.MAX_IMAGES_PER_REQUEST,
                              description="data URLs / base64 of input images (an edit)")
    think: Optional[bool] = Field(None, description="override `think.enabled` for this prompt")

    _not_blank = field_validator("prompt")(classmethod(lambda cls, v: not_blank(v)))


class RLSampling(BaseModel):
    """The sampling fields rollout and score share (score must repeat the rollout's to reproduce its log-probs)."""
    model_config = PUBLIC
    model: Optional[str] = None
    prompts: list[RLPrompt] = Field(min_length=1, max_length=MAX_RL_PROMPTS)
    group_size: Int = Field(1, ge=1, le=MAX_GROUP_SIZE, description="G samples per prompt")
    size: str = Field("512x512", description="'WxH', multiples of 32")
    num_inference_steps: Int = Field(10, ge=1, le=L.MAX_STEPS)
    guidance_scale: Float = Field(4.0, ge=0.0, le=L.MAX_GUIDANCE)
    image_guidance_scale: Float = Field(1.0, ge=0.0, le=L.MAX_GUIDANCE)
    timestep_shift: Float = Field(3.0, ge=0.01, le=100.0)
    t_eps: Float = Field(0.02, ge=1e-6, le=1.0)
    cfg_norm: CfgNorm = "none"
    sde: SdeOptions = Field(default_factory=SdeOptions)
    think: Optional[ThinkOptions] = None

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        w, h = parse_size(v)
        return f"{w}x{h}"

    @model_validator(mode="after")
    def _bounds(self) -> "RLSampling":
        if len(self.prompts) * self.group_size > MAX_RL_SAMPLES:
            raise ValueError(f"prompts x group_size must be <= {MAX_RL_SAMPLES}")
        if self.cfg_norm == "cfg_zero_star" and any(p.images for p in self.prompts):
            raise ValueError("cfg_zero_star is only defined for text-to-image, not for edits")
        steps = self.sde.steps or []
        if any(not 0 <= k < self.num_inference_steps for k in steps):
            raise ValueError(f"sde.steps must lie in [0, {self.num_inference_steps})")
        if self.sde.window is not None and self.sde.window.start >= max(self.num_inference_steps - 1, 0):
            raise ValueError("sde.window.start must be before the last step")
        return self

    @property
    def width_height(self) -> tuple[int, int]:
        return parse_size(self.size)

    def image_options(self) -> ImageOptions:
        """The sampling fields as the images API's options (so the gateway checks them as it checks an image
        request's); the CFG interval, which RL does not expose, is the sampler's default."""
        return ImageOptions(size=self.size, num_inference_steps=self.num_inference_steps,
                            guidance_scale=self.guidance_scale, image_guidance_scale=self.image_guidance_scale,
                            timestep_shift=self.timestep_shift, t_eps=self.t_eps, cfg_norm=self.cfg_norm,
                            cfg_interval=default("cfg_interval"))

    def thinks(self, p: int) -> bool:
        """Whether prompt p samples think text."""
        own = self.prompts[p].think
        return bool(own if own is not None else (self.think is not None and self.think.enabled))


class RolloutRequest(RLSampling):
    """POST /v1/rl/rollout."""
    seed: Optional[Int] = Field(None, ge=0, le=L.SEED_MAX,
                                description="sample i of prompt p gets seed + p*G + i (random when absent)")
    seeds: Optional[list[list[Int]]] = Field(None, description="explicit seeds [P][G]")
    same_initial_noise: bool = Field(False, description="DanceGRPO: one initial noise per group (sample 0's seed)")
    return_trajectory: bool = Field(True, description="store z_0..z_N (GET /v1/rl/trajectories/{id})")
    return_images: bool = True
    output_format: OutputFormat = "png"

    @model_validator(mode="after")
    def _seeds_shape(self) -> "RolloutRequest":
        if self.seeds is not None:
            if len(self.seeds) != len(self.prompts) or any(len(r) != self.group_size for r in self.seeds):
                raise ValueError("seeds must be a [len(prompts)][group_size] list")
            if any(not 0 <= s <= L.SEED_MAX for r in self.seeds for s in r):
                raise ValueError(f"seeds must lie in [0, {L.SEED_MAX}]")
        return self

    def seed_grid(self, base: int) -> list[list[int]]:
        if self.seeds is not None:
            return [list(r) for r in self.seeds]
        G = self.group_size
        return [[(base + p * G + i) % (L.SEED_MAX + 1) for i in range(G)] for p in range(len(self.prompts))]


class ThinkSample(BaseModel):
    text: str
    token_ids: list[int]
    logprobs: list[float]


class RolloutSample(BaseModel):
    prompt_index: int
    sample_index: int
    seed: int
    image: Optional[str] = Field(None, description="base64 of the encoded image")
    logprobs: list[Optional[float]] = Field(description="per step; null on ODE steps")
    think: Optional[ThinkSample] = None


class PrefillInfo(BaseModel):
    prefixes: int = Field(description="understanding prefix computations (one per group without think)")
    shared_by: int = Field(description="samples reading one prefix")
    seconds: float


class RolloutResponse(BaseModel):
    id: str
    object: Literal["rl.rollout"] = "rl.rollout"
    created: int
    weights_version: str
    timesteps: list[float]
    noise_scale: float
    sde_steps: list[int]
    logprob_reduction: str = Field("mean", description="per-element mean over a sample's pixels")
    trajectory_id: Optional[str] = None
    samples: list[RolloutSample]
    prefill: PrefillInfo
    usage: dict = Field(default_factory=dict)
    timings: dict = Field(default_factory=dict)


class ScoreRequest(RLSampling):
    """POST /v1/rl/score: recompute the transition log-probs of a stored or uploaded trajectory."""
    trajectory_id: Optional[str] = Field(None, max_length=MAX_TRAJECTORY_ID_CHARS)
    trajectory_b64: Optional[str] = Field(None, description="safetensors bytes (the GET trajectory format), base64")
    think_token_ids: Optional[list[list[Int]]] = Field(None, description="per sample, the think tokens to re-prefill")
    weights: WeightsChoice = "current"
    _tid = field_validator("trajectory_id")(classmethod(lambda cls, v: check_trajectory_id(v)))

    @model_validator(mode="after")
    def _one_source(self) -> "ScoreRequest":
        if (self.trajectory_id is None) == (self.trajectory_b64 is None):
            raise ValueError("give exactly one of trajectory_id and trajectory_b64")
        n = len(self.prompts) * self.group_size
        if self.think_token_ids is not None and len(self.think_token_ids) != n:
            raise ValueError(f"think_token_ids needs one list per sample ({n})")
        return self


class ScoreResponse(BaseModel):
    object: Literal["rl.score"] = "rl.score"
    weights_version: str
    weights: WeightsChoice
    logprobs: list[list[Optional[float]]]


# ---- internal bodies: gateway -> generation ---------------------------------------------------------------------

def check_trajectory_id(v: Optional[str]) -> Optional[str]:
    """Letters, digits, '_', '-', '.' (it travels in URL paths)."""
    if v is not None and not _TRAJ_ID.fullmatch(v):
        raise ValueError("trajectory_id: 1 to 128 letters, digits, '_', '-', '.'")
    return v


class RolloutSpec(BaseModel):
    """The RL part of a generation job: the SDE, per-sample seeds, where the trajectory goes."""
    model_config = INTERNAL
    sde: SdeOptions = Field(default_factory=SdeOptions)
    seeds: list[Int] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    same_initial_noise: bool = False
    trajectory_id: Optional[str] = Field(None, max_length=MAX_TRAJECTORY_ID_CHARS)
    part: Int = Field(0, ge=0, le=MAX_RL_SAMPLES, description="this job's order inside the trajectory")
    return_images: bool = True
    owner: str = Field(OPEN_OWNER, pattern=OWNER_PATTERN, description="who the trajectory belongs to")

    _tid = field_validator("trajectory_id")(classmethod(lambda cls, v: check_trajectory_id(v)))


class RolloutJobRequest(GenerateRequest):
    """POST /internal/rl/rollout: n = len(rl.seeds) samples over one set of prefix handles (one job, one batch)."""
    n: Int = Field(1, ge=1, le=MAX_GROUP_SIZE)
    rl: RolloutSpec

    @model_validator(mode="after")
    def _n_seeds(self) -> "RolloutJobRequest":
        if len(self.rl.seeds) != self.n:
            raise ValueError("rl.seeds needs one seed per sample")
        return self


class ScoreJobRequest(GenerateRequest):
    """POST /internal/rl/score: the log-probs of samples [part, part + n) of a stored trajectory (an upload is
    stored first: POST /internal/rl/trajectories), recomputed over one set of prefix handles."""
    n: Int = Field(1, ge=1, le=MAX_GROUP_SIZE)
    seed: Int = Field(0, ge=0, le=L.SEED_MAX)
    sde: SdeOptions = Field(default_factory=SdeOptions)
    trajectory_id: str = Field(min_length=1, max_length=MAX_TRAJECTORY_ID_CHARS)
    part: Int = Field(0, ge=0, le=MAX_RL_SAMPLES, description="the first sample's index in the trajectory")
    weights: WeightsChoice = "current"
    owner: str = Field(OPEN_OWNER, pattern=OWNER_PATTERN, description="the trajectory's owner (else a 404)")
    _latents: object = PrivateAttr(None)     # f32 [n, N+1, 3, H, W], set by the generation server (pickled along)

    def with_latents(self, latents) -> "ScoreJobRequest":
        self._latents = latents
        return self

    def latents(self):
        return self._latents
