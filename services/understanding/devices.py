"""Which device an engine rank runs on, always with an explicit CUDA index.

`torch.cuda.set_per_process_memory_fraction` (and other per-device calls) reject an index-less `cuda`, so the
engine resolves its device once, here, and passes `cuda:N` everywhere.
"""
from __future__ import annotations

from typing import Callable


def rank_device(device: str, tp: int, rank: int, current_index: Callable[[], int]) -> str:
    """The device string of one engine rank: `cpu`, or `cuda:N` with the index resolved.

    With TP > 1 rank r uses `cuda:r` (each rank owns one visible GPU); with one rank an index-less `cuda`
    means the current CUDA device (`current_index()`, i.e. `torch.cuda.current_device`), and `cuda:N` stays."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    if tp > 1:
        return f"cuda:{rank}"
    if index:
        if not index.isdigit():
            raise ValueError(f"bad device {device!r}: expected cuda or cuda:N")
        return f"cuda:{int(index)}"
    return f"cuda:{current_index()}"
