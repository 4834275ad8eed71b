"""`GET /internal/fused` on both services of the fused process: which engines run how, each engine loop's step
time and CPU share (kit/loop_clock.py), the GIL probe, the yield signal's decode steps, why the process is
exiting (if it is). Behind the internal token like every route but /health."""
from __future__ import annotations

from typing import Callable

from fastapi import APIRouter


def stats_router(snapshot: Callable[[], dict]) -> APIRouter:
    router = APIRouter()

    @router.get("/internal/fused")
    async def fused_stats() -> dict:
        return snapshot()

    return router
