"""Streamed responses that cannot be held hostage by their client.

- `OwnedStream`: the one way a service answers with SSE (gateway, understanding, generation) or relays a large
  binary body (RL trajectories). It closes its body
  and then runs its `on_close` however the response ends: finished, failed, cut, or the client gone before the
  body even started (an async generator that never started runs no `finally`, so the cleanup of the work it
  relays cannot live there).
- `SlowReaderGuard`: the outermost ASGI wrapper of a service (around the app handed to uvicorn). While bytes
  written to a connection wait (in the server's buffer or, read from the kernel on Linux, its send queue: also
  after the response that wrote them has ended), a client that takes no byte for `write_timeout_s` is cut: the
  connection is aborted. To the app that is a client that left: the stream's `on_close` (and Starlette's
  disconnect watch) undo the work upstream and free the slot, as on a disconnect. Progress is what counts, not
  a chunk's total time: a slow client that keeps reading is never cut. With `hold_s`, a client that holds a
  response unread for that long with its receive window closed (its application reads nothing; a lossy network
  keeps the window open) is reported first (`on_hold`: the gateway's strikes, gateway/probation.py).
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import sys
import termios
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional

import anyio
from fastapi.responses import StreamingResponse

from . import sse

log = logging.getLogger("u1serve.streams")


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


# struct tcp_info (linux/tcp.h): tcpi_snd_mss at 16, tcpi_bytes_acked at 120, tcpi_snd_wnd at 228 (Linux 6.2+)
_TCP_INFO_LEN, _MSS_AT, _ACKED_AT, _WND_AT = 232, 16, 120, 228
_OUTQ = getattr(termios, "TIOCOUTQ", None)      # = SIOCOUTQ on Linux: bytes the peer has not acknowledged


@dataclass
class Wire:
    """One look at a connection's socket (Linux; None fields where the kernel does not say)."""
    unacked: Optional[int] = None        # bytes in the kernel's send queue that the peer has not acknowledged
    acked: Optional[int] = None          # bytes the peer has acknowledged so far
    window_closed: Optional[bool] = None  # the peer offers less than a segment: its application is not reading


def wire(sock) -> Wire:
    """What the kernel knows of `sock`'s sending side; an empty Wire where it cannot be asked."""
    out = Wire()
    if sock is None or not sys.platform.startswith("linux"):
        return out
    try:
        fd = sock.fileno()
        if _OUTQ is not None:
            out.unacked = struct.unpack("i", fcntl.ioctl(fd, _OUTQ, b"\0" * 4))[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, ValueError, AttributeError):
        return Wire()
    if len(info) >= _ACKED_AT + 8:
        out.acked = struct.unpack_from("Q", info, _ACKED_AT)[0]
    if len(info) >= _WND_AT + 4:
        mss, wnd = struct.unpack_from("I", info, _MSS_AT)[0], struct.unpack_from("I", info, _WND_AT)[0]
        out.window_closed = wnd < max(1, mss)
    return out


