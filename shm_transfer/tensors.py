"""Any tensor through the KV pool: packed into the `[L, 2, T, Hkv, D]` shape of a handle (so the ordinary
`write_kv` / `read_kv` move it, with their ownership and lease checks) and unpacked again.

Interleaved answers use it for a generated image: generation writes the final float image (pool dtype, no
rounding to uint8) into pages it allocates, understanding reads it back and re-encodes it.
"""
from __future__ import annotations

import math

import torch

from .layout import KVLayout


def tokens_for(layout: KVLayout, numel: int) -> int:
    """Handle tokens that hold `numel` values of the pool dtype."""
    per_token = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim
    return max(1, math.ceil(numel / per_token))


def pack(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """`t` (cast to the pool dtype, zero-padded) as a contiguous [L, 2, T, Hkv, D] tensor on t's device."""
    flat = t.detach().reshape(-1).to(layout.torch_dtype)
    kv = torch.zeros(layout.kv_shape(tokens_for(layout, flat.numel())), dtype=layout.torch_dtype, device=t.device)
    kv.view(-1)[:flat.numel()].copy_(flat)
    return kv


def unpack(kv: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first prod(shape) values of a packed [L, 2, T, Hkv, D] tensor, as `shape`."""
    n = math.prod(shape)
    if kv.numel() < n:
        raise ValueError(f"the handle holds {kv.numel()} values, {tuple(shape)} needs {n}")
    return kv.reshape(-1)[:n].reshape(shape)
