"""The SDE form of the flow sampler for RL (docs/rl.md; rl_spec §2-§4), in SenseNova-U1's own convention.

t runs 0 (noise) -> 1 (clean); the state z is pixels [B, 3, H, W] with initial noise s*eps; v is the guided (CFG)
velocity; the ODE (Euler) step is z' = z + dt*v. One transition k (t = t_k, t' = t_{k+1}, dt = t' - t) of kind:

- ``flow`` (Flow-GRPO, marginal-preserving): t~ = t if t > 0 else t_1, g = a*sqrt((1-t)/t~), n = z - t*v,
  mean = z + dt*v - (a^2*dt / (2 t~))*n, std = s*g*sqrt(dt);
- ``dance`` (DanceGRPO, constant eta = a): mean = z + dt*v - (a^2*dt / (2 max(1-t, t_eps)))*n, std = s*a*sqrt(dt);
- ``cps`` (coefficient-preserving): x^ = z + (1-t)*v, mean = t'*x^ + (1-t')*|cos(a*pi/2)|*n,
  std = s*(1-t')*sin(a*pi/2).

log p(z'|z) is the MEAN over a sample's elements of the Gaussian log-density
-(z'-mean)^2/(2 std^2) - log std - 0.5 log(2 pi) (Flow-GRPO's reduction); for ``cps`` it is -mean((z'-mean)^2)
without constants (Flow-GRPO's and SGLang's convention: ratios of it are not likelihood ratios).

Everything is computed in fp32 (bf16 overflows here), pure torch and differentiable in v: the generation engine
uses it for rollout and scoring, the trainers for their differentiable recomputation. std does not depend on v.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

SDE_KINDS = ("flow", "dance", "cps")
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _f32(x) -> torch.Tensor:
    return x.float() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float32)


def sde_mean_std(kind: str, z: torch.Tensor, v: torch.Tensor, t, t_next, t1, noise_level: float,
                 noise_scale: float, t_eps: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the transition z -> z' at step t -> t_next (fp32). `t1` is the grid's second value (the
    guard that replaces t = 0 in flow's 1/t); std is a 0-dim tensor (the same for every element)."""
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r} (one of {', '.join(SDE_KINDS)})")
    z, v = z.float(), v.float()
    t, t_next, t1 = _f32(t), _f32(t_next), _f32(t1)
    a, s = float(noise_level), float(noise_scale)
    dt = t_next - t
    n_hat = z - t * v
    if kind == "flow":
        t_tilde = torch.where(t > 0, t, t1)
        g = a * torch.sqrt((1 - t) / t_tilde)
        mean = z + dt * v - (a * a * dt / (2 * t_tilde)) * n_hat
        std = s * g * torch.sqrt(dt)
    elif kind == "dance":
        mean = z + dt * v - (a * a * dt / (2 * (1 - t).clamp_min(t_eps))) * n_hat
        std = s * a * torch.sqrt(dt)
    else:
        x_hat = z + (1 - t) * v
        mean = t_next * x_hat + (1 - t_next) * abs(math.cos(a * math.pi / 2)) * n_hat
        std = s * (1 - t_next) * math.sin(a * math.pi / 2)
    return mean, std


def transition_logprob(kind: str, z_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample log p(z_next | mean, std): the mean over every non-batch element -> [B] fp32."""
    diff = z_next.float() - mean.float()
    return _reduce(kind, diff * diff, std)


def _reduce(kind: str, sq: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    per = sq.reshape(sq.shape[0], -1).mean(dim=1)
    if kind == "cps":
        return -per
    std = _f32(std)
    return -per / (2 * std * std) - torch.log(std) - LOG_SQRT_2PI


def sde_step(kind: str, z: torch.Tensor, v: torch.Tensor, t, t_next, t1, noise_level: float, noise_scale: float,
             t_eps: float = 0.02, generator: Optional[torch.Generator | Sequence[torch.Generator]] = None,
             noise: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One stochastic transition: (z_next fp32, log-prob [B]). The noise xi ~ N(0, I) comes from `noise`, or is
    drawn per sample from `generator` (one generator per sample, or one for the batch). The log-prob is evaluated
    from the actual z_next (so scoring the stored z_next reproduces it exactly)."""
    mean, std = sde_mean_std(kind, z, v, t, t_next, t1, noise_level, noise_scale, t_eps)
    if noise is None:
        noise = draw_noise(mean.shape, mean.device, generator)
    z_next = mean + std * noise.float()
    return z_next, transition_logprob(kind, z_next, mean, std)


def draw_noise(shape, device, generator=None) -> torch.Tensor:
    """fp32 N(0, I) of `shape`; a list of generators draws sample b's noise from generator b (per-sample
    determinism whatever the batch composition)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(tuple(shape), device=device, dtype=torch.float32, generator=generator)
    gens = list(generator)
    if len(gens) != shape[0]:
        raise ValueError(f"{len(gens)} generators for a batch of {shape[0]}")
    return torch.stack([torch.randn(tuple(shape[1:]), device=device, dtype=torch.float32, generator=g)
                        for g in gens])


def ode_step(z: torch.Tensor, v: torch.Tensor, t, t_next) -> torch.Tensor:
    """The deterministic Euler step z + dt*v (the sampler's own, in the dtype it is given)."""
    return z + (t_next - t) * v


def sde_step_indices(num_steps: int, window: Optional[tuple[int, int]] = None,
                     steps: Optional[Iterable[int]] = None) -> list[int]:
    """Which of the steps 0..num_steps-1 are stochastic, sorted. Default: every step but the last (the terminal
    transition is never noised, rl_spec §7 N1). `window` = (start, size): MixGRPO's [start, start+size) clipped to
    the steps before the last; `steps`: explicit indices (each in [0, num_steps)). Both given is an error."""
    if num_steps < 1:
        raise ValueError("num_steps must be >= 1")
    if window is not None and steps is not None:
        raise ValueError("give an SDE window or explicit steps, not both")
    if steps is not None:
        out = sorted(set(int(k) for k in steps))
        bad = [k for k in out if not 0 <= k < num_steps]
        if bad:
            raise ValueError(f"SDE step indices {bad} outside [0, {num_steps})")
        return out
    last = max(num_steps - 1, 0)
    if window is not None:
        start, size = int(window[0]), int(window[1])
        if start < 0 or size < 1:
            raise ValueError("an SDE window needs start >= 0 and size >= 1")
        if start >= last:
            raise ValueError(f"the SDE window starts at {start}, past the last noisable step {last - 1}")
        return list(range(start, min(start + size, last)))
    return list(range(last))


def sde_mask(num_steps: int, indices: Iterable[int]) -> torch.Tensor:
    """uint8 [num_steps]: 1 where the step is stochastic."""
    m = torch.zeros(num_steps, dtype=torch.uint8)
    for k in indices:
        m[int(k)] = 1
    return m


__all__ = ["SDE_KINDS", "sde_mean_std", "transition_logprob", "sde_step", "draw_noise", "ode_step",
           "sde_step_indices", "sde_mask"]
