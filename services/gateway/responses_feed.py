"""The stream of a background response (`background` with `stream`): its task numbers the events and puts them
here; the client's request reads them. The response does not depend on the reader: a client that goes away,
or stops reading while more than `limit` events wait, is let go (its stream ends, after an `error` event in
the second case) and the response runs on to its end, to be read with GET /v1/responses/{id}."""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

_END = object()


class EventFeed:
    def __init__(self, limit: int = 1024):
        self.limit = limit
        self._queue: asyncio.Queue = asyncio.Queue()
        self._numbers = itertools.count()
        self.attached = True             # a reader still wants the events

    def put(self, ev: dict) -> None:
        """One event of the response, numbered (sequence_number) in the order they happen."""
        ev = {**ev, "sequence_number": next(self._numbers)}
        if not self.attached:
            return
        if self._queue.qsize() >= self.limit:       # a reader that does not read: let it go
            self.attached = False
            self._queue.put_nowait({"type": "error", "code": "stream_backlog", "param": None,
                                    "sequence_number": ev["sequence_number"],
                                    "message": f"{self.limit} events waited for this stream's reader: the stream "
                                               "ends here, the response goes on (GET /v1/responses/{id})"})
            self._queue.put_nowait(_END)
            return
        self._queue.put_nowait(ev)

    def close(self) -> None:
        """The response ended (completed, failed, cancelled, also before it began): the stream ends after what is
        queued."""
        if self.attached:
            self.attached = False
            self._queue.put_nowait(_END)

    async def events(self) -> AsyncIterator[dict]:
        try:
            while True:
                ev = await self._queue.get()
                if ev is _END:
                    return
                yield ev
        finally:                         # the reader is done or gone: nothing more is kept for it
            self.attached = False
            self._queue = asyncio.Queue()
