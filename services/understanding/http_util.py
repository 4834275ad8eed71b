"""Small HTTP helpers shared by the endpoints."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request


async def until_disconnect(request: Request, coro):
    """Await coro, cancelling it if the client goes away (its finally blocks free the engine state)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return None
    finally:
        if not task.done():
            task.cancel()
