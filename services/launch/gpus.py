"""Whether the GPUs a stack is placed on are there, asked before anything starts: a stack planned on GPUs that
CUDA cannot reach fails at once, saying so (it never silently runs an 8B model on the CPU in float32).

The answer comes from torch in a child process with the stack's CUDA_VISIBLE_DEVICES, i.e. what the engines
would see (the launcher itself never initialises CUDA, and never imports torch).
"""
from __future__ import annotations

import os
import subprocess
import sys

_PROBE = ("import torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "print(n, torch.version.cuda or 'none')\n")


def cuda_devices(gpu_ids: list[str], timeout_s: float = 120.0) -> tuple[int, str]:
    """(CUDA devices a process restricted to `gpu_ids` sees, why there are fewer than asked: '' if none missing)."""
    env = dict(os.environ)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"the CUDA probe failed ({type(exc).__name__})"
    if r.returncode != 0:
        return 0, "the CUDA probe failed: " + (r.stderr.strip().splitlines() or ["no output"])[-1]
    count, built = r.stdout.split()[:2]
    n = int(count)
    if n >= len(gpu_ids or [0]):
        return n, ""
    if built == "none":
        return n, "this torch is a CPU-only build (no CUDA)"
    if not os.path.exists("/dev/nvidiactl"):
        return n, "no NVIDIA driver on this machine (/dev/nvidiactl is missing)"
    return n, f"CUDA sees {n} of the {len(gpu_ids)} GPU(s) {','.join(gpu_ids)} (ids are physical GPU indices)"
