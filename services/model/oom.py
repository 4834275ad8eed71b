"""The one test of "an allocation failed" by which both engines fail a step's requests instead of the engine."""
from __future__ import annotations

import torch


def out_of_memory(error: BaseException) -> bool:
    """An allocation that failed (torch's OutOfMemoryError, CPU's allocator error), not a bug. A `CUDA error: out
    of memory` raised as a plain RuntimeError is not one here: the engines treat CUDA errors as fatal."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error)))
