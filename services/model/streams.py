"""The CUDA stream an engine loop runs on. In the fused colocate mode (services/fused/) both engines are threads of
one process on one device: understanding's loop on a high-priority stream, generation's on a low-priority one, so
the GPU's block scheduler dispatches a decode step's blocks before queued denoise blocks. Each loop thread makes its
stream current for its whole life (the current stream is per thread in torch); everything it launches, CUDA graph
replays included, is ordered on it. The engines share no tensor but the prefix KV's pool pages (host or device),
and each copy into or out of them is complete before its handle is published or released (shm_transfer/copy.py),
so no cross-stream ordering is needed between them. On the CPU, or with priority "default", nothing changes.

Priority alone barely shields a decode step: measured on one H100 (torch 2.11, 2026-12-06, .gpurun-style probe in
docs/benchmarks/load.md), a decode-like chain of small GEMMs took 6.4 ms alone, 134 ms beside a GEMM loop on a
low-priority stream, and 28 / 16 ms when that loop's stream belonged to a CUDA green context of 116 / 100 of the 132
SMs. So generation's stream can come from a green context (`sm_percent`): its kernels never take the SMs left out,
which stay free for understanding's blocks."""
from __future__ import annotations

import contextlib

import torch

PRIORITIES = ("default", "high", "low")
# torch maps a value outside the device's range to its nearest end: -100 is the highest priority, 0 the lowest
_VALUES = {"high": -100, "low": 0}


# SMs are handed to green contexts in groups of this many (compute capability 9.x; 8.x takes 2 or 4: 8 fits all)
SM_GRANULE = 8


def engine_stream(device, priority: str, sm_percent: int = 0):
    """A context manager making this thread's current stream one of `priority` on `device` (a no-op off CUDA);
    with `sm_percent`, the stream of a green context holding that share of the device's SMs instead (priority
    ignored: the partition, not the block scheduler's order, keeps the other SMs free)."""
    if priority not in PRIORITIES:
        raise ValueError(f"stream priority must be one of {PRIORITIES}, got {priority!r}")
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return contextlib.nullcontext()
    if sm_percent:
        return _green_stream(dev, sm_percent)
    if priority == "default":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device=dev, priority=_VALUES[priority]))


def green_sm_count(total_sms: int, sm_percent: int) -> int:
    """The SMs a green context of `sm_percent` gets: rounded down to the granule, at least one granule."""
    return max(SM_GRANULE, total_sms * sm_percent // 100 // SM_GRANULE * SM_GRANULE)


@contextlib.contextmanager
def _green_stream(dev: torch.device, sm_percent: int):
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED:
        raise RuntimeError(f"--green-sm-percent {sm_percent}: this torch ({torch.__version__}) has no CUDA green "
                           "contexts")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    sms = green_sm_count(torch.cuda.get_device_properties(index).multi_processor_count, sm_percent)
    ctx = green_contexts.GreenContext.create(num_sms=sms, device_id=index)
    try:
        with torch.cuda.stream(ctx.Stream()):
            yield
    finally:
        del ctx     # held for the loop's whole life: a collected green context invalidates its stream
