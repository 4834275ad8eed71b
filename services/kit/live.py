"""GET /health/live, the liveness probe of every service: answered by the HTTP process alone, never by the
engine, so an orchestrator does not kill a service while it loads its model or restarts its engine (readiness
is /health). It also names the process's shared-memory domain: processes that see the same /dev/shm can hand
KV over through it, so a router pairs them without knowing hosts or pods."""
from __future__ import annotations

import functools
import hashlib
import os

from fastapi import APIRouter

LIVE_PATH = "/health/live"
router = APIRouter()


@functools.lru_cache(maxsize=1)
def shm_domain() -> str | None:
    """Equal for processes that share /dev/shm (one host, or the containers of one pod), different otherwise:
    the kernel's boot id (per host) and the device of the /dev/shm mount (per tmpfs instance)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        dev = os.stat("/dev/shm").st_dev
    except OSError:
        return None
    return hashlib.blake2b(f"{boot}:{dev}".encode(), digest_size=8).hexdigest()


@router.get(LIVE_PATH, include_in_schema=False)
async def live() -> dict:
    return {"status": "alive", "pid": os.getpid(), "shm_domain": shm_domain()}
