"""Token-level KV slot allocator: one slot = one token's K and V in every layer of `kv_pool`.

A request's page table is simply the list of its slot ids (they need not be contiguous), so any token can
be shared with the prefix cache, evicted or exported on its own.
"""
from __future__ import annotations

import torch


class OutOfSlots(Exception):
    pass


class KVSlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        # A stack of free slot ids; popping from the end keeps recently freed (cache-warm) slots in use.
        self._free = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)
        self._num_free = num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Return `n` free slot ids (int64, CPU) or raise OutOfSlots; never partially allocates."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > self._num_free:
            raise OutOfSlots(f"need {n} KV slots, {self._num_free} free")
        start = self._num_free - n
        out = self._free[start:self._num_free].clone()
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        if self._num_free + n > self.num_slots:
            raise RuntimeError("KV slot double free")
        self._free[self._num_free:self._num_free + n] = slots.reshape(-1).to(torch.int64).cpu()
        self._num_free += n
