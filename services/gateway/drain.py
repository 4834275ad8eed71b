"""Shutting down without cutting anybody off. On SIGTERM uvicorn stops accepting connections and gives the
requests in flight `--graceful-shutdown-s` to finish, then cancels them (a half-sent stream would just stop, a
request without a response would get a 500). A request still running shortly before that ends here instead,
cleanly: a 503 `shutting_down` if its response has not started, else (a stream) an error event and [DONE]. Its
upstream work is undone by the routes' own cleanup, which runs on the cancellation as on a client that left."""
from __future__ import annotations

import asyncio

from services.kit import sse
from services.kit.errors import unavailable
from services.kit.web import until


class Drain:
    """When the requests in flight must end: `grace_s` after shutdown began, less a margin to end them in."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.margin_s = min(0.5, grace_s / 5)
        self._began = asyncio.Event()

    def begin(self) -> None:
        """Shutdown has begun (called on the event loop by the server)."""
        self._began.set()

    async def cutoff(self) -> None:
        await self._began.wait()
        await asyncio.sleep(self.grace_s - self.margin_s)


def shutting_down():
    return unavailable("the gateway is shutting down: retry the request", code="shutting_down")


class DrainMiddleware:
    """Runs each POST against the drain's cutoff; one that is still running then ends as the module says."""

    def __init__(self, app, *, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        response = {"started": False, "stream": False, "done": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                response["started"] = True
                response["stream"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                         for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                response["done"] = True
            await send(message)

        finished, _ = await until(self.drain.cutoff, lambda: self.app(scope, receive, tracked))
        if finished or response["done"]:
            return
        if not response["started"]:
            return await shutting_down().response()(scope, receive, send)
        # a stream: the error after the last whole line (the leading newline ends an event cut mid-way)
        tail = b"\n" + sse.encode(shutting_down().event()) + sse.encode(sse.DONE) if response["stream"] else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
