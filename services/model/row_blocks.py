"""Packed rows computed as if each sequence ran alone: every linear layer over the packed rows runs once per block.

CPU BLAS (MKL) picks its GEMM kernel by the row count, and below 12 rows (decode's one row, a 6-token image, a
1-token `<img>` prefill) a row's result depends on that count: the same row rounds differently alone and packed
with other sequences' rows. The official code runs each sequence (prompt, CFG branch) alone, so the engines, on
CPU, run each linear once per sequence to give its bits (`sizes`: the rows of each sequence in packing order);
every other op of the layer stack is row-wise already and attention is per sequence; the LoRA hook's products
and the A3B experts follow the same blocks (`active_blocks`: lora_batched.py, moe.py). Off on GPUs: one GEMM for
the whole batch is the point there, and bits are not promised in bf16 (U1SERVE_EXACT_ROWS overrides).
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from services.base import knobs


def enabled(device: torch.device) -> bool:
    return bool(knobs.EXACT_ROWS.get(default=torch.device(device).type == "cpu"))


_active = threading.local()   # per thread: the fused process runs both engines' forwards in threads of its own


def active_blocks(rows: int) -> list[int] | None:
    """The row blocks in force for a forward over `rows` packed rows (None: computed whole)."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack and sum(stack[-1]) == rows else None


@contextlib.contextmanager
def _blocks(sizes: list[int]):
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(sizes)
    try:
        with _PerBlockLinear(sizes):
            yield
    finally:
        stack.pop()


class _PerBlockLinear(TorchFunctionMode):
    def __init__(self, sizes: list[int]):
        super().__init__()
        self.sizes = sizes
        self.total = sum(sizes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].dim() == 2 and args[0].shape[0] == self.total:
            return torch.cat([func(x, *args[1:], **kwargs) for x in args[0].split(self.sizes)])
        return func(*args, **kwargs)


def per_sequence(sizes: list[int], device: torch.device, force: bool = False):
    """Context: linear layers over sum(sizes) packed rows run once per block of `sizes` (when `enabled`, or
    `force`d: RL jobs sharing a forward keep the bits each had alone, generation/reference.py)."""
    sizes = [int(s) for s in sizes if s]
    if len(sizes) < 2 or not (force or enabled(device)):
        return contextlib.nullcontext()
    return _blocks(sizes)
