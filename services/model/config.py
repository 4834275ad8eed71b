"""Parse the official `neo_chat` config.json (with its quirks) into plain dataclasses."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Top-level keys the official model cannot be built without (model_spec.md section 12.8).
REQUIRED_TOP_LEVEL = (
    "template", "use_pixel_head", "fm_head_layers", "concat_time_token_num", "noise_scale_mode",
    "noise_scale", "noise_scale_base_image_seq_len", "noise_scale_max_value",
    "add_noise_scale_embedding", "time_schedule", "time_shift_type", "base_shift", "max_shift",
    "base_image_seq_len", "max_image_seq_len",
)


class ConfigError(ValueError):
    """The checkpoint's config.json is missing something or contradicts itself."""


def _scalar(value: Any) -> Any:
    # NEOVisionConfig stores some fields as 1-tuples (lists once saved to JSON).
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    return value


@dataclass(frozen=True)
class LLMConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_theta_hw: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    is_moe: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    gen_num_experts: int = 0
    gen_num_experts_per_tok: int = 0
    gen_moe_intermediate_size: int = 0
    eos_token_id: int | None = None


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    llm_hidden_size: int
    patch_size: int
    num_channels: int
    downsample_ratio: float
    rope_theta: float
    max_position_embeddings: int


@dataclass(frozen=True)
class NeoConfig:
    llm: LLMConfig
    vision: VisionConfig
    template: str
    use_pixel_head: bool
    fm_head_layers: int
    downsample_ratio: float
    patch_size: int
    noise_scale_mode: str
    noise_scale: float
    noise_scale_base_image_seq_len: float
    noise_scale_max_value: float
    add_noise_scale_embedding: bool
    raw: dict = field(repr=False, compare=False, hash=False, default_factory=dict)

    @property
    def family(self) -> str:
        if self.llm.is_moe:
            return "a3b"
        return "u1.5" if self.use_pixel_head else "u1"

    @property
    def merge_size(self) -> int:
        return int(round(1 / self.downsample_ratio))

    @property
    def token_pixels(self) -> int:
        """Side in pixels of the block one LLM token covers (32)."""
        return self.patch_size * self.merge_size

    @property
    def fingerprint(self) -> str:
        """Identifies the architecture (what the KV layout depends on); weights add their own part."""
        blob = json.dumps(self.raw, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _is_moe(llm: dict) -> bool:
    names = " ".join(llm.get("architectures") or [])
    return ("moe" in str(llm.get("model_type", "")).lower() or "Moe" in names or "MoE" in names
            or int(llm.get("num_experts") or 0) > 1)


def _rope_theta(llm: dict) -> float:
    if "rope_theta" in llm and llm["rope_theta"] is not None:
        return float(llm["rope_theta"])
    # Transformers 5 moves rope_theta into rope_parameters; restore it (legacy field).
    params = llm.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    raise ConfigError("llm_config has neither rope_theta nor rope_parameters.rope_theta")


def parse_config(d: dict) -> NeoConfig:
    if d.get("model_type") not in (None, "neo_chat"):
        raise ConfigError(f"model_type is {d.get('model_type')!r}, expected 'neo_chat'")
    missing = [k for k in REQUIRED_TOP_LEVEL if k not in d]
    if missing:
        raise ConfigError(f"config.json lacks required keys: {', '.join(missing)}")
    if "llm_config" not in d or "vision_config" not in d:
        raise ConfigError("config.json needs llm_config and vision_config")
    if int(d["concat_time_token_num"]) != 0:
        raise ConfigError("concat_time_token_num must be 0 (as upstream asserts)")
    llm = d["llm_config"]
    moe = _is_moe(llm)
    hidden = int(llm["hidden_size"])
    heads = int(llm["num_attention_heads"])
    head_dim = int(llm.get("head_dim") or hidden // heads)
    if head_dim % 4:
        raise ConfigError(f"head_dim {head_dim} must split into t / h / w parts (multiple of 4)")
    llm_cfg = LLMConfig(
        hidden_size=hidden,
        intermediate_size=int(llm.get("intermediate_size") or 0),
        num_hidden_layers=int(llm["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(llm.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(llm["vocab_size"]),
        rms_norm_eps=float(llm.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(llm),
        rope_theta_hw=float(llm.get("rope_theta_hw", 10000.0)),
        max_position_embeddings=int(llm.get("max_position_embeddings", 262144)),
        tie_word_embeddings=bool(llm.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
        is_moe=moe,
        num_experts=int(llm.get("num_experts") or 0) if moe else 0,
        num_experts_per_tok=int(llm.get("num_experts_per_tok") or 8) if moe else 0,
        moe_intermediate_size=int(llm.get("moe_intermediate_size") or 768) if moe else 0,
        norm_topk_prob=bool(llm.get("norm_topk_prob", True)),
        gen_num_experts=int(llm.get("gen_num_experts") or 32) if moe else 0,
        gen_num_experts_per_tok=int(llm.get("gen_num_experts_per_tok") or 8) if moe else 0,
        gen_moe_intermediate_size=int(llm.get("gen_moe_intermediate_size") or 768) if moe else 0,
        eos_token_id=llm.get("eos_token_id"),
    )
    if moe and llm.get("mlp_only_layers"):
        raise ConfigError("mlp_only_layers is not supported (every released A3B layer is sparse)")
    v = d["vision_config"]
    llm_hidden = _scalar(v.get("llm_hidden_size"))
    # Upstream silently defaults a missing llm_hidden_size to 2048, wrong for 8B: use the LLM width.
    llm_hidden = int(llm_hidden) if llm_hidden is not None else hidden
    if llm_hidden != hidden:
        raise ConfigError(f"vision_config.llm_hidden_size {llm_hidden} != llm hidden_size {hidden}")
    vis = VisionConfig(
        hidden_size=int(v["hidden_size"]),
        llm_hidden_size=llm_hidden,
        patch_size=int(v.get("patch_size", d.get("patch_size", 16))),
        num_channels=int(v.get("num_channels", 3)),
        downsample_ratio=float(_scalar(v.get("downsample_ratio", d.get("downsample_ratio", 0.5)))),
        rope_theta=float(v.get("rope_theta_vision", 10000.0)),
        max_position_embeddings=int(v.get("max_position_embeddings_vision", 10000)),
    )
    if vis.hidden_size % 4:
        raise ConfigError("vision hidden_size must be a multiple of 4 (2-D RoPE pairs)")
    if int(d["fm_head_layers"]) > 2 and not d["use_pixel_head"]:
        raise ConfigError("fm_head_layers > 2 (FlowMatchingHead) is unused upstream and not supported")
    return NeoConfig(
        llm=llm_cfg,
        vision=vis,
        template=str(d["template"]),
        use_pixel_head=bool(d["use_pixel_head"]),
        fm_head_layers=int(d["fm_head_layers"]),
        downsample_ratio=float(_scalar(d.get("downsample_ratio", 0.5))),
        patch_size=int(d.get("patch_size", vis.patch_size)),
        noise_scale_mode=str(d["noise_scale_mode"]),
        noise_scale=float(d["noise_scale"]),
        noise_scale_base_image_seq_len=float(d["noise_scale_base_image_seq_len"]),
        noise_scale_max_value=float(d["noise_scale_max_value"]),
        add_noise_scale_embedding=bool(d["add_noise_scale_embedding"]),
        raw=d,
    )


def load_config(model_dir: str | os.PathLike) -> NeoConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {model_dir}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return parse_config(d)
