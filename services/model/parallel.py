"""Tensor-parallel context: which shard this process holds and how to reduce across shards."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPContext:
    rank: int
    world_size: int
    group: object = None  # a torch.distributed process group (None = the default group)
    # CPU (gloo) group for control messages: a rank waiting on an NCCL collective spins a kernel on
    # its GPU, which would steal SMs from a colocated engine while this one is idle.
    ctrl_group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's head shard along `dim` (rank order)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


# How each weight is split across TP ranks: dim 0 (column-parallel) or dim 1 (row-parallel).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def shard_dim(key: str) -> int | None:
    """The dim a checkpoint tensor is split on under TP, or None if every rank holds all of it."""
    if not key.endswith(".weight") or ".layers." not in key:
        return None
    leaf = key.rsplit(".", 2)[-2]
    base = leaf.removesuffix("_mot_gen")
    if base in _COLUMN:
        return 0
    if base in _ROW:
        return 1
    return None


def shard(t: torch.Tensor, dim: int | None, tp: TPContext | None) -> torch.Tensor:
    if tp is None or tp.world_size == 1 or dim is None:
        return t
    size = t.shape[dim] // tp.world_size
    return t.narrow(dim, tp.rank * size, size)
