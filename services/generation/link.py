"""The pipes between the generation HTTP process and engine rank 0, with a thread at each end.

Why threads: a pipe holds ~64 KiB. If the side that writes also had to wait for something the other side's
reader needs (a lock, the event loop, the engine loop), a burst of submissions against a stream of finished
images would block both processes for good. So nobody writes to a pipe except its `Outbox` thread (`send`
only queues), and nobody reads except one reader thread per pipe that hands each message on without
blocking. The messages are protocol.py's dataclasses; the `pixels` of one (an image, a preview, a trajectory)
cross as a raw byte frame right after it (no pickling of 12 MB arrays).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Callable, Optional

import numpy as np

log = logging.getLogger("u1serve.generation.link")

_CLOSE = object()


@dataclasses.dataclass
class _Framed:
    """A message whose `pixels` follow as a raw frame of this shape and dtype."""
    msg: object
    shape: tuple
    dtype: str


class Outbox:
    """Messages out over one pipe end, written by a dedicated thread: `send` never blocks."""

    def __init__(self, conn, name: str):
        self._conn = conn
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        """Queue a message (a protocol.py dataclass); its `pixels`, if any, follow it as a raw frame."""
        self._q.put(msg)

    def pending(self) -> int:
        return self._q.qsize()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _CLOSE:
                break
            if self.broken:
                continue                     # the peer is gone: drop, but keep draining
            msg = item
            pixels = getattr(msg, "pixels", None)
            try:
                if pixels is None:
                    self._conn.send(msg)
                else:
                    pixels = np.ascontiguousarray(pixels)
                    self._conn.send(_Framed(dataclasses.replace(msg, pixels=None), pixels.shape, pixels.dtype.str))
                    self._conn.send_bytes(memoryview(pixels).cast("B"))
            except (OSError, EOFError, ValueError) as exc:
                self.broken = True
                log.debug("%s: pipe closed (%r)", threading.current_thread().name, exc)
        try:
            self._conn.close()
        except OSError:
            pass

    def close(self, timeout: float = 5.0) -> bool:
        """Send what is queued, then close. False when the thread is still blocked after `timeout` (the peer
        does not read; it unblocks when the peer dies)."""
        self._q.put(_CLOSE)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def receive(conn):
    """One message; one that carried pixels gets them back as a read-only array. EOFError / OSError when the
    peer is gone."""
    msg = conn.recv()
    if isinstance(msg, _Framed):
        pixels = np.frombuffer(conn.recv_bytes(), dtype=np.dtype(msg.dtype)).reshape(msg.shape)
        return dataclasses.replace(msg.msg, pixels=pixels)
    return msg


def start_reader(conn, handle: Callable[[object], None], name: str,
                 on_close: Optional[Callable[[], None]] = None) -> threading.Thread:
    """A daemon thread: `handle(msg)` for every message until the peer closes (then `on_close()`).
    `handle` must not block on anything the writer of this pipe waits for."""

    def run() -> None:
        try:
            while True:
                try:
                    msg = receive(conn)
                except (EOFError, OSError):
                    break
                try:
                    handle(msg)
                except Exception:
                    log.exception("%s: handling a message failed", name)
        finally:
            try:
                conn.close()
            except OSError:
                pass
            if on_close is not None:
                on_close()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t
