"""Sampling presets of released checkpoints and adapters (`u1serve up --preset NAME`).

8step: the official 8-step distillation (SenseNova-U1-8B-MoT-LoRA-8step-V1.0 merged into the base
model, or the SenseNova-U1-8B-MoT-8step-preview checkpoint): 8 steps, guidance 1.0 (one CFG branch),
timestep shift 3.0, cfg_norm none — the settings of every 8-step command in the official repository,
OpenSenseNova/SenseNova-U1 `docs/base_vs_distill.md` ("--cfg_scale 1.0 --cfg_norm none
--timestep_shift 3.0 --num_steps 8").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    num_inference_steps: int
    guidance_scale: float
    timestep_shift: float
    cfg_norm: str
    note: str


PRESETS = {
    "8step": Preset(num_inference_steps=8, guidance_scale=1.0, timestep_shift=3.0, cfg_norm="none",
                    note="merge the 8-step LoRA (--lora SenseNova-U1-8B-MoT-LoRA-8step-V1.0.safetensors) "
                         "or serve the 8step-preview checkpoint"),
}