class _Watch:
    """One connection while bytes written to it wait (in the server's buffer or the kernel's, also after the
    response that wrote them has ended): `on_hold(scope)` once when the client has taken no byte for `hold_s`
    with its receive window closed (its application is not reading: a network that loses packets keeps its
    window open; where the kernel does not tell the window, any such hold counts), and a cut when it has taken
    no byte for `timeout_s`. Ends when everything was taken or the
    connection closed."""

    def __init__(self, guard: "SlowReaderGuard", transport: asyncio.Transport, done: Callable[[], None]):
        self.guard, self.transport, self.done = guard, transport, done
        self.sock = transport.get_extra_info("socket")
        positive = [t for t in (guard.write_timeout_s, guard.hold_s) if t > 0]
        self.every = max(0.05, min(1.0, *(t / 4 for t in positive)))
        self.scope: dict = {}
        self.handle: Optional[asyncio.TimerHandle] = None
        self.acked: Optional[int] = None     # at the last look (None before the first one)
        self.pending: Optional[int] = None
        self.idle_since = time.monotonic()
        self.held = False

    def wrote(self, scope: dict) -> None:
        """A response chunk was handed to the transport (`scope`: the request it answers)."""
        self.scope = scope
        if self.handle is None:
            self.idle_since = time.monotonic()
            self.handle = asyncio.get_running_loop().call_later(self.every, self._tick)

    def _tick(self) -> None:
        self.handle = None
        if self.transport.is_closing():
            return self.done()
        w = wire(self.sock)
        pending = self.transport.get_write_buffer_size() + (w.unacked or 0)
        if pending == 0:
            return self.done()              # all taken
        now = time.monotonic()
        if w.acked is not None:
            took = self.acked is not None and w.acked > self.acked
        else:                                   # no kernel counters: the buffers shrinking is progress
            took = self.pending is not None and pending < self.pending
        if took:
            self.idle_since, self.held = now, False
        self.acked, self.pending = w.acked, pending
        idle = now - self.idle_since
        if (not self.held and self.guard.hold_s > 0 and idle >= self.guard.hold_s
                and w.window_closed is not False):
            self.held = True
            self.guard.on_hold(self.scope, idle)
        if self.guard.write_timeout_s > 0 and idle >= self.guard.write_timeout_s:
            log.warning("%s: the client took no byte of its response for %g s; connection cut (slow reader)",
                        self.scope.get("path", ""), self.guard.write_timeout_s)
            self.guard.on_cut()
            self.transport.abort()          # the server sees a disconnect: the stream's own cleanup runs
            return self.done()
        self.handle = asyncio.get_running_loop().call_later(self.every, self._tick)


class SlowReaderGuard:
    """ASGI wrapper: write deadline per connection (see the module doc). `send_buffer_bytes` > 0 also caps what
    a connection buffers on this side (the kernel's SO_SNDBUF and the server's write buffer); 0 leaves the
    kernel's autotuning (up to a few MB) and the server's 64 KiB. What the client has taken is read from the
    kernel (TCP_INFO, SIOCOUTQ) where it says, so a client that reads nothing is seen however much the buffers
    hold. `hold_s` > 0 reports clients that hold a response unread (`on_hold(scope, seconds)`) before the cut."""

    def __init__(self, app, *, write_timeout_s: float, send_buffer_bytes: int = 0,
                 on_cut: Callable[[], None] = lambda: None, hold_s: float = 0.0,
                 on_hold: Callable[[dict, float], None] = lambda scope, seconds: None):
        self.app = app
        self.write_timeout_s = write_timeout_s
        self.send_buffer_bytes = send_buffer_bytes
        self.on_cut = on_cut
        self.hold_s = hold_s
        self.on_hold = on_hold
        self.watches: dict[int, _Watch] = {}       # id(transport) -> its watch, while bytes wait

    async def __call__(self, scope, receive, send):
        watching = scope["type"] == "http" and (self.write_timeout_s > 0 or self.hold_s > 0)
        transport = _transport(send) if watching else None
        if transport is None:
            return await self.app(scope, receive, send)
        if self.send_buffer_bytes > 0:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            transport.set_write_buffer_limits(high=self.send_buffer_bytes)

        async def guarded(message):
            if message["type"] == "http.response.body":
                self._watch(transport).wrote(scope)
            return await send(message)

        await self.app(scope, receive, guarded)

    def _watch(self, transport: asyncio.Transport) -> _Watch:
        key = id(transport)
        watch = self.watches.get(key)
        if watch is None:
            watch = self.watches[key] = _Watch(self, transport, lambda: self.watches.pop(key, None))
        return watch


def guard(app, args, on_cut: Callable[[], None] = lambda: None) -> SlowReaderGuard:
    """`app` behind the SlowReaderGuard its service's slow-reader settings (kit.stream_settings) ask for."""
    return SlowReaderGuard(app, write_timeout_s=args.stream_write_timeout_s,
                           send_buffer_bytes=args.stream_send_buffer_kb * 1024, on_cut=on_cut)
