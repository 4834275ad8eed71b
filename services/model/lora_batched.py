"""Unmerged LoRA in the forward: which adapter slot each packed row uses, and the hook that adds the adapters'
low-rank products to a linear layer's output (kernels/lora.py, one batched pass for every adapter of the batch).

An engine sets the rows of a forward with `lora_rows(model, slots)` ([T] slot per packed row, -1 = base) around
the forward; each target linear (lora_registry.TARGET) carries a forward hook that reads it. Outside such a
block, and for a batch of base rows only, the hook returns at once (the model runs exactly as without LoRA).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kernels.lora import lora_apply_, slot_groups
from services.model import row_blocks


@dataclass
class LoraBatch:
    """The slots of one forward's rows: on the device (Triton) and as host groups (torch path)."""
    slots: torch.Tensor                 # [T] int32, model device
    groups: list                        # [(slot, host row indices)]
    _by_blocks: dict = field(default_factory=dict, repr=False)    # block_groups by sizes, per forward

    @property
    def rows(self) -> int:
        return int(self.slots.numel())

    def block_groups(self, sizes: list[int]) -> list:
        """The groups split at row-block bounds (row_blocks): each block's product its own GEMM, as alone."""
        key = tuple(sizes)
        cached = self._by_blocks.get(key)
        if cached is None:
            bounds = torch.tensor(sizes).cumsum(0)
            cached = [(s, part) for s, rows in self.groups
                      for part in rows.tensor_split(torch.searchsorted(rows, bounds[:-1]).tolist()) if part.numel()]
            self._by_blocks[key] = cached
        return cached

    def subset(self, rows: torch.Tensor) -> "LoraBatch":
        host = self.slots.cpu().index_select(0, rows.cpu())
        return LoraBatch(host.to(self.slots.device), slot_groups(host))


def registry_of(model):
    """The model's adapter registry (lora_registry.LoraRegistry), or None when LoRA serving is off."""
    return getattr(model, "lora", None)


@contextlib.contextmanager
def lora_rows(model, slots: torch.Tensor | list | None):
    """Within the block, the model's forward applies adapter `slots[i]` to packed row i (-1: none). A no-op
    without a registry or when every row is a base row."""
    reg = registry_of(model)
    if reg is None or slots is None:
        yield
        return
    host = torch.as_tensor(slots, dtype=torch.int32).cpu()
    groups = slot_groups(host)
    if not groups:
        yield
        return
    prev, reg.batch = reg.batch, LoraBatch(host.to(reg.device), groups)
    try:
        yield
    finally:
        reg.batch = prev


@contextlib.contextmanager
def lora_subset(model, rows: torch.Tensor):
    """A forward over rows `rows` of the current batch (the step cache's layers 1.. on a subset of rows)."""
    reg = registry_of(model)
    if reg is None or reg.batch is None:
        yield
        return
    prev, reg.batch = reg.batch, reg.batch.subset(rows)
    try:
        yield
    finally:
        reg.batch = prev


class LoraHook:
    """Forward hook of one target linear: output += its adapters' products for the rows that use one."""
    __slots__ = ("registry", "a", "b", "name")

    def __init__(self, registry, name: str, a: torch.Tensor, b: torch.Tensor):
        self.registry, self.name, self.a, self.b = registry, name, a, b

    def __call__(self, module, inputs, output):
        batch = self.registry.batch
        if batch is None:
            return output
        x = inputs[0]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] != batch.rows:
            raise RuntimeError(f"LoRA: {self.name} ran on {x2.shape[0]} rows, the batch set {batch.rows} "
                               "(lora_rows / lora_subset around every forward of a LoRA batch)")
        blocks = row_blocks.active_blocks(batch.rows)
        groups = batch.groups if blocks is None else batch.block_groups(blocks)
        lora_apply_(output.view(-1, output.shape[-1]), x2, self.a, self.b, batch.slots, groups)
        return output
