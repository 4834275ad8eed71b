"""Page-lock (pin) the pool's mapping for CUDA and expose it to the GPU as a CUDA tensor.

Registration is Portable|Mapped, so (with unified addressing, every 64-bit Linux CUDA setup) the GPU can
address the pages at the host pointer: copy kernels read/write the pool directly, and DMA copies from/to it
run at pinned speed. Processes without CUDA just use the plain shared memory.
"""
from __future__ import annotations

import torch

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2


def cuda_usable() -> bool:
    return torch.cuda.is_available()


def register(ptr: int, nbytes: int) -> None:
    """Pin [ptr, ptr+nbytes). Prefers kernels.register_host_memory when the kernels package provides it."""
    fn = _kernels_attr("register_host_memory")
    if fn is not None:
        fn(ptr, nbytes)
        return
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes,
                                               _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED)
    _check(err, "cudaHostRegister")


def unregister(ptr: int) -> None:
    fn = _kernels_attr("unregister_host_memory")
    if fn is not None:
        fn(ptr)
        return
    _check(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


class _CudaArray:
    """Minimal __cuda_array_interface__ provider so torch can alias registered host memory on the GPU."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None,
        }


def cuda_alias(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over registered host memory (no copy; device pointer == host pointer under UVA)."""
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


def _check(err, what: str) -> None:
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def _kernels_attr(name: str):
    try:
        import kernels
    except ImportError:
        return None
    return getattr(kernels, name, None)
