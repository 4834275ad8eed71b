"""PPO-clip losses and the KL to the reference (rl_spec §2.5, §4.1).

Image transitions: the log-probs are per-element means over ~10^3..10^7 pixels, so a ratio exp(lp - lp_old) is a
geometric mean and the clip range is tiny (Flow-GRPO 1e-4 .. 1e-5). Think tokens: token-level PPO with the
usual LLM clip range (0.2), the mean over a sample's tokens. Both use the same group advantage (MixGRPO).

KL: the k3 estimator exp(d) - d - 1 with d = lp_ref - lp_theta on the same per-step log-probs (the stored
transition scored under the frozen reference by the server's /v1/rl/score with weights "reference", and under
the trainer's copy with gradients). It is >= 0, unbiased for KL(pi_theta || pi_ref) when the sample comes from
pi_theta, and 0 with zero gradient before the first update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PPOStats:
    loss: torch.Tensor          # scalar, differentiable
    clipfrac: float             # share of entries whose ratio left [1 - eps_lo, 1 + eps_hi]
    approx_kl: float            # 0.5 * mean((lp - lp_old)^2), to the rollout policy
    ratio_max_err: float        # max |ratio - 1| (exactly 0 on the first pass over a rollout)


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
             clip_high: float | None = None, mask: torch.Tensor | None = None) -> PPOStats:
    """mean over entries of max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)). logp/old_logp [S, K] (steps or
    tokens), advantages [S] (broadcast over K), mask [S, K] bool (entries that count; all by default)."""
    clip_high = clip_low if clip_high is None else clip_high
    old = old_logp.to(logp.dtype).detach()
    ratio = torch.exp(logp - old)
    adv = advantages.to(logp.dtype).detach()[:, None].expand_as(ratio)
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    mask = torch.ones_like(per, dtype=torch.bool) if mask is None else mask
    n = mask.sum().clamp_min(1)
    loss = (per * mask).sum() / n
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)) & mask
        diff = (logp - old) * mask
        return PPOStats(loss, float(clipped.sum() / n), float(0.5 * (diff ** 2).sum() / n),
                        float(((ratio - 1).abs() * mask).max()) if mask.any() else 0.0)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean of exp(d) - d - 1, d = ref_logp - logp (differentiable in logp)."""
    d = ref_logp.to(logp.dtype).detach() - logp
    k3 = torch.exp(d) - d - 1
    if mask is None:
        return k3.mean()
    return (k3 * mask).sum() / mask.sum().clamp_min(1)
