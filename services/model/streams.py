"""The CUDA stream an engine loop runs on. In the fused colocate mode (services/fused/) both engines are threads of
one process on one device: understanding's loop on a high-priority stream, generation's on a low-priority one, so
the GPU's block scheduler dispatches a decode step's blocks before queued denoise blocks. Each loop thread makes its
stream current for its whole life (the current stream is per thread in torch); everything it launches, CUDA graph
replays included, is ordered on it. The engines share no device tensor (the prefix KV crosses in the host pool), so
no cross-stream ordering is needed between them. On the CPU, or with priority "default", nothing changes."""
from __future__ import annotations

import contextlib

import torch

PRIORITIES = ("default", "high", "low")
# torch maps a value outside the device's range to its nearest end: -100 is the highest priority, 0 the lowest
_VALUES = {"high": -100, "low": 0}


def engine_stream(device, priority: str):
    """A context manager making this thread's current stream one of `priority` on `device` (a no-op off CUDA)."""
    if priority not in PRIORITIES:
        raise ValueError(f"stream priority must be one of {PRIORITIES}, got {priority!r}")
    dev = torch.device(device)
    if priority == "default" or dev.type != "cuda" or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device=dev, priority=_VALUES[priority]))
