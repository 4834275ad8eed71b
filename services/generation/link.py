"""The pipes between the generation HTTP process and engine rank 0, with a thread at each end.

Why threads: a pipe holds ~64 KiB. If the side that writes also had to wait for something the other side's
reader needs (a lock, the event loop, the engine loop), a burst of submissions against a stream of finished
images would block both processes for good. So nobody writes to a pipe except its `Outbox` thread (`send`
only queues), and nobody reads except one reader thread per pipe that hands each message on without
blocking. The messages are protocol.py's dataclasses; the `pixels` of one (an image, a preview) cross as raw bytes
right after it (no pickling of 12 MB arrays), written from the array and read straight into the receiver's array
(`_write_all` / `_read_into`: one kernel copy each way, no per-chunk Python objects). A served rollout's trajectory
(GBs) does not cross here at all: its message names the shared-memory segment that holds it
(shared_trajectory.py); only an engine without segments (in-process tests) would frame one.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import queue
import threading
from typing import Callable, Optional

import numpy as np

log = logging.getLogger("u1serve.generation.link")

_CLOSE = object()
PIPE_BYTES = 1 << 20          # the pipe's kernel buffer (Linux's unprivileged maximum): fewer, larger copies per frame


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
        _widen(conn)
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
                    _write_all(self._conn.fileno(), memoryview(pixels).cast("B"))
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
        pixels = np.empty(msg.shape, dtype=np.dtype(msg.dtype))
        _read_into(conn.fileno(), memoryview(pixels).cast("B"))
        pixels.flags.writeable = False
        return dataclasses.replace(msg.msg, pixels=pixels)
    return msg


def _widen(conn) -> None:
    """Raise the pipe buffer to PIPE_BYTES where the OS lets us (Linux pipes; a socket or another OS keeps its own)."""
    try:
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):
        pass


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data):]


def _read_into(fd: int, buf: memoryview) -> None:
    """Fill `buf` from `fd` (EOFError when the peer closes first)."""
    pos = 0
    while pos < buf.nbytes:
        got = os.readv(fd, [buf[pos:]])
        if got == 0:
            raise EOFError("the peer closed in the middle of a frame")
        pos += got


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
