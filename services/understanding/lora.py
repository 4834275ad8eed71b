"""Multi-LoRA in the understanding engine (docs/lora.md): a request holds the adapter it names from its arrival
to its end; its prefix-cache keys live in the adapter's own domain (its KV is never served to a request of
another adapter, nor to one of a later load under the same name); each step's rows carry their request's
adapter slot in the plan (every TP rank applies the same)."""
from __future__ import annotations

from typing import Optional

import torch

from services.model.lora_registry import acquire_adapter, slot_of

from .radix_cache import salt_keys


def requested_adapter(state, model: Optional[str]) -> Optional[str]:
    """The adapter a chat request's `model` names (None: the served model's own name, or none given). The engine
    resolves it: an unknown name is a 404 where adapters are served, and the base weights where none are."""
    return model if model and model != state.model_name else None


def bind(req, model) -> None:
    """Hold the adapter `req.msg.lora` names (raises lora_registry.AdapterNotFound) and salt its cache keys."""
    req.lora = acquire_adapter(model, req.msg.lora)
    if req.lora is not None and req.lora.slot >= 0:    # (one that names nothing here computes the base's KV)
        req.keys = salt_keys(req.keys, req.lora.uid)


def release(req) -> None:
    if req.lora is not None:
        req.lora.release()
        req.lora = None


def plan_slots(entries) -> Optional[torch.Tensor]:
    """[rows] slot of each row of a plan from its entries (req, start, end) in row order; None: no adapter."""
    if all(r.lora is None for r, _, _ in entries):
        return None
    return torch.cat([torch.full((e - s,), slot_of(r.lora), dtype=torch.int32) for r, s, e in entries])
