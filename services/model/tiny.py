"""Tiny official-schema checkpoints (random weights, real key names and config schema) and full-size
configs, so every path can be tested on CPU and benchmarked on GPU without downloading weights."""
from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import save_file

from services.base.checkpoint_names import INDEX_FILE

from .config import parse_config
from .model import NeoModel
from .skeleton import skeleton
from .moe import checkpoint_views
from .tokenizer import byte_unicode as _byte_unicode

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<IMG_CONTEXT>",
                  "<img>", "</img>"]
_NON_SPECIAL = {"<think>", "</think>"}  # as in Qwen3: plain added tokens

_TOP = {
    "architectures": ["NEOChatModel"], "model_type": "neo_chat", "template": "neo1_0", "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "use_backbone_lora": 0, "use_llm_lora": 0, "downsample_ratio": 0.5,
    "patch_size": 16, "min_pixels": 65536, "max_pixels": 16777216, "use_pixel_head": False,
    "fm_head_layers": 2, "fm_head_dim": 1536, "fm_head_mlp_ratio": 1.0, "use_adaLN": False,
    "concat_time_token_num": 0, "extra_num_layers_post": 0, "noise_scale_mode": "resolution", "noise_scale": 1.0,
    "noise_scale_base_image_seq_len": 64, "noise_scale_max_value": 8.0, "add_noise_scale_embedding": True,
    "time_schedule": "standard", "time_shift_type": "exponential", "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 64, "max_image_seq_len": 4096, "timestep_shift": 1.0, "t_eps": 0.05,
    "P_mean": -0.8, "P_std": 0.8,
}
_LLM_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 42, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "rope_theta_hw": 10000.0,
    "rope_scaling": None, "max_position_embeddings": 262144, "max_position_embeddings_hw": 10000,
    "vocab_size": 151936, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "bos_token_id": 151643, "eos_token_id": 151645,
    "pad_token_id": 151643, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
}
_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "gen_num_experts": 32, "gen_num_experts_per_tok": 8, "gen_moe_intermediate_size": 768,
}
_VISION = {
    "architectures": ["NEOVisionModel"], "model_type": "neo_vision", "hidden_size": 1024, "llm_hidden_size": 4096,
    "patch_size": 16, "num_channels": 3, "downsample_ratio": 0.5, "rope_theta_vision": 10000.0,
    "max_position_embeddings_vision": 10000, "min_pixels": 65536, "max_pixels": 4194304, "torch_dtype": "bfloat16",
}

VARIANTS = ("u1", "u1.5", "a3b")
FULL_VARIANTS = ("u1-8b", "u1.5-8b", "a3b-full")


def _finish(top: dict, llm: dict, vision: dict) -> dict:
    llm["layer_types"] = ["full_attention"] * llm["num_hidden_layers"]
    llm["max_window_layers"] = llm["num_hidden_layers"]
    vision["llm_hidden_size"] = llm["hidden_size"]
    return {**top, "llm_config": llm, "vision_config": vision}


def full_config(variant: str) -> dict:
    """The real full-size config of a released family (values from model_spec.md section 1)."""
    top, llm, vision = copy.deepcopy(_TOP), copy.deepcopy(_LLM_8B), copy.deepcopy(_VISION)
    if variant == "u1.5-8b":
        top.update(use_pixel_head=True, noise_scale_max_value=16.0)
    elif variant == "a3b-full":
        llm.update(_MOE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_key_value_heads=4,
                   rope_theta=10000000.0)
    elif variant != "u1-8b":
        raise ValueError(f"variant must be one of {FULL_VARIANTS}")
    return _finish(top, llm, vision)


def tiny_config(variant: str, **llm_config) -> dict:
    """The tiny geometry of `variant`; `llm_config`: values of llm_config to change (a test's own geometry)."""
    top, llm, vision = copy.deepcopy(_TOP), copy.deepcopy(_LLM_8B), copy.deepcopy(_VISION)
    llm.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=len(SPECIAL_TOKENS) + 256,
               bos_token_id=256, eos_token_id=258, pad_token_id=256)
    vision.update(hidden_size=32)
    if variant == "u1.5":
        top.update(use_pixel_head=True, noise_scale_max_value=16.0)
    elif variant == "a3b":
        llm.update(_MOE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, gen_num_experts=4,
                   gen_num_experts_per_tok=2, gen_moe_intermediate_size=32, rope_theta=10000000.0)
    elif variant != "u1":
        raise ValueError(f"variant must be one of {VARIANTS}")
    llm.update(llm_config)
    return _finish(top, llm, vision)


