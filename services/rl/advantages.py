"""Group-relative advantages (rl_spec §2.5, §3, §4). Rewards are [P, G]: P prompts, G samples each.

- Flow-GRPO (`flow_grpo`): (R - mean over the prompt's group) / (std + 1e-4), the std global over the whole
  batch (the shipped configs' `global_std=True`) or per prompt; clipped to +-adv_clip.
- DanceGRPO (`dance_grpo`): per group mean and unbiased std + 1e-8; clipped to +-adv_clip.
- MixGRPO (`mix_grpo`): every named reward is normalised inside its group separately, then summed with its
  weight (`advantage_aggr`): one advantage per sample for its think tokens and its image transitions.
"""
from __future__ import annotations

import torch

ADV_CLIP = 5.0


def flow_grpo(rewards: torch.Tensor, global_std: bool = True, adv_clip: float = ADV_CLIP) -> torch.Tensor:
    r = rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(unbiased=False) if global_std else r.std(dim=1, keepdim=True, unbiased=False)
    return (centred / (std + 1e-4)).clamp(-adv_clip, adv_clip)


def dance_grpo(rewards: torch.Tensor, adv_clip: float = ADV_CLIP) -> torch.Tensor:
    r = rewards.float()
    std = r.std(dim=1, keepdim=True, unbiased=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
    return ((r - r.mean(dim=1, keepdim=True)) / (std + 1e-8)).clamp(-adv_clip, adv_clip)


def mix_grpo(rewards: dict[str, torch.Tensor], weights: dict[str, float], adv_clip: float = ADV_CLIP) -> torch.Tensor:
    """sum_m w_m * A_m, each A_m group-normalised (dance_grpo's normalisation) -> [P, G]."""
    out = None
    for name, r in rewards.items():
        a = weights.get(name, 1.0) * dance_grpo(r, adv_clip=float("inf"))
        out = a if out is None else out + a
    return out.clamp(-adv_clip, adv_clip)


def active_samples(advantages: torch.Tensor) -> torch.Tensor:
    """Samples whose advantage is not zero (a zero-variance group teaches nothing; Flow-GRPO masks them)."""
    return advantages.abs() > 0
