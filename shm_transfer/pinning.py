"""Page-lock (pin) the pool's mapping for CUDA in this process.

Registration (kernels.register_host_memory: cudaHostRegister Portable|Mapped) lets the copy kernels read
and write the pages directly from the GPU and makes DMA copies from/to them run at pinned speed.
Processes without CUDA use the plain shared memory.
"""
from __future__ import annotations

import torch


def cuda_usable() -> bool:
    return torch.cuda.is_available()


def register(mapping: torch.Tensor) -> bool:
    """Pin the CPU tensor's whole storage. Returns False where there is no CUDA."""
    from kernels import register_host_memory
    return bool(register_host_memory(mapping))


def unregister(mapping: torch.Tensor) -> None:
    from kernels import unregister_host_memory
    unregister_host_memory(mapping)
