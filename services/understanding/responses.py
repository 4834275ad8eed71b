"""How a request's engine work meets its HTTP response: cleanup (abort the engine request, free pages, give
back the admission slot) runs on every exit — the end of the stream, an error, a client that left before
or during the body. Cleanups are idempotent; both helpers may call them twice."""
from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from services.kit.streaming import OwnedStream
from services.kit.web import until_disconnect

T = TypeVar("T")
Cleanup = Callable[[], Awaitable[None]]


def sse_response(body: AsyncIterator[bytes], cleanup: Cleanup) -> OwnedStream:
    async def close():
        if hasattr(body, "aclose"):
            await body.aclose()
        await cleanup()
    # on_close also runs when the client left before the body even started, or its stream was cut (slow reader)
    return OwnedStream(body, on_close=close)


async def until_done_or_gone(request: Request, work: Callable[[], Awaitable[T]], cleanup: Cleanup):
    """`work()` unless the client disconnects first: (finished, result); cleanup either way."""
    try:
        return await until_disconnect(request, work)
    finally:
        await cleanup()
