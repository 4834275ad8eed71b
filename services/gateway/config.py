"""Gateway settings: command-line flags, each with a `U1SERVE_*` environment fallback (services/knobs.py), and the
frozen GatewayConfig they make, whose field defaults are the flags' defaults.

Image defaults and limits start from the request contract (services/contract): flags may change a default
and may tighten a limit, never widen it. Secrets come from a flag, a file or the environment (kit.config)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services import knobs
from services import timeouts as T
from services.contract import limits as L
from services.contract.image import SamplerParams, default
from services.kit.config import read_secret, read_secrets
from services.kit.stream_settings import DEFAULT_WRITE_TIMEOUT_S

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
    model_name: str = "sensenova-u1"
    model_hub_id: str | None = None           # where the weights came from (u1serve up --model <org>/<name>)
    model_revision: str | None = None         # ... at this commit: both shown by /v1/models
    api_keys: tuple[str, ...] = ()            # Bearer keys for /v1/*; none = open
    internal_token: str | None = None         # sent to the engines on every call
    cache_salt_by_api_key: bool | None = None  # prefix-cache salt = a hash of the caller's key; None: iff keys
    # exposure (exposure.py)
    host: str | None = None                   # None: 0.0.0.0 with an API key, 127.0.0.1 without
    allowed_origins: tuple[str, ...] = ()     # CORS; none by default
    allowed_hosts: tuple[str, ...] = ()       # keyless gateways: Host names served besides loopback / IPs
    public_metrics: bool = False              # /metrics without the key
    public_docs: bool = False                 # /docs and /openapi.json without the key
    # server defaults for what a request leaves out: the contract's unless a flag says otherwise
    sampler: SamplerParams = field(default_factory=SamplerParams)
    default_size: tuple[int, int] = (L.DEFAULT_IMAGE_SIDE, L.DEFAULT_IMAGE_SIDE)
    default_think_tokens: int = field(default_factory=lambda: default("max_think_tokens"))
    # limits: at most the contract's
    min_side: int = L.MIN_IMAGE_SIDE
    max_side: int = L.MAX_IMAGE_SIDE
    max_pixels: int = L.MAX_IMAGE_SIDE ** 2
    max_steps: int = L.MAX_STEPS
    max_prompt_chars: int = L.MAX_PROMPT_CHARS
    max_think_tokens: int = L.MAX_THINK_TOKENS
    max_body_bytes: int | None = None         # a cap on every route's body limit (bodies.py has each route's)
    route_body_bytes: dict[str, int] = field(default_factory=dict)   # per-route limits (--route-body-mb)
    max_chat_images: int = L.MAX_CHAT_IMAGES
    images: ImageInputLimits = field(default_factory=ImageInputLimits)
    image_workers: int = 2                    # threads that check input images (bounded, off the event loop)
    # upstream
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = T.GATEWAY_IDLE_TIMEOUT_S      # no byte from an engine for this long -> 504 upstream_timeout
    request_timeout_s: float = T.GATEWAY_REQUEST_TIMEOUT_S  # total deadline of one request -> 504 deadline_exceeded
    health_timeout_s: float = 2.0
    retry_down_after_s: float = 2.0           # first ejection of a replica that failed; doubles per failure
    eject_max_s: float = 30.0                 # ... up to this
    health_interval_s: float = 1.0            # replica probes (readiness, queue depth, KV pairing); 0 = off
    dns_refresh_s: float = 10.0               # re-resolve engine URLs (one replica per address); 0 = once
    max_concurrent_requests: int = 256        # POSTs in flight; more -> 429 + Retry-After
    graceful_shutdown_s: float = 5.0          # on SIGTERM, what requests in flight have left (drain.py)
    # slow readers (kit/streaming.py): a client that takes no byte for this long is cut, its work cancelled
    stream_write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    stream_send_buffer_bytes: int = 0         # SO_SNDBUF per connection; 0 = the kernel's autotuning
    # strikes (probation.py): a client that holds a response unread this long, its window closed, is refused
    strike_hold_s: float = 3.0                # 0 = no strikes
    strike_decay_s: float = 120.0             # probation per strike; strikes drain one per this
    forwarded_allow_ips: str | None = None    # proxies whose X-Forwarded-For is the client; None: uvicorn's
    # ---- roles, opt-in features and RL limits (issue 37; docs/deployment.md "Tenants and the operator") ----
    admin_api_keys: tuple[str, ...] = ()      # operator keys: weight updates, adapter load / unload; never a tenant's
    enable_rl: bool = False                   # /v1/rl/* (rollout, score, trajectories, weights): off unless asked
    enable_runtime_lora: bool = False         # /v1/load_lora_adapter, /v1/unload_lora_adapter: off unless asked
    rl_max_trajectory_bytes: int = 4096 * MiB  # one rollout's trajectory (S x (N+1) x 3 x H x W float32)
    rl_max_pixel_steps: int = 1 << 32         # one RL request's samples x steps x pixels
    rl_max_trajectory_fetches: int = 8        # trajectory downloads relayed at once (more: 429)
    # stored responses (/v1/responses: store, previous_response_id, background), in memory per API key
    responses_max_stored: int = 512           # finished responses kept; the oldest go first
    responses_store_mb: float = 256.0         # ... and at most this much of their text and images
    responses_ttl_s: float = 3600.0           # a finished response is kept this long
    responses_max_background: int = 32        # background responses queued or running; more -> 429

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
        if min(self.connect_timeout_s, self.idle_timeout_s, self.request_timeout_s, self.graceful_shutdown_s) <= 0:
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
def _add(p: argparse.ArgumentParser, flag: str, *, knob: knobs.Knob | None = None, default=None, help: str = "",
         **kw) -> None:
    """A flag whose default comes from its environment knob (U1SERVE_<FLAG> unless named), else `default`."""
    knob = knob or knobs.GATEWAY_FLAGS.knob(flag, kw.get("type", str), default)
    raw = knob.raw()
    p.add_argument(flag, default=default if raw is None else raw, help=f"{help} (env {knob.name})".strip(), **kw)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway.server",
                                description="u1serve public OpenAI-compatible gateway",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add(p, "--host", knob=knobs.GATEWAY_HOST, default=None,
         help="bind address (default: 0.0.0.0 with an API key, 127.0.0.1 without one)")
    _add(p, "--port", knob=knobs.GATEWAY_PORT, default=8000, type=int)
    p.add_argument("--und-url", action="append", default=None,
                   help="understanding replica (repeat or comma-separate; a host name with several addresses is one "
                        "replica per address); env " + knobs.UND_URLS.name)
    p.add_argument("--gen-url", action="append", default=None,
                   help="generation replica (as --und-url); env " + knobs.GEN_URLS.name)
    _add(p, "--model-name", default=GatewayConfig.model_name)
    p.add_argument("--model-hub-id", default=None, help="the hub id the weights came from (/v1/models shows it)")
    p.add_argument("--model-revision", default=None, help="the hub revision (commit) of the weights (/v1/models)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1/* (env {knobs.API_KEY.name})")
    p.add_argument("--api-key-file", default=None, help="file with the accepted API keys, one per line")
    p.add_argument("--internal-token", default=None, help=f"token sent to the engines (env {knobs.INTERNAL_TOKEN.name})")
    p.add_argument("--internal-token-file", default=None, help="file whose first line is the internal token")
    p.add_argument("--cache-salt-by-api-key", action=argparse.BooleanOptionalAction,
                   default=knobs.CACHE_SALT_BY_API_KEY.get(),
                   help="prefix-cache salt = a hash of the caller's API key, so clients with different keys never "
                        "share prefix-cache entries (default: on whenever API keys are set; "
                        "--no-cache-salt-by-api-key shares the cache across keys); env " + knobs.CACHE_SALT_BY_API_KEY.name)
    _add(p, "--allowed-origins", default="",
         help="comma-separated origins allowed by CORS ('*' for any; default none)")
    _add(p, "--allowed-hosts", default="",
         help="without an API key: Host names served besides loopback names and IP addresses ('*' for any)")
    _bool(p, "--public-metrics", "serve /metrics without the API key (when one is set)")
    _bool(p, "--public-docs", "serve /docs and /openapi.json without the API key (when one is set)")
    _add(p, "--default-size", default=f"{L.DEFAULT_IMAGE_SIDE}x{L.DEFAULT_IMAGE_SIDE}")
    _add(p, "--default-steps", type=int, help="default num_inference_steps (contract default if unset)")
    _add(p, "--default-guidance", type=float, help="default guidance_scale")
    _add(p, "--default-image-guidance", type=float, help="default image_guidance_scale")
    _add(p, "--default-timestep-shift", type=float, help="default timestep_shift (flow_shift)")
    _add(p, "--default-think-tokens", type=int, help="default max_think_tokens")
    _add(p, "--min-side", type=int, default=L.MIN_IMAGE_SIDE)
    _add(p, "--max-side", type=int, default=L.MAX_IMAGE_SIDE)
    _add(p, "--max-pixels", type=int, default=L.MAX_IMAGE_SIDE ** 2)
    _add(p, "--max-steps", type=int, default=L.MAX_STEPS)
    _add(p, "--max-prompt-chars", type=int, default=L.MAX_PROMPT_CHARS)
    _add(p, "--max-think-tokens", type=int, default=L.MAX_THINK_TOKENS)
    _add(p, "--max-body-mb", type=float, default=None,
         help="a cap on every route's body limit (default: each route's own, services/gateway/bodies.py)")
    p.add_argument("--route-body-mb", action="append", default=[], metavar="PATH=MB",
                   help="the body limit of one route (repeatable), e.g. /v1/chat/completions=64")
    _add(p, "--max-chat-images", type=int, default=L.MAX_CHAT_IMAGES, help="image parts of one chat request")
    _add(p, "--max-image-pixels", type=int, default=ImageInputLimits.max_image_pixels,
         help="pixels of one input image (from its header)")
    _add(p, "--max-request-pixels", type=int, default=ImageInputLimits.max_request_pixels,
         help="pixels of all input images of one request")
    _add(p, "--image-formats", default=",".join(ImageInputLimits.formats), help="accepted input image formats")
    _add(p, "--image-workers", type=int, default=GatewayConfig.image_workers, help="threads that check input images")
    _add(p, "--connect-timeout-s", type=float, default=GatewayConfig.connect_timeout_s)
    _add(p, "--upstream-idle-timeout-s", type=float, default=T.GATEWAY_IDLE_TIMEOUT_S,
         help="an engine that sends nothing for this long -> 504 upstream_timeout, its work is cancelled")
    _add(p, "--request-timeout-s", type=float, default=T.GATEWAY_REQUEST_TIMEOUT_S,
         help="total deadline of one request -> 504 deadline_exceeded, its work is cancelled")
    _add(p, "--health-interval-s", type=float, default=GatewayConfig.health_interval_s,
         help="probe every replica's /health this often (readiness, queue depth, KV pairing); 0 = off")
    _add(p, "--dns-refresh-s", type=float, default=GatewayConfig.dns_refresh_s, help="re-resolve the engine URLs this often; 0 = at start only")
    _add(p, "--retry-down-after-s", type=float, default=GatewayConfig.retry_down_after_s,
         help="a replica that failed is skipped this long, doubling with each further failure")
    _add(p, "--eject-max-s", type=float, default=GatewayConfig.eject_max_s, help="... up to this long")
    _add(p, "--max-concurrent-requests", type=int, default=GatewayConfig.max_concurrent_requests,
         help="requests in flight; beyond it 429 with Retry-After")
    _add(p, "--graceful-shutdown-s", type=float, default=GatewayConfig.graceful_shutdown_s,
         help="on SIGTERM, requests in flight may finish within this; then they end with a 503 shutting_down "
              "(streams: an error event and [DONE])")
    _add(p, "--stream-write-timeout-s", type=float, default=GatewayConfig.stream_write_timeout_s,
         help="a client that takes no byte of its response for this long while a chunk waits is cut off and its "
              "work cancelled, its slot freed (slow reader); 0 = never")
    _add(p, "--stream-send-buffer-kb", type=int, default=0,
         help="cap each connection's kernel send buffer at this many KiB (how much a client that reads nothing "
              "absorbs before --stream-write-timeout-s counts); 0 = kernel default")
    _add(p, "--strike-hold-s", type=float, default=GatewayConfig.strike_hold_s,
         help="a client that holds a response unread this long with its receive window closed (its application "
              "reads nothing; a slow network is not struck) gets a strike: its new requests get 429 "
              "client_on_probation until the strike decays; 0 = no strikes")
    _add(p, "--strike-decay-s", type=float, default=GatewayConfig.strike_decay_s,
         help="how long one strike refuses its client; strikes add up and drain one per this many seconds")
    _add(p, "--forwarded-allow-ips", default=None,
         help="comma-separated proxy addresses (or '*') whose X-Forwarded-For header is taken as the client's "
              "address (strikes, logs); default: uvicorn's, FORWARDED_ALLOW_IPS or 127.0.0.1,::1")
    # ---- roles, opt-in features and RL limits (issue 37) ----
    p.add_argument("--admin-api-key", default=None,
                   help="the operator key: weight updates and adapter load / unload need it, tenant routes refuse "
                        f"it (env {knobs.ADMIN_API_KEY.name})")
    p.add_argument("--admin-api-key-file", default=None, help="file with the operator keys, one per line ('#' "
                   "comments and blank lines skipped; an empty file is an error)")
    _bool(p, "--enable-rl", "serve the RL routes /v1/rl/* (rollout, score, trajectories, weight updates)")
    _bool(p, "--enable-runtime-lora", "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (operator key)")
    _add(p, "--rl-max-trajectory-mb", type=float, default=GatewayConfig.rl_max_trajectory_bytes / MiB,
         help="the largest trajectory one rollout may store (samples x (steps+1) x 3 x H x W x 4 bytes)")
    _add(p, "--rl-max-pixel-steps", type=int, default=GatewayConfig.rl_max_pixel_steps,
         help="the most samples x steps x pixels one RL request may ask for")
    _add(p, "--rl-max-trajectory-fetches", type=int, default=GatewayConfig.rl_max_trajectory_fetches,
         help="trajectory downloads relayed at once; more get 429")
    _add(p, "--responses-max-stored", type=int, default=GatewayConfig.responses_max_stored,
         help="/v1/responses: finished responses kept in memory (all keys together; the oldest go first)")
    _add(p, "--responses-store-mb", type=float, default=GatewayConfig.responses_store_mb,
         help="/v1/responses: text and images of the kept responses, at most this many MiB")
    _add(p, "--responses-ttl-s", type=float, default=GatewayConfig.responses_ttl_s,
         help="/v1/responses: a finished response is kept this long")
    _add(p, "--responses-max-background", type=int, default=GatewayConfig.responses_max_background,
         help="/v1/responses: background responses queued or running at once; more -> 429 with Retry-After")
    _add(p, "--log-level", default="info")
    return p


def flag_knobs() -> list[knobs.Knob]:
    """The environment knobs of the gateway's flags that are not declared on their own (knobs.GATEWAY_FLAGS)."""
    build_arg_parser()
    return sorted(knobs.GATEWAY_FLAGS.members.values(), key=lambda k: k.name)


