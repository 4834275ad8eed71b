"""Flow-matching sampler: timestep grid, noise, CFG rules, Euler step (model_spec.md section 6)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 32  # pixels per token side


@dataclass(frozen=True)
class Sampling:
    """The values a denoise loop reads. The engines convert the request contract's SamplerParams at their
    boundary (`Sampling.of`); `branches` is what the contract's CFG-branch rule (Guidance.branches) chose."""
    branches: tuple[str, ...]              # the CFG prefixes, cond first
    mode: str                              # "t2i" | "edit": which CFG interval rule applies (uses_cfg)
    guidance_scale: float
    image_guidance_scale: float
    cfg_norm: str                          # "none" | "global" | "channel" | "cfg_zero_star"
    cfg_interval: tuple[float, float]
    num_inference_steps: int
    timestep_shift: float
    t_eps: float

    @classmethod
    def of(cls, params) -> "Sampling":
        """From an object with these fields and a `branches()` method (the contract's SamplerParams)."""
        if isinstance(params, cls):
            return params
        names = [f.name for f in dataclasses.fields(cls) if f.name != "branches"]
        return cls(branches=tuple(params.branches()), **{n: getattr(params, n) for n in names})

    def with_interval(self, interval: tuple[float, float]) -> "Sampling":
        return dataclasses.replace(self, cfg_interval=tuple(interval))


def timesteps(num_inference_steps: int, shift: float, device=None) -> torch.Tensor:
    """fp32 grid from 0 (noise) to 1 (clean), shifted: sigma' = S*sigma / (1 + (S-1)*sigma)."""
    t = torch.linspace(0.0, 1.0, num_inference_steps + 1, device=device)
    sigma = 1 - t
    sigma = shift * sigma / (1 + (shift - 1) * sigma)
    return 1 - sigma


def noise_scale(cfg, num_tokens: int) -> float:
    s = float(cfg.noise_scale)
    if cfg.noise_scale_mode in ("resolution", "dynamic", "dynamic_sqrt"):
        s = math.sqrt(num_tokens / float(cfg.noise_scale_base_image_seq_len)) * float(cfg.noise_scale)
        if cfg.noise_scale_mode == "dynamic_sqrt":
            s = math.sqrt(s)
    return min(s, float(cfg.noise_scale_max_value))


