"""How many jobs may wait for the engine (`--max-queued-requests 0` = sized from memory).

A queued job holds its prefix pages in the shared pool and, once admitted, a KV buffer on the device of
`layers x 2 x (prefix + image tokens) x kv heads x head_dim` per branch it runs there. The default queue holds
as many jobs as the memory left after the weights could hold buffers for, at a reference job (1024² text to
image with CFG, 512-token prefix, one image): a full queue is then at most one memory-full of work ahead of
the engine, between `--max-running-jobs` and QUEUE_CAP. Rank 0 measures; the HTTP process decides.
"""
from __future__ import annotations

from typing import Optional

from services.base import knobs
from services.model.memory_plan import REFERENCE_PREFIX_TOKENS, kv_bytes_per_token

REFERENCE_IMAGE_TOKENS = (1024 // 32) ** 2
QUEUE_CAP = 1024


def available_bytes(device) -> int:
    """Memory a new KV buffer could still use: free device memory (within this process's share under
    U1SERVE_GPU_MEMORY_FRACTION), or the host's MemAvailable on CPU."""
    import torch
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        frac = knobs.GPU_MEMORY_FRACTION.get()
        if frac:
            free = min(free, max(0, int(float(frac) * total) - torch.cuda.memory_reserved(device)))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(model, device, world: int, kv_heads: int | None = None) -> dict:
    """What rank 0 reports with `ready`: the reference job's KV buffer on the busiest rank (`world` CFG ranks;
    `kv_heads` it holds: a Ulysses SP rank 1/sp of the model's, default all), and free memory."""
    itemsize = model.dtype.itemsize if hasattr(model.dtype, "itemsize") else 2
    per_token = kv_bytes_per_token(model.num_layers, kv_heads or model.num_kv_heads, model.head_dim, itemsize)
    branches = -(-2 // world)
    return {"job_kv_bytes": per_token * (REFERENCE_PREFIX_TOKENS + REFERENCE_IMAGE_TOKENS) * branches,
            "available_bytes": available_bytes(device)}


def queue_limit(configured: int, measured: Optional[dict], max_running_jobs: int) -> int:
    """The flag when set (> 0), else available memory / reference job buffer, within [max_running, QUEUE_CAP]."""
    if configured > 0:
        return configured
    if not measured or measured.get("job_kv_bytes", 0) <= 0:
        return max(max_running_jobs, 64)
    fits = measured.get("available_bytes", 0) // measured["job_kv_bytes"]
    return int(min(QUEUE_CAP, max(max_running_jobs, fits)))
