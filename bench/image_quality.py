"""Image similarity against a reference image: PSNR and SSIM (Wang et al. 2004), in torch.

SSIM: 11x11 Gaussian window (sigma 1.5), constants (0.01 L)^2 and (0.03 L)^2 with L = 255, computed per
RGB channel on uint8 values and averaged over the valid (unpadded) positions and the channels.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _as_float(img) -> torch.Tensor:
    """uint8 [H, W, 3] (numpy or torch) -> float64 [1, 3, H, W]."""
    t = torch.as_tensor(img)
    return t.permute(2, 0, 1)[None].double()


def psnr(a, b) -> float:
    mse = (_as_float(a) - _as_float(b)).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def ssim(a, b, window: int = 11, sigma: float = 1.5) -> float:
    x, y = _as_float(a), _as_float(b)
    g = torch.exp(-((torch.arange(window, dtype=torch.float64) - window // 2) ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    k = (g[:, None] * g[None, :]).expand(3, 1, window, window)

    def blur(t):
        return F.conv2d(t, k, groups=3)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.mean().item()
