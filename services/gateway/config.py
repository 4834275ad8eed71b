"""Gateway settings: the frozen GatewayConfig, whose fields are the command line's flags (kit.flags generates them,
each with a `U1SERVE_*` environment fallback: services/base/knobs.py), and `CommandLine`, the flags that are inputs the
config is resolved from (secrets from a flag, a file or the environment; MB and KiB units; comma lists; the sampler
defaults). A config built in process is checked as a parsed one (`__post_init__`).

Image defaults and limits start from the request contract (services/contract): flags may change a default
and may tighten a limit, never widen it. Secrets come from a flag, a file or the environment (kit.config)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.base import knobs
from services.base import timeouts as T
from services.contract import limits as L
from services.contract.image import SamplerParams, default
from services.kit import flags
from services.kit.config import read_secret, read_secrets
from services.kit.flags import flag
from services.kit.stream_settings import DEFAULT_WRITE_TIMEOUT_S, StreamSettings

MiB = 1024 * 1024
DEFAULT_UND_URL = "http://127.0.0.1:8100"
DEFAULT_GEN_URL = "http://127.0.0.1:8200"


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (W, H); raises ValueError on anything else."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2:
        raise ValueError(f"size must look like 'WIDTHxHEIGHT', got {text!r}")
    w, h = (int(p.strip()) for p in parts)
    return w, h


@dataclass(frozen=True)
class ImageInputLimits:
    """What the gateway accepts as an input image, checked from the header before any decoding: the contract's
    limits (the ones understanding applies too), or tighter."""
    max_image_pixels: int = L.MAX_INPUT_IMAGE_PIXELS        # one input image
    max_request_pixels: int = L.MAX_INPUT_REQUEST_PIXELS    # all input images of one request together
    formats: tuple[str, ...] = L.INPUT_IMAGE_FORMATS
    max_image_bytes: int = L.MAX_INPUT_IMAGE_BYTES

    def __post_init__(self) -> None:
        if (self.max_image_pixels > L.MAX_INPUT_IMAGE_PIXELS or self.max_request_pixels > L.MAX_INPUT_REQUEST_PIXELS
                or self.max_image_bytes > L.MAX_INPUT_IMAGE_BYTES
                or not set(self.formats) <= set(L.INPUT_IMAGE_FORMATS)):
            raise ValueError("input image limits may only be tighter than the contract's (understanding refuses "
                             f"more): at most {L.MAX_INPUT_IMAGE_PIXELS} pixels per image, "
                             f"{L.MAX_INPUT_REQUEST_PIXELS} per request, formats {', '.join(L.INPUT_IMAGE_FORMATS)}")


@dataclass(frozen=True)
class GatewayConfig:
    und_urls: list[str] = field(default_factory=lambda: [DEFAULT_UND_URL])
    gen_urls: list[str] = field(default_factory=lambda: [DEFAULT_GEN_URL])
    model_name: str = field(default="sensenova-u1", metadata=flag("the model name of /v1/models and responses"))
    model_hub_id: str | None = field(default=None, metadata=flag(
        "the hub id the weights came from (/v1/models shows it)", env=False))
    model_revision: str | None = field(default=None, metadata=flag(
        "the hub revision (commit) of the weights (/v1/models)", env=False))
    api_keys: tuple[str, ...] = ()            # Bearer keys for /v1/*; none = open
    internal_token: str | None = None         # sent to the engines on every call
    cache_salt_by_api_key: bool | None = field(default=None, metadata=flag(
        "prefix-cache salt = a hash of the caller's API key, so clients with different keys never share "
        "prefix-cache entries (unset: on whenever API keys are set; --no-cache-salt-by-api-key shares the cache "
        "across keys)", knob=knobs.CACHE_SALT_BY_API_KEY))
    # exposure (exposure.py)
    host: str | None = field(default=None, metadata=flag(
        "bind address (unset: 0.0.0.0 with an API key, 127.0.0.1 without one)", knob=knobs.GATEWAY_HOST))
    allowed_origins: tuple[str, ...] = ()     # CORS; none by default
    allowed_hosts: tuple[str, ...] = ()       # keyless gateways: Host names served besides loopback / IPs
    public_metrics: bool = field(default=False, metadata=flag(
        "serve /metrics without the API key (when one is set)"))
    public_docs: bool = field(default=False, metadata=flag(
        "serve /docs and /openapi.json without the API key (when one is set)"))
    # server defaults for what a request leaves out: the contract's unless a flag says otherwise
    sampler: SamplerParams = field(default_factory=SamplerParams)
    default_size: tuple[int, int] = (L.DEFAULT_IMAGE_SIDE, L.DEFAULT_IMAGE_SIDE)
    default_think_tokens: int = field(default_factory=lambda: default("max_think_tokens"))
    # limits: at most the contract's
    min_side: int = field(default=L.MIN_IMAGE_SIDE, metadata=flag("smallest image side"))
    max_side: int = field(default=L.MAX_IMAGE_SIDE, metadata=flag("largest image side"))
    max_pixels: int = field(default=L.MAX_IMAGE_SIDE ** 2, metadata=flag("largest image (width x height)"))
    max_step_pixels: int = field(default=0, metadata=flag(
        "most n x CFG branches x width x height of one request: the rows one denoise step of it takes (0: no "
        "limit; `u1serve plan` sets it where the card's memory plan counts no more)"))
    max_steps: int = field(default=L.MAX_STEPS, metadata=flag("most num_inference_steps"))
    max_prompt_chars: int = field(default=L.MAX_PROMPT_CHARS, metadata=flag("longest prompt"))
    max_think_tokens: int = field(default=L.MAX_THINK_TOKENS, metadata=flag("most max_think_tokens"))
    max_body_bytes: int | None = None         # a cap on every route's body limit (bodies.py has each route's)
    route_body_bytes: dict[str, int] = field(default_factory=dict)   # per-route limits (--route-body-mb)
    max_chat_images: int = field(default=L.MAX_CHAT_IMAGES, metadata=flag("image parts of one chat request"))
    images: ImageInputLimits = field(default_factory=ImageInputLimits)
    image_workers: int = field(default=2, metadata=flag(
        "threads that check input images (bounded, off the event loop)"))
    # upstream
    connect_timeout_s: float = field(default=5.0, metadata=flag("connecting to an engine"))
    upstream_idle_timeout_s: float = field(default=T.GATEWAY_IDLE_TIMEOUT_S, metadata=flag(
        "an engine that sends nothing for this long -> 504 upstream_timeout, its work is cancelled"))
    request_timeout_s: float = field(default=T.GATEWAY_REQUEST_TIMEOUT_S, metadata=flag(
        "total deadline of one request -> 504 deadline_exceeded, its work is cancelled"))
    health_timeout_s: float = 2.0
    retry_down_after_s: float = field(default=2.0, metadata=flag(
        "a replica that failed is skipped this long, doubling with each further failure"))
    eject_max_s: float = field(default=30.0, metadata=flag("... up to this long"))
    health_interval_s: float = field(default=1.0, metadata=flag(
        "probe every replica's /health this often (readiness, queue depth, KV pairing); 0 = off"))
    dns_refresh_s: float = field(default=10.0, metadata=flag(
        "re-resolve the engine URLs this often (one replica per address); 0 = at start only"))
    max_concurrent_requests: int = field(default=256, metadata=flag(
        "requests in flight; beyond it 429 with Retry-After"))
    graceful_shutdown_s: float = field(default=5.0, metadata=flag(
        "on SIGTERM, requests in flight may finish within this; then they end with a 503 shutting_down (streams: "
        "an error event and [DONE])"))
    # slow readers (kit/streaming.py): a client that takes no byte for this long is cut, its work cancelled
    stream_write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S              # its flag: CommandLine (StreamSettings)
    stream_send_buffer_bytes: int = 0         # SO_SNDBUF per connection; 0 = the kernel's autotuning
    # strikes (probation.py): a client that holds a response unread this long, its window closed, is refused
    strike_hold_s: float = field(default=3.0, metadata=flag(
        "a client that holds a response unread this long with its receive window closed (its application reads "
        "nothing; a slow network is not struck) gets a strike: its new requests get 429 client_on_probation until "
        "the strike decays; 0 = no strikes"))
    strike_decay_s: float = field(default=120.0, metadata=flag(
        "how long one strike refuses its client; strikes add up and drain one per this many seconds"))
    forwarded_allow_ips: str | None = field(default=None, metadata=flag(
        "comma-separated proxy addresses (or '*') whose X-Forwarded-For header is taken as the client's address "
        "(strikes, logs); unset: uvicorn's, FORWARDED_ALLOW_IPS or 127.0.0.1,::1"))
    # ---- roles, opt-in features and RL limits (issue 37; docs/deployment.md "Tenants and the operator") ----
    admin_api_keys: tuple[str, ...] = ()      # operator keys: weight updates, adapter load / unload; never a tenant's
    enable_rl: bool = field(default=False, metadata=flag(
        "serve the RL routes /v1/rl/* (rollout, score, trajectories, weight updates)"))
    enable_runtime_lora: bool = field(default=False, metadata=flag(
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (operator key)"))
    rl_max_trajectory_bytes: int = 4096 * MiB  # one rollout's trajectory (S x (N+1) x 3 x H x W float32)
    rl_max_pixel_steps: int = field(default=1 << 32, metadata=flag(
        "the most samples x steps x pixels one RL request may ask for"))
    rl_max_trajectory_fetches: int = field(default=8, metadata=flag(
        "trajectory downloads relayed at once; more get 429"))
    # stored responses (/v1/responses: store, previous_response_id, background), in memory per API key
    responses_max_stored: int = field(default=512, metadata=flag(
        "/v1/responses: finished responses kept in memory (all keys together; the oldest go first)"))
    responses_store_mb: float = field(default=256.0, metadata=flag(
        "/v1/responses: text and images of the kept responses, at most this many MiB"))
    responses_ttl_s: float = field(default=3600.0, metadata=flag(
        "/v1/responses: a finished response is kept this long"))
    responses_max_background: int = field(default=32, metadata=flag(
        "/v1/responses: background responses queued or running at once; more -> 429 with Retry-After"))

    def __post_init__(self) -> None:
        if self.admin_api_keys and not self.api_keys:
            raise ValueError("--admin-api-key(-file) needs tenant keys too (--api-key / --api-key-file): the "
                             "tenant routes would be open")
        if set(self.admin_api_keys) & set(self.api_keys):
            raise ValueError("a key is both a tenant key and an operator key: give the operator its own")
        if min(self.rl_max_trajectory_bytes, self.rl_max_pixel_steps, self.rl_max_trajectory_fetches) < 1:
            raise ValueError("the RL limits must be positive")
        tightened = {"min_side": self.min_side >= L.MIN_IMAGE_SIDE, "max_side": self.max_side <= L.MAX_IMAGE_SIDE,
                     "max_pixels": self.max_pixels <= L.MAX_IMAGE_SIDE ** 2, "max_steps": self.max_steps <= L.MAX_STEPS,
                     "max_prompt_chars": self.max_prompt_chars <= L.MAX_PROMPT_CHARS,
                     "max_think_tokens": self.max_think_tokens <= L.MAX_THINK_TOKENS}
        wider = [k for k, ok in tightened.items() if not ok]
        if wider:
            raise ValueError(f"{', '.join(wider)}: a server limit may only be tighter than the contract's")
        if not 1 <= self.min_side <= self.max_side:
            raise ValueError("min_side must be between 1 and max_side")
        w, h = self.default_size
        if self.size_problem(w, h):
            raise ValueError(f"default size {w}x{h}: {self.size_problem(w, h)}")
        if self.sampler.num_inference_steps > self.max_steps:
            raise ValueError(f"default steps {self.sampler.num_inference_steps} above max_steps {self.max_steps}")
        if not 1 <= self.default_think_tokens <= self.max_think_tokens:
            raise ValueError(f"default think tokens must be in [1, {self.max_think_tokens}]")
        if self.cache_salt_by_api_key and not self.api_keys:
            raise ValueError("cache_salt_by_api_key needs API keys (--api-key / --api-key-file)")
        if self.cache_salt_by_api_key is None:     # frozen: the resolved default is set once, here
            object.__setattr__(self, "cache_salt_by_api_key", bool(self.api_keys))
        if not 0 <= self.max_chat_images <= L.MAX_CHAT_IMAGES:
            raise ValueError(f"max_chat_images must be in [0, {L.MAX_CHAT_IMAGES}]")
        if any(v < 1 for v in [*self.route_body_bytes.values(), self.max_body_bytes or 1]):
            raise ValueError("body limits must be positive")
        if min(self.connect_timeout_s, self.upstream_idle_timeout_s, self.request_timeout_s, self.graceful_shutdown_s) <= 0:
            raise ValueError("timeouts (and graceful_shutdown_s) must be positive")
        if min(self.health_interval_s, self.dns_refresh_s) < 0 or self.retry_down_after_s <= 0:
            raise ValueError("health_interval_s and dns_refresh_s must be >= 0, retry_down_after_s > 0")
        if self.stream_write_timeout_s < 0 or self.stream_send_buffer_bytes < 0:
            raise ValueError("stream_write_timeout_s and stream_send_buffer_bytes must be >= 0 (0 = off)")
        if self.strike_hold_s < 0 or self.strike_decay_s <= 0:
            raise ValueError("strike_hold_s must be >= 0 (0 = off) and strike_decay_s > 0")
        if min(self.responses_max_stored, self.responses_max_background) < 1 or min(
                self.responses_store_mb, self.responses_ttl_s) <= 0:
            raise ValueError("responses_max_stored, responses_max_background, responses_store_mb and "
                             "responses_ttl_s must be positive")
        if self.max_step_pixels < 0:
            raise ValueError("max_step_pixels must be >= 0 (0 = no limit)")
        if self.max_concurrent_requests < 1 or self.image_workers < 1:
            raise ValueError("max_concurrent_requests and image_workers must be >= 1")

    def size_rule(self) -> str:
        return (f"width and height must be multiples of {L.IMAGE_BLOCK} between {self.min_side} and "
                f"{self.max_side}, at most {self.max_pixels} pixels")

    def size_problem(self, w: int, h: int) -> str | None:
        """Why the server does not make a w x h image, or None."""
        if (w % L.IMAGE_BLOCK or h % L.IMAGE_BLOCK or not self.min_side <= w <= self.max_side
                or not self.min_side <= h <= self.max_side or w * h > self.max_pixels):
            return self.size_rule()
        return None


# ------------------------------------------------------------------------------------------ command line
@dataclass(frozen=True)
class CommandLine(StreamSettings):
    """The gateway flags that are not GatewayConfig fields as they are: what the config is resolved from."""
    port: int = field(default=8000, metadata=flag("listen port", knob=knobs.GATEWAY_PORT))
    log_level: str = field(default="info", metadata=flag("log level"))
    und_url: tuple[str, ...] | None = field(default=None, metadata=flag(
        "understanding replica (repeat or comma-separate; a host name with several addresses is one replica per "
        f"address); env {knobs.UND_URLS.name}", repeat=True, env=False))
    gen_url: tuple[str, ...] | None = field(default=None, metadata=flag(
        f"generation replica (as --und-url); env {knobs.GEN_URLS.name}", repeat=True, env=False))
    api_key: str | None = field(default=None, metadata=flag(
        f"require 'Authorization: Bearer KEY' on /v1/* (env {knobs.API_KEY.name})", env=False))
    api_key_file: str | None = field(default=None, metadata=flag(
        "file with the accepted API keys, one per line", env=False))
    internal_token: str | None = field(default=None, metadata=flag(
        f"token sent to the engines (env {knobs.INTERNAL_TOKEN.name})", env=False))
    internal_token_file: str | None = field(default=None, metadata=flag(
        "file whose first line is the internal token", env=False))
    admin_api_key: str | None = field(default=None, metadata=flag(
        "the operator key: weight updates and adapter load / unload need it, tenant routes refuse it (env "
        f"{knobs.ADMIN_API_KEY.name})", env=False))
    admin_api_key_file: str | None = field(default=None, metadata=flag(
        "file with the operator keys, one per line ('#' comments and blank lines skipped; an empty file is an "
        "error)", env=False))
    allowed_origins: str = field(default="", metadata=flag(
        "comma-separated origins allowed by CORS ('*' for any; default none)"))
    allowed_hosts: str = field(default="", metadata=flag(
        "without an API key: Host names served besides loopback names and IP addresses ('*' for any)"))
    # what a request leaves out (unset: the contract's defaults)
    default_size: str = field(default=f"{L.DEFAULT_IMAGE_SIDE}x{L.DEFAULT_IMAGE_SIDE}", metadata=flag(
        "image size WxH"))
    default_steps: int | None = field(default=None, metadata=flag(
        "default num_inference_steps (contract default if unset)"))
    default_guidance: float | None = field(default=None, metadata=flag("default guidance_scale"))
    default_image_guidance: float | None = field(default=None, metadata=flag("default image_guidance_scale"))
    default_timestep_shift: float | None = field(default=None, metadata=flag("default timestep_shift (flow_shift)"))
    default_think_tokens: int | None = field(default=None, metadata=flag("default max_think_tokens"))
    # bodies and input images, in the units an operator writes
    max_body_mb: float | None = field(default=None, metadata=flag(
        "a cap on every route's body limit (unset: each route's own, services/gateway/bodies.py)"))
    route_body_mb: tuple[str, ...] = field(default=(), metadata=flag(
        "the body limit of one route (repeatable), e.g. /v1/chat/completions=64", metavar="PATH=MB", repeat=True,
        env=False))
    max_image_pixels: int = field(default=ImageInputLimits.max_image_pixels, metadata=flag(
        "pixels of one input image (from its header)"))
    max_request_pixels: int = field(default=ImageInputLimits.max_request_pixels, metadata=flag(
        "pixels of all input images of one request"))
    image_formats: str = field(default=",".join(ImageInputLimits.formats), metadata=flag(
        "accepted input image formats"))
    rl_max_trajectory_mb: float = field(default=GatewayConfig.rl_max_trajectory_bytes / MiB, metadata=flag(
        "the largest trajectory one rollout may store (samples x (steps+1) x 3 x H x W x 4 bytes)"))

    def resolved(self) -> dict:
        """The GatewayConfig fields these flags make (secrets read, units converted, lists split)."""
        sampler = {name: value for name, value in (
            ("num_inference_steps", self.default_steps), ("guidance_scale", self.default_guidance),
            ("image_guidance_scale", self.default_image_guidance), ("timestep_shift", self.default_timestep_shift))
            if value is not None}
        return dict(
            und_urls=_split_urls(self.und_url or [knobs.UND_URLS.get(default=DEFAULT_UND_URL)]),
            gen_urls=_split_urls(self.gen_url or [knobs.GEN_URLS.get(default=DEFAULT_GEN_URL)]),
            api_keys=tuple(read_secrets(self.api_key, self.api_key_file, knobs.API_KEY)),
            internal_token=read_secret(self.internal_token, self.internal_token_file, knobs.INTERNAL_TOKEN),
            admin_api_keys=tuple(read_secrets(self.admin_api_key, self.admin_api_key_file, knobs.ADMIN_API_KEY)),
            allowed_origins=_split(self.allowed_origins), allowed_hosts=_split(self.allowed_hosts),
            sampler=SamplerParams(**sampler), default_size=parse_size(self.default_size),
            default_think_tokens=(self.default_think_tokens if self.default_think_tokens is not None
                                  else default("max_think_tokens")),
            max_body_bytes=int(self.max_body_mb * MiB) if self.max_body_mb is not None else None,
            route_body_bytes=_route_limits(self.route_body_mb),
            images=ImageInputLimits(
                max_image_pixels=self.max_image_pixels, max_request_pixels=self.max_request_pixels,
                formats=tuple(f.strip().lower() for f in self.image_formats.split(",") if f.strip())),
            stream_send_buffer_bytes=self.stream_send_buffer_kb * 1024,
            rl_max_trajectory_bytes=int(self.rl_max_trajectory_mb * MiB))


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway.server",
                                description="u1serve public OpenAI-compatible gateway",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_flags(p, GatewayConfig, env=knobs.GATEWAY_FLAGS)
    flags.add_flags(p, CommandLine, env=knobs.GATEWAY_FLAGS)
    return p


def flag_knobs() -> list[knobs.Knob]:
    """The environment knobs of the gateway's flags that are not declared on their own (knobs.GATEWAY_FLAGS)."""
    build_arg_parser()
    return sorted(knobs.GATEWAY_FLAGS.members.values(), key=lambda k: k.name)


def _split(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


def _route_limits(items) -> dict[str, int]:
    out = {}
    for item in items:
        path, sep, mb = item.partition("=")
        if not sep or not path.startswith("/"):
            raise ValueError(f"--route-body-mb takes PATH=MB, got {item!r}")
        out[path.strip()] = int(float(mb) * MiB)
    return out


def _split_urls(items) -> list[str]:
    return [u.strip().rstrip("/") for item in items for u in item.split(",") if u.strip()]


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config of parsed flags; a bad combination is a SystemExit that says why."""
    try:
        return flags.from_args(GatewayConfig, args, **flags.from_args(CommandLine, args).resolved())
    except ValueError as exc:        # pydantic's ValidationError is a ValueError too
        raise SystemExit(f"gateway: {exc}") from None
