"""Streamed responses that cannot be held hostage by their client.

- `OwnedStream`: the one way a service answers with SSE (gateway, understanding, generation) or relays a large
  binary body (RL trajectories). It closes its body
  and then runs its `on_close` however the response ends: finished, failed, cut, or the client gone before the
  body even started (an async generator that never started runs no `finally`, so the cleanup of the work it
  relays cannot live there).
- `SlowReaderGuard`: the outermost ASGI wrapper of a service (around the app handed to uvicorn). A response
  chunk waits while the client's socket buffers are full; if the client then takes no byte for
  `write_timeout_s`, the connection is aborted. To the app that is a client that left: the stream's
  `on_close` (and Starlette's disconnect watch) undo the work upstream and free the slot, as on a disconnect.
  Progress is what counts, not a chunk's total time: a slow client that keeps reading is never cut.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import AsyncIterator, Awaitable, Callable, Optional

import anyio
from fastapi.responses import StreamingResponse

from . import sse

log = logging.getLogger("u1serve.streams")
DEFAULT_WRITE_TIMEOUT_S = 30.0


class OwnedStream(StreamingResponse):
    """An SSE response that closes its body and then runs `on_close` however it ends (finished, failed, or the
    client gone before or while it streamed), so the upstream work it relays is never left running."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], *,
                 media_type: str = "text/event-stream", headers: Optional[dict] = None, status_code: int = 200):
        super().__init__(body, status_code=status_code, media_type=media_type,
                         headers=sse.HEADERS if headers is None else headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self.on_close()


def _transport(send) -> Optional[asyncio.Transport]:
    """The connection's transport behind uvicorn's `send` (RequestResponseCycle.send); None elsewhere. (Duck
    typed: uvloop's transports are not asyncio.BaseTransport subclasses.)"""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    needs = ("abort", "get_write_buffer_size", "is_closing", "set_write_buffer_limits", "get_extra_info")
    return transport if all(hasattr(transport, name) for name in needs) else None


class _Stall:
    """Watches one blocked write: cuts the connection when the transport's buffer has not shrunk (the client
    took nothing) for `timeout_s`."""

    def __init__(self, transport: asyncio.Transport, timeout_s: float, on_cut: Callable[[], None]):
        self.transport, self.timeout_s, self.on_cut = transport, timeout_s, on_cut
        self.every = min(1.0, timeout_s / 4)
        self.size = transport.get_write_buffer_size()
        self.idle_since = time.monotonic()
        self.handle = asyncio.get_running_loop().call_later(self.every, self._tick)

    def _tick(self) -> None:
        if self.transport.is_closing():
            return
        size = self.transport.get_write_buffer_size()
        now = time.monotonic()
        if size < self.size:
            self.size, self.idle_since = size, now
        if now - self.idle_since >= self.timeout_s:
            self.on_cut()
            return
        self.handle = asyncio.get_running_loop().call_later(self.every, self._tick)

    def stop(self) -> None:
        self.handle.cancel()


class SlowReaderGuard:
    """ASGI wrapper: write deadline per response (see the module doc). `send_buffer_bytes` > 0 also caps what
    a connection buffers on this side (the kernel's SO_SNDBUF and the server's write buffer), i.e. how much a
    client that reads nothing absorbs before the deadline starts to count; 0 leaves the kernel's autotuning (up
    to a few MB) and the server's 64 KiB."""

    def __init__(self, app, *, write_timeout_s: float, send_buffer_bytes: int = 0,
                 on_cut: Callable[[], None] = lambda: None):
        self.app = app
        self.write_timeout_s = write_timeout_s
        self.send_buffer_bytes = send_buffer_bytes
        self.on_cut = on_cut

    async def __call__(self, scope, receive, send):
        transport = _transport(send) if scope["type"] == "http" and self.write_timeout_s > 0 else None
        if transport is None:
            return await self.app(scope, receive, send)
        if self.send_buffer_bytes > 0:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            transport.set_write_buffer_limits(high=self.send_buffer_bytes)
        path = scope.get("path", "")

        def cut() -> None:
            log.warning("%s: the client took no byte of its response for %g s; connection cut (slow reader)",
                        path, self.write_timeout_s)
            self.on_cut()
            transport.abort()       # the server sees a disconnect: the stream's own cleanup runs

        async def guarded(message):
            if message["type"] != "http.response.body":
                return await send(message)
            stall = _Stall(transport, self.write_timeout_s, cut)
            try:
                await send(message)
            finally:
                stall.stop()

        await self.app(scope, receive, guarded)


def add_stream_flags(p, *, default_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
    """The slow-reader flags every service takes (argparse)."""
    p.add_argument("--stream-write-timeout-s", type=float, default=default_timeout_s,
                   help="a client that takes no byte of its (streamed) response for this long while a chunk "
                        "waits is cut off and its work cancelled (slow reader); 0 = never")
    p.add_argument("--stream-send-buffer-kb", type=int, default=0,
                   help="cap each connection's kernel send buffer (SO_SNDBUF) at this many KiB: how much a client "
                        "that reads nothing absorbs before --stream-write-timeout-s counts; 0 = kernel default")


def guard(app, args, on_cut: Callable[[], None] = lambda: None) -> SlowReaderGuard:
    """`app` behind the SlowReaderGuard its service's flags (add_stream_flags) ask for."""
    return SlowReaderGuard(app, write_timeout_s=args.stream_write_timeout_s,
                           send_buffer_bytes=args.stream_send_buffer_kb * 1024, on_cut=on_cut)
