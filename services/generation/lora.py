"""Multi-LoRA in the generation engine (docs/lora.md): a job holds the adapter its spec names while it runs;
each step's packed rows carry their job's adapter slot into the forward (services/model/lora_batched.py)."""
from __future__ import annotations

import torch

from services.kit.errors import APIError
from services.model.lora_registry import AdapterNotFound, acquire_adapter, slot_of


def job_adapter(model, spec):
    """The adapter of a job (None: the base weights); an unknown name is the client's 404."""
    try:
        return acquire_adapter(model, getattr(spec, "lora", None))
    except AdapterNotFound as e:
        raise APIError(404, str(e), param="model", code="model_not_found") from None


def step_slots(runs: list[tuple[object, int]]) -> torch.Tensor | None:
    """[rows] slot of each packed row from (job, rows) runs in row order; None when no row uses an adapter."""
    if all(getattr(job, "lora", None) is None for job, _ in runs):
        return None
    return torch.cat([torch.full((n,), slot_of(job.lora), dtype=torch.int32) for job, n in runs])