def _bool(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    knob = knobs.GATEWAY_FLAGS.knob(flag, bool, False)
    p.add_argument(flag, action="store_true", default=knob.get(), help=f"{help} (env {knob.name}=1)")


def _split(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


def _route_limits(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        path, sep, mb = item.partition("=")
        if not sep or not path.startswith("/"):
            raise ValueError(f"--route-body-mb takes PATH=MB, got {item!r}")
        out[path.strip()] = int(float(mb) * MiB)
    return out


def _split_urls(items: list[str]) -> list[str]:
    return [u.strip().rstrip("/") for item in items for u in item.split(",") if u.strip()]


def _tenancy(args: argparse.Namespace) -> dict:
    """The issue-37 fields of the config (roles, opt-in features, RL limits)."""
    return {"admin_api_keys": tuple(read_secrets(args.admin_api_key, args.admin_api_key_file, knobs.ADMIN_API_KEY)),
            "enable_rl": args.enable_rl, "enable_runtime_lora": args.enable_runtime_lora,
            "rl_max_trajectory_bytes": int(args.rl_max_trajectory_mb * MiB),
            "rl_max_pixel_steps": args.rl_max_pixel_steps, "rl_max_trajectory_fetches": args.rl_max_trajectory_fetches}


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config of parsed flags; a bad combination is a SystemExit that says why."""
    sampler = {name: value for name, value in (
        ("num_inference_steps", args.default_steps), ("guidance_scale", args.default_guidance),
        ("image_guidance_scale", args.default_image_guidance), ("timestep_shift", args.default_timestep_shift))
        if value is not None}
    try:
        return GatewayConfig(
            und_urls=_split_urls(args.und_url or [knobs.UND_URLS.get(default=DEFAULT_UND_URL)]),
            gen_urls=_split_urls(args.gen_url or [knobs.GEN_URLS.get(default=DEFAULT_GEN_URL)]),
            model_name=args.model_name, model_hub_id=args.model_hub_id, model_revision=args.model_revision,
            api_keys=tuple(read_secrets(args.api_key, args.api_key_file, knobs.API_KEY)),
            internal_token=read_secret(args.internal_token, args.internal_token_file, knobs.INTERNAL_TOKEN),
            cache_salt_by_api_key=args.cache_salt_by_api_key,
            sampler=SamplerParams(**sampler),
            default_size=parse_size(args.default_size),
            default_think_tokens=(args.default_think_tokens if args.default_think_tokens is not None
                                  else default("max_think_tokens")),
            min_side=args.min_side, max_side=args.max_side, max_pixels=args.max_pixels, max_steps=args.max_steps,
            max_prompt_chars=args.max_prompt_chars, max_think_tokens=args.max_think_tokens,
            host=args.host, allowed_origins=_split(args.allowed_origins), allowed_hosts=_split(args.allowed_hosts),
            public_metrics=args.public_metrics, public_docs=args.public_docs,
            max_body_bytes=int(args.max_body_mb * MiB) if args.max_body_mb is not None else None,
            route_body_bytes=_route_limits(args.route_body_mb), max_chat_images=args.max_chat_images,
            images=ImageInputLimits(
                max_image_pixels=args.max_image_pixels, max_request_pixels=args.max_request_pixels,
                formats=tuple(f.strip().lower() for f in args.image_formats.split(",") if f.strip())),
            image_workers=args.image_workers,
            connect_timeout_s=args.connect_timeout_s, idle_timeout_s=args.upstream_idle_timeout_s,
            request_timeout_s=args.request_timeout_s, max_concurrent_requests=args.max_concurrent_requests,
            health_interval_s=args.health_interval_s, dns_refresh_s=args.dns_refresh_s,
            retry_down_after_s=args.retry_down_after_s, eject_max_s=args.eject_max_s,
            graceful_shutdown_s=args.graceful_shutdown_s, stream_write_timeout_s=args.stream_write_timeout_s,
            stream_send_buffer_bytes=args.stream_send_buffer_kb * 1024, strike_hold_s=args.strike_hold_s,
            strike_decay_s=args.strike_decay_s, forwarded_allow_ips=args.forwarded_allow_ips,
            responses_max_stored=args.responses_max_stored, responses_store_mb=args.responses_store_mb,
            responses_ttl_s=args.responses_ttl_s, responses_max_background=args.responses_max_background,
            **_tenancy(args))
    except ValueError as exc:        # pydantic's ValidationError is a ValueError too
        raise SystemExit(f"gateway: {exc}") from None