def write_tokenizer(out_dir: str) -> None:
    """A byte-level tokenizer (id = byte value) plus the real special tokens at ids 256..263."""
    vocab = {ch: b for b, ch in sorted(_byte_unicode().items())}
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t not in _NON_SPECIAL} for i, t in enumerate(SPECIAL_TOKENS)]
    split = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<IMG_CONTEXT>", "<img>", "</img>"],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": 32768, "split_special_tokens": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


@torch.no_grad()
def random_init_(model: NeoModel, seed: int = 0, std: float = 0.02) -> NeoModel:
    """Deterministic random weights: normal(std) for matrices, ~1 for norm weights, small biases."""
    g = torch.Generator().manual_seed(seed)
    for name, p in checkpoint_views(model.named_parameters()):   # the official key order (experts one by one)
        if p.dim() == 1 and "norm" in name:
            vals = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif p.dim() == 1:
            vals = 0.02 * torch.randn(p.shape, generator=g)
        else:
            vals = std * torch.randn(p.shape, generator=g)
        p.copy_(vals.to(p.dtype))
    return model


def build_random_model(config: dict, branch: str = "both", dtype=torch.bfloat16, device="cpu", seed: int = 0,
                       tp=None, quantization: str = "none", quant_branches=("gen",),
                       layer_done=None) -> NeoModel:
    """A model of any geometry with random weights, built directly on `device` (for benchmarks). `quantization`
    ("fp8" / "int8"): the layers of `quant_branches` quantised one decoder layer at a time as they are made
    (layerwise_load.py: the device never holds all of their float weights), the same values as quantising after.
    `layer_done(layer)`: called as each decoder layer is complete (weight streaming moves it to host memory, so the
    device never holds every layer: a streamed 24 GiB plan would not fit them)."""
    cfg = parse_config(config)
    model = skeleton(cfg, branch, tp)
    model = model.to(dtype)     # dtype on meta: no fp32 copy (A3B und is 61 GB in bf16)
    g = torch.Generator(device=device).manual_seed(seed)
    names = [n for n, _ in model.named_parameters()]
    layerwise = None
    if quantization != "none" or layer_done is not None:
        from .layerwise_load import LayerwiseQuantizer
        layerwise = LayerwiseQuantizer(model, names, quant_branches, None if quantization == "none" else quantization,
                                       device, done=layer_done)
    state = {}
    with torch.no_grad():
        for name, p in list(model.named_parameters()):  # fast on-device init; values are irrelevant for timing
            t = torch.empty(p.shape, dtype=dtype, device=device)
            if t.dim() > 1:
                t.normal_(0, 0.02, generator=g)
            else:
                t.fill_(1.0)
            state[name] = t
            del t
            if layerwise is not None:
                layerwise.placed(name, state)
    if layerwise is not None:
        layerwise.finish(state)
    else:
        model.load_state_dict(state, strict=True, assign=True)
    model.fingerprint = cfg.fingerprint
    model.requires_grad_(False)
    return model.eval()


def write_tiny_checkpoint(out_dir: str, variant: str = "u1", seed: int = 0, num_shards: int = 2,
                          **llm_config) -> str:
    """`llm_config`: tiny_config's changes to the geometry."""
    config = tiny_config(variant, **llm_config)
    cfg = parse_config(config)
    model = random_init_(NeoModel(cfg, "both"), seed)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in checkpoint_views(model.named_parameters())}
    return write_checkpoint(out_dir, config, state, num_shards)


def write_checkpoint(out_dir: str, config: dict, state: dict, num_shards: int = 2) -> str:
    """`state` {checkpoint key: tensor} as `num_shards` safetensors files with their index, config.json and the
    tiny tokenizer, in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    keys = sorted(state)
    shards = [keys[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    for i, shard_keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: state[k] for k in shard_keys}, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard_keys})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(out_dir)
    return out_dir


def write_full_config(out_dir: str, variant: str = "u1-8b") -> str:
    """Full-size config + the byte-level tokenizer (its ids fit any vocab), no weights: serve it with
    U1SERVE_RANDOM_WEIGHTS=1 to benchmark the real geometry."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(full_config(variant), f, indent=2)
    write_tokenizer(out_dir)
    return out_dir