def initial_noise(n: int, height: int, width: int, seed: int, device, dtype, scale: float,
                  draws: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """One draw for the whole batch from a fresh generator on the model's device (as upstream). `draws`: the
    (width, height) of draws taken before this one: an interleaved answer's k-th image follows the draws of its
    k earlier images, each at its own size (the official interleave_gen draws from one generator in sequence)."""
    g = torch.Generator(device=device).manual_seed(int(seed))
    for w, h in draws:
        torch.randn((n, 3, h, w), device=device, dtype=dtype, generator=g)
    return scale * torch.randn((n, 3, height, width), device=device, dtype=dtype, generator=g)


def patchify(x: torch.Tensor, p: int = BLOCK) -> torch.Tensor:
    """[B, 3, H, W] -> [B, N, p*p*3], blocks row-major, (row, col, channel) inside a block."""
    B, C, H, W = x.shape
    h, w = H // p, W // p
    return x.reshape(B, C, h, p, w, p).permute(0, 2, 4, 3, 5, 1).reshape(B, h * w, p * p * C)


def unpatchify(z: torch.Tensor, th: int, tw: int, p: int = BLOCK) -> torch.Tensor:
    B = z.shape[0]
    return z.reshape(B, th, tw, p, p, 3).permute(0, 5, 1, 3, 2, 4).reshape(B, 3, th * p, tw * p)


def velocity(x_hat: torch.Tensor, z: torch.Tensor, t: torch.Tensor, t_eps: float) -> torch.Tensor:
    return (x_hat - z) / (1 - t).clamp_min(t_eps)


def _optimized_scale(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    pos = pos.reshape(pos.shape[0], -1).float()
    neg = neg.reshape(neg.shape[0], -1).float()
    return (pos * neg).sum(1, keepdim=True) / ((neg ** 2).sum(1, keepdim=True) + 1e-8)


def _renorm(v: torch.Tensor, v_cond: torch.Tensor, how: str) -> torch.Tensor:
    dims = (1, 2) if how == "global" else -1
    n_c = torch.norm(v_cond, dim=dims, keepdim=True)
    n_v = torch.norm(v, dim=dims, keepdim=True)
    return v * (n_c / (n_v + 1e-8)).clamp(min=0, max=1.0)


def uses_cfg(p: Sampling, t: float) -> bool:
    lo, hi = p.cfg_interval
    if p.mode == "t2i":
        return p.guidance_scale > 1 and lo <= t <= hi  # inclusive (T2I)
    return (lo < t < hi) or lo == 0  # editing rule


def combine(v: dict, p: Sampling, step_index: int, t: float) -> torch.Tensor:
    """CFG combination of the per-branch velocities {branch: [B, N, 3072]}: the branches given pick the formula
    (which branches a request has is the contract's Guidance.branches rule; outside the interval only cond)."""
    vc = v["cond"]
    if len(v) == 1 or not uses_cfg(p, t):
        return vc
    g, gi = p.guidance_scale, p.image_guidance_scale
    if "img_cond" not in v:          # text CFG: text-to-image, or an edit whose two scales agree
        vu = v["uncond"]
        if p.cfg_norm == "cfg_zero_star":   # text-to-image only (the contract refuses it for edits)
            if step_index <= 0:
                return vc * 0.0
            alpha = _optimized_scale(vc, vu).view(vc.shape[0], 1, 1).to(vc.dtype)
            return vu * alpha + g * (vc - vu * alpha)
        out = vu + g * (vc - vu)
    elif "uncond" not in v:          # an edit without image CFG
        out = v["img_cond"] + g * (vc - v["img_cond"])
    else:                            # an edit with text and image CFG
        out = v["uncond"] + g * (vc - v["img_cond"]) + gi * (v["img_cond"] - v["uncond"])
    if p.cfg_norm in ("global", "channel") and (g > 1 or gi > 1):
        out = _renorm(out, vc, p.cfg_norm)
    return out


def euler(z: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
    return z + (t_next - t) * v


class FlowMatchEuler:
    """One job's timestep grid and where it is on it: the sampler side of a denoise loop (the CFG rule,
    `combine`, is the loop's). `step` is the Euler step from the current timestep to the next, then moves on;
    a job whose transition is computed elsewhere (RL's SDE steps) calls `advance` instead."""

    def __init__(self, num_steps: int, shift: float, device=None):
        self.num_steps = num_steps
        self.grid = timesteps(num_steps, shift, device=device)
        self.grid_host = self.grid.tolist()      # host copies: the CFG rule needs no device sync
        self.index = 0

    @property
    def t(self) -> torch.Tensor:
        return self.grid[self.index]

    @property
    def t_next(self) -> torch.Tensor:
        return self.grid[self.index + 1]

    @property
    def t_host(self) -> float:
        return self.grid_host[self.index]

    @property
    def done(self) -> bool:
        return self.index >= self.num_steps

    def step(self, z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        z_next = euler(z, v, self.t, self.t_next)
        self.index += 1
        return z_next

    def advance(self) -> None:
        self.index += 1


def to_uint8_device(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] image tensor -> contiguous uint8 [B, H, W, 3] on x's device (x*0.5+0.5, clamp, *255,
    round)."""
    y = (x.float() * 0.5 + 0.5).clamp(0, 1) * 255
    return y.round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor on the host: one copy into pinned memory (torch's caching host allocator)."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] image tensor -> uint8 [B, H, W, 3] on the host."""
    return to_host(to_uint8_device(x))
