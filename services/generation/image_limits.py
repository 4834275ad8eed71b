"""The largest image a checkpoint was trained for: the generation service reports it (/health) and
refuses larger requests, so the gateway can refuse them before any prefill.

Read from the checkpoint's own config: with the resolution-dependent noise scale
s = min(noise_scale * sqrt(N / base), cap), the cap is reached exactly at the trained maximum
(model_spec.md 6.3: U1 and A3B cap 8 -> N = 4096 tokens = 2048²; U1.5 cap 16 -> 16,384 = 4096²).
The limit is on tokens (area), not sides: U1's own buckets include 3456x1152 (3888 tokens).
"""
from __future__ import annotations

from services.contract import limits as L

_FAMILY_MAX_SIDE = {"u1": 2048, "a3b": 2048, "u1.5": 4096}   # configs without a resolution schedule


def max_image_tokens(cfg) -> int:
    """Image tokens (32x32 px each) per image the checkpoint was trained for."""
    ceiling = (L.MAX_IMAGE_SIDE // L.IMAGE_BLOCK) ** 2
    if cfg.noise_scale_mode == "resolution" and cfg.noise_scale > 0:
        tokens = cfg.noise_scale_base_image_seq_len * (cfg.noise_scale_max_value / cfg.noise_scale) ** 2
        return max(1, min(ceiling, int(round(tokens))))
    side = _FAMILY_MAX_SIDE.get(cfg.family, 2048)
    return min(ceiling, (side // L.IMAGE_BLOCK) ** 2)


def checkpoint_max_tokens(model_dir: str) -> int:
    """`max_image_tokens` of a checkpoint directory (cheap: config.json only, no torch). A config that
    does not load gives the contract's ceiling: the engine reports the broken checkpoint itself."""
    from services.model.config import ConfigError, load_config
    try:
        return max_image_tokens(load_config(model_dir))
    except (ConfigError, OSError, KeyError, TypeError, ValueError):
        return (L.MAX_IMAGE_SIDE // L.IMAGE_BLOCK) ** 2


def size_error(width: int, height: int, max_tokens: int) -> str | None:
    """A message for a size over the limit (None if it fits)."""
    tokens = (width // L.IMAGE_BLOCK) * (height // L.IMAGE_BLOCK)
    if tokens <= max_tokens:
        return None
    side = int(max_tokens ** 0.5) * L.IMAGE_BLOCK
    return (f"{width}x{height} is {tokens} image tokens; this model was trained up to {max_tokens} "
            f"({side}x{side} or the same area at another aspect ratio)")
