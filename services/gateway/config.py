"""Gateway settings: command-line flags, each with a `U1SERVE_*` environment fallback."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (W, H); raises ValueError on anything else."""
    parts = text.lower().replace("*", "x").split("x")
    if len(parts) != 2:
        raise ValueError(f"size must look like 'WIDTHxHEIGHT', got {text!r}")
    w, h = (int(p.strip()) for p in parts)
    return w, h


def _split_urls(text: str) -> list[str]:
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


@dataclass
class GatewayConfig:
    und_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8100"])
    gen_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8200"])
    model_name: str = "sensenova-u1"
    api_key: str | None = None            # public API key (Bearer); None = open
    internal_token: str | None = None     # sent to the engines as X-U1-Internal-Token
    # image defaults (model spec): T2I 2048x2048, 50 steps, g 4.0, cfg_norm none, shift 3.0
    default_size: tuple[int, int] = (2048, 2048)
    default_steps: int = 50
    default_guidance: float = 4.0
    default_image_guidance: float = 1.0
    default_timestep_shift: float = 3.0
    default_t_eps: float = 0.02
    default_max_think_tokens: int = 1024
    # limits
    min_side: int = 32
    max_side: int = 4096
    max_pixels: int = 4096 * 4096
    max_steps: int = 200
    max_n: int = 4
    max_prompt_chars: int = 16384
    max_think_tokens: int = 8192
    max_input_images: int = 4
    max_body_bytes: int = 32 * 1024 * 1024
    # upstream behaviour
    connect_timeout_s: float = 5.0
    health_timeout_s: float = 2.0
    retry_down_after_s: float = 2.0

    def size_range_text(self) -> str:
        return (f"width and height must be multiples of 32 between {self.min_side} and "
                f"{self.max_side}, at most {self.max_pixels} pixels")


def _env(name: str, default=None):
    return os.environ.get(name, default)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway.server",
                                description="u1serve public OpenAI-compatible gateway")
    p.add_argument("--host", default=_env("U1SERVE_GATEWAY_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(_env("U1SERVE_GATEWAY_PORT", "8000")))
    p.add_argument("--und-url", action="append", default=None,
                   help="understanding endpoint (repeat or comma-separate for several); "
                        "env U1SERVE_UND_URLS")
    p.add_argument("--gen-url", action="append", default=None,
                   help="generation endpoint (repeat or comma-separate); env U1SERVE_GEN_URLS")
    p.add_argument("--model-name", default=_env("U1SERVE_MODEL_NAME", "sensenova-u1"))
    p.add_argument("--api-key", default=_env("U1SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*; env U1SERVE_API_KEY")
    p.add_argument("--internal-token", default=_env("U1SERVE_INTERNAL_TOKEN"))
    p.add_argument("--default-size", default=_env("U1SERVE_DEFAULT_SIZE", "2048x2048"))
    p.add_argument("--default-steps", type=int, default=int(_env("U1SERVE_DEFAULT_STEPS", "50")))
    p.add_argument("--default-guidance", type=float,
                   default=float(_env("U1SERVE_DEFAULT_GUIDANCE", "4.0")))
    p.add_argument("--default-timestep-shift", type=float,
                   default=float(_env("U1SERVE_DEFAULT_TIMESTEP_SHIFT", "3.0")))
    p.add_argument("--min-side", type=int, default=int(_env("U1SERVE_MIN_SIDE", "32")))
    p.add_argument("--max-side", type=int, default=int(_env("U1SERVE_MAX_SIDE", "4096")))
    p.add_argument("--max-pixels", type=int, default=int(_env("U1SERVE_MAX_PIXELS", str(4096 * 4096))))
    p.add_argument("--max-steps", type=int, default=int(_env("U1SERVE_MAX_STEPS", "200")))
    p.add_argument("--max-prompt-chars", type=int,
                   default=int(_env("U1SERVE_MAX_PROMPT_CHARS", "16384")))
    p.add_argument("--max-body-mb", type=float, default=float(_env("U1SERVE_MAX_BODY_MB", "32")))
    p.add_argument("--log-level", default=_env("U1SERVE_LOG_LEVEL", "info"))
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    und = args.und_url or [_env("U1SERVE_UND_URLS", "http://127.0.0.1:8100")]
    gen = args.gen_url or [_env("U1SERVE_GEN_URLS", "http://127.0.0.1:8200")]
    return GatewayConfig(
        und_urls=[u for item in und for u in _split_urls(item)],
        gen_urls=[u for item in gen for u in _split_urls(item)],
        model_name=args.model_name,
        api_key=args.api_key or None,
        internal_token=args.internal_token or None,
        default_size=parse_size(args.default_size),
        default_steps=args.default_steps,
        default_guidance=args.default_guidance,
        default_timestep_shift=args.default_timestep_shift,
        min_side=args.min_side,
        max_side=args.max_side,
        max_pixels=args.max_pixels,
        max_steps=args.max_steps,
        max_prompt_chars=args.max_prompt_chars,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
    )
