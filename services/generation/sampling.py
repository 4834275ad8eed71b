"""Glue between a `GenerateJob` and `services.model.sampler` (one place that maps request fields)."""
from __future__ import annotations

from .request import BRANCH_ORDER, GenerateJob


def sampler_params(job: GenerateJob):
    from services.model.sampler import SamplerParams
    return SamplerParams(num_inference_steps=job.num_inference_steps, timestep_shift=job.timestep_shift,
                         t_eps=job.t_eps, guidance_scale=job.guidance_scale,
                         image_guidance_scale=job.image_guidance_scale, cfg_norm=job.cfg_norm,
                         cfg_interval=tuple(job.cfg_interval), mode=job.mode)


def branches_for(job: GenerateJob) -> list[str]:
    """The CFG branches these sampling parameters need, in canonical order."""
    from services.model.sampler import branches_needed
    need = set(branches_needed(sampler_params(job)))
    return [b for b in BRANCH_ORDER if b in need]
