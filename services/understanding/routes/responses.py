"""How a request's engine work meets its HTTP response: cleanup (abort the engine request, free pages, give
back the admission slot) runs on every exit — the end of the stream, an error, a client that left before
or during the body. Cleanups are idempotent; both helpers may call them twice."""
from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from services.kit import sse
from services.kit.web import until_disconnect

T = TypeVar("T")
Cleanup = Callable[[], Awaitable[None]]


def sse_response(body: AsyncIterator[bytes], cleanup: Cleanup) -> StreamingResponse:
    async def stream():
        try:
            async for chunk in body:
                yield chunk
        finally:
            await cleanup()
    # the background task also runs when the client left before the body even started
    return StreamingResponse(stream(), media_type="text/event-stream", headers=sse.HEADERS,
                             background=BackgroundTask(cleanup))


async def until_done_or_gone(request: Request, work: Callable[[], Awaitable[T]], cleanup: Cleanup):
    """`work()` unless the client disconnects first: (finished, result); cleanup either way."""
    try:
        return await until_disconnect(request, work)
    finally:
        await cleanup()
