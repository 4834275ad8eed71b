"""Answering with an image job: collected into one response, or relayed as SSE. A streamed answer starts with
the first event the client sees or when generation accepts the job (`queued`), so every failure before it (a
4xx, a 429 with Retry-After, a 503, a timeout) is still the response status; after it, a failure is an error
event followed by [DONE]."""
from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Callable, Iterable, Optional

from fastapi import Request
from fastapi.responses import Response

from services.kit import sse, timeline
from services.kit.errors import APIError
from services.kit.streaming import OwnedStream
from services.kit.web import until_disconnect

from .jobs import ImageJob
from .state import GatewayState

log = logging.getLogger("u1serve.gateway")
Convert = Callable[[dict], list[dict]]
__all__ = ["client_gone", "collect_job", "stream_events", "stream_job"]


def client_gone() -> Response:
    return Response(status_code=499)


async def collect_job(request: Request, state: GatewayState, job: ImageJob) -> Optional[tuple[Optional[str], list]]:
    """(think text, image events in index order), or None when the client went away (the job is then undone)."""
    async def work():
        think_text, images = None, []
        async with contextlib.aclosing(state.orchestrator.run(job, state.deadline())) as events:
            async for ev in events:
                if ev["type"] == "think_done":
                    think_text = ev.get("think_text")
                elif ev["type"] == "image":
                    timeline.mark("gateway", "image_event")
                    images.append(ev)
        images.sort(key=lambda e: e.get("index", 0))
        return think_text, images

    finished, result = await until_disconnect(request, work)
    return result if finished else None


async def stream_job(request: Request, state: GatewayState, job: ImageJob, convert: Convert,
                     head: Iterable[dict] = (), tail: Iterable[dict] = ()) -> Response:
    """The job as SSE: `head`, the converted events, `tail`, [DONE]."""
    return await stream_events(request, state.orchestrator.run(job, state.deadline()), convert, head, tail)


async def stream_events(request: Request, events: AsyncIterator[dict], convert: Convert,
                        head: Iterable[dict] = (), tail: Iterable[dict] = ()) -> Response:
    """Engine events (an orchestrator run, or an interleaved answer) as SSE: `head`, the converted events,
    `tail`, [DONE]; the response starts with the first visible event or generation's `queued`."""

    async def first_visible() -> list[dict]:
        async for ev in events:
            out = convert(ev)
            # generation accepting the job starts the response too: a job waiting in its queue has its head
            if out or ev.get("type") == "queued":
                return out
        return []

    try:
        finished, first = await until_disconnect(request, first_visible)
    except BaseException:
        await events.aclose()
        raise
    if not finished:
        await events.aclose()
        return client_gone()

    async def body() -> AsyncIterator[bytes]:
        try:
            for chunk in [*head, *first]:
                yield sse.encode(chunk)
            async for ev in events:
                for chunk in convert(ev):
                    yield sse.encode(chunk)
            for chunk in tail:
                yield sse.encode(chunk)
        except APIError as err:
            yield sse.encode(err.event())
        except Exception as exc:      # a bug, but the client still gets a well-formed end
            log.exception("image stream failed")
            yield sse.encode(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").event())
        yield sse.encode(sse.DONE)

    return OwnedStream(body(), on_close=events.aclose)
