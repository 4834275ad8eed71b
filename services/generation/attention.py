"""Which denoise-attention function the engine calls, and whether it wants the lengths on the host.

kernels.denoise_attention dispatches per call; its per-sequence SDPA backend (the CPU choice, and the
CUDA choice without flash-attn) loops over sequences with `cu_seqlens.tolist()`: given device tensors
that is a host sync per layer and job, so for that backend the engine passes host copies instead.
On CPU it is also exactly what the reference pipeline computes (bit-exact fp32 parity).

On CUDA, SDPA runs cuDNN attention, which builds an execution plan per exact (query, key) length: every
new prompt length would pay a plan build on its first step (warmup.py). `CUDNN_BUCKETED_PLANS` asks
torch (>= 2.9) for plans keyed by lengths rounded up to a power of two (its ragged path; q, k, v must be
[B, S, H, D]-contiguous: the engine's are); torch reads it once, at the process's first cuDNN call.
An explicit value in the environment wins (0 turns it off).
"""
from __future__ import annotations

import os

import torch

from services.base import knobs

CUDNN_BUCKETED_PLANS = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"


def pick_denoise_attention(device: torch.device):
    """Returns (fn, host_lengths)."""
    if device.type == "cuda":
        os.environ.setdefault(CUDNN_BUCKETED_PLANS, "1")
    import importlib
    # the module, not the function of the same name that kernels/__init__ re-exports
    da = importlib.import_module("kernels.denoise_attention")
    forced = knobs.DENOISE_BACKEND.text().lower()
    mode = knobs.KERNELS.text().lower() or "auto"
    if mode == "auto" and forced in ("", "auto", "sdpa"):
        sdpa = forced == "sdpa" or device.type == "cpu" or (
            not getattr(da, "HAS_FLASH_ATTN", False)
            and getattr(da, "DEFAULT_CUDA_BACKEND", "sdpa") == "sdpa")
        if sdpa:
            return da.denoise_attention_sdpa, True
    return da.denoise_attention, False
