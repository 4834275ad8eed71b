"""`u1serve tiny-lora DIR`: a small random LoRA adapter for a checkpoint (the tiny one by default), in the PEFT
layout (adapter_model.safetensors + adapter_config.json) or the official one (one file of lora_down / lora_up /
alpha): for tests and demos of multi-LoRA serving (docs/lora.md)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from .config import load_config

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SUFFIX = {"und": "", "gen": "_mot_gen"}


def lora_modules(cfg, branches=("und", "gen")) -> dict[str, tuple[int, int]]:
    """Every LoRA target module of a dense checkpoint -> (out, in) features of its weight."""
    llm = cfg.llm
    if llm.is_moe:
        raise ValueError("tiny-lora writes adapters for dense checkpoints (the MoE experts are no LoRA target)")
    h, d, inter = llm.hidden_size, llm.head_dim, llm.intermediate_size
    shapes = {"q_proj": (llm.num_attention_heads * d, h), "k_proj": (llm.num_key_value_heads * d, h),
              "v_proj": (llm.num_key_value_heads * d, h), "o_proj": (h, llm.num_attention_heads * d),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    out = {}
    for i in range(llm.num_hidden_layers):
        for b in branches:
            sfx = SUFFIX[b]
            for m in ATTN:
                out[f"language_model.model.layers.{i}.self_attn.{m}{sfx}"] = shapes[m]
            for m in MLP:
                out[f"language_model.model.layers.{i}.mlp{sfx}.{m}"] = shapes[m]
    return out


def write_tiny_lora(out: str, model_dir: str, rank: int = 4, alpha: float = 8.0, seed: int = 0,
                    branches=("und", "gen"), layout: str = "peft", std: float = 0.3) -> str:
    """Write the adapter; returns the path to serve (the PEFT directory, or the official .safetensors file)."""
    g = torch.Generator().manual_seed(seed)
    mods = lora_modules(load_config(model_dir), branches)
    tensors = {}
    for name, (o, i) in sorted(mods.items()):
        down = std * torch.randn(rank, i, generator=g)
        up = std * torch.randn(o, rank, generator=g)
        if layout == "peft":
            tensors[f"base_model.model.{name}.lora_A.weight"] = down
            tensors[f"base_model.model.{name}.lora_B.weight"] = up
        else:
            tensors[f"{name}.lora_down.weight"] = down
            tensors[f"{name}.lora_up.weight"] = up
            tensors[f"{name}.alpha"] = torch.tensor(alpha)
    if layout == "official":
        path = out if out.endswith(".safetensors") else out + ".safetensors"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_file(tensors, path)
        return path
    if layout != "peft":
        raise ValueError(f"layout must be peft or official, got {layout!r}")
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    targets = sorted({n.rsplit(".", 1)[-1] for n in mods})
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
                   "base_model_name_or_path": os.path.abspath(model_dir)}, f, indent=2)
    return out
