"""One job's events (protocol.py) on their way from the engine (the link reader thread) to its HTTP stream, bounded.

Images and previews arrive as raw pixels (a 2048² image is 12 MiB) and wait here until the stream encodes and
writes them; a stream whose reader stalls would hold them for as long as it stalls. So the pixels waiting here
are bounded by `max_bytes`: an event that would go beyond it while others still wait ends the job instead
(`on_overflow`: it is aborted in the engine, the stream gets the error and ends) and from then on pixels are
dropped as they come (an exported float image among them is never written to the client, so the job's lease frees
it when the stream closes). The first event is always taken: a single image larger than the bound still reaches a
reader that keeps up. An RL result dropped here (its stream is over) unlinks its trajectory segment.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from .protocol import Image, Preview
from .shared_trajectory import release

PIXEL_EVENTS = (Preview, Image)


def _nbytes(ev) -> int:
    return int(ev.pixels.nbytes) if isinstance(ev, PIXEL_EVENTS) and ev.pixels is not None else 0


class StreamQueue:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int, on_overflow: Callable[[int], None]):
        self.loop = loop
        self.max_bytes = max_bytes
        self.on_overflow = on_overflow        # (bytes waiting) -> None; runs on the loop
        self.waiting_bytes = 0
        self.overflowed = False
        self.closed = False                   # the stream is over: whatever comes now is dropped
        self._q: asyncio.Queue = asyncio.Queue()

    def deliver(self, ev) -> None:
        """Any thread; never blocks."""
        try:
            self.loop.call_soon_threadsafe(self._put, ev)
        except RuntimeError:           # the loop is closed: the server is gone
            release(ev)

    def _put(self, ev) -> None:
        if self.closed:
            release(ev)                # an RL result's trajectory segment nobody will store
            return
        size = _nbytes(ev)
        if size and not self.overflowed and self.waiting_bytes and self.waiting_bytes + size > self.max_bytes:
            self.overflowed = True
            self.on_overflow(self.waiting_bytes + size)
        if size and self.overflowed:
            return
        self.waiting_bytes += size
        self._q.put_nowait(ev)

    async def get(self, timeout_s: Optional[float]):
        """The next event, or None when none came within timeout_s (time for a heartbeat)."""
        try:
            ev = await asyncio.wait_for(self._q.get(), timeout_s)
        except asyncio.TimeoutError:
            return None
        self.waiting_bytes -= _nbytes(ev)
        return ev

    def close(self) -> list:
        """End the queue: what the stream never took (its client went first); later events are dropped."""
        self.closed = True
        left = []
        while not self._q.empty():
            left.append(self._q.get_nowait())
            release(left[-1])
        self.waiting_bytes = 0
        return left
