"""Live previews (OpenAI's `partial_images`): the model's estimate of the clean image at evenly spaced steps.

In this flow parametrisation (t from 0 = noise to 1 = clean, z <- z + (t_next - t) * v) the clean image the
current velocity points at is x0 = z_t + (1 - t) * v: one fused multiply-add on tensors the step already
holds, so a preview costs a small downscale and a host copy. Computed on the leader rank only, at the steps
`preview_steps` picks; the HTTP process encodes it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from services.model import sampler

PREVIEW_MAX_SIDE = 512       # previews are small: they show progress, the final image comes at full size


def preview_steps(num_steps: int, partial_images: int) -> list[int]:
    """0-based indexes of the steps whose x0 estimate is sent: evenly spaced, never the last step (the final image
    is not a partial one); fewer than asked when there are too few steps."""
    picks = {max(0, (k + 1) * num_steps // (partial_images + 1) - 1) for k in range(partial_images)}
    return sorted(i for i in picks if i < num_steps - 1)


def preview_format(output_format: str) -> str:
    """The request's format when it is a cheap one, else JPEG (a PNG preview would be large for what it shows)."""
    return output_format if output_format in ("jpeg", "webp") else "jpeg"


def capture(job, z: torch.Tensor, v: torch.Tensor) -> Optional[tuple[int, np.ndarray]]:
    """(partial_image_index, uint8 [n, h, w, 3] x0 estimate) when this step is one of the job's preview steps,
    else None. `z`, `v`: the step's patchified state and CFG-combined velocity."""
    want = getattr(job, "preview_at", None)
    if want is None:
        want = job.preview_at = preview_steps(job.num_inference_steps, job.spec.partial_images)
    if job.flow.index not in want:
        return None
    x0 = sampler.unpatchify(z + (1 - job.flow.t) * v, job.th, job.tw)
    h, w = x0.shape[-2:]
    scale = min(1.0, PREVIEW_MAX_SIDE / max(h, w))
    if scale < 1.0:
        x0 = F.interpolate(x0.float(), size=(max(1, round(h * scale)), max(1, round(w * scale))), mode="area")
    return want.index(job.flow.index), sampler.to_uint8(x0).numpy()
