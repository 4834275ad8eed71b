"""One shared-memory page from the understanding engine to a generation engine on the same GPUs:
"a decode step is running now" (colocate QoS; the generation side is services/generation/qos.py).

Two engines on one GPU are time-sliced by the driver: a decode step (and, with TP, each of its
all-reduces) waits for the generation engine's time slices, so chat tokens stall behind image layers.
The understanding engine raises this flag for each step that has decode rows and lowers it when the
step's tokens are sampled; the generation engine reads it between decoder layers and, within a
budget, lets the GPU drain and waits until it drops.

Page (`/dev/shm/<name>`, little-endian int64 words): [0] magic, [1] version, [2] busy_since (the
writer's CLOCK_MONOTONIC in ns when it raised the flag, 0 = lowered; one system-wide clock, so any
process on the host compares it with its own), [3] decode steps signalled so far, [4] writer pid.
Aligned 8-byte stores and loads, no lock: a reader sees the old or the new value. A writer that dies
(or hangs) with the flag raised is ignored once the flag is older than the reader's `stale_s`.
"""
from __future__ import annotations

import atexit
import mmap
import os
import struct
import time

MAGIC = 0x55315949454C4400      # "U1YIELD"
VERSION = 1
PAGE = 4096
_MAGIC, _VERSION, _BUSY, _STEPS, _PID = (8 * i for i in range(5))
SHM_DIR = "/dev/shm"


def signal_name(kv_pool_name: str) -> str:
    """The page of a stack: named after its KV pool (both engines know that name)."""
    return f"{kv_pool_name}-yield"


def page_path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad yield signal name {name!r}")
    return os.path.join(SHM_DIR, name)


def _now_ns() -> int:
    return time.monotonic_ns()


class YieldSignal:
    """The writer's (understanding rank 0) or a reader's (generation ranks) mapping of the page."""

    def __init__(self, path: str, mm: mmap.mmap, ino: int, owner: bool):
        self.path = path
        self._mm = mm
        self._ino = ino
        self._owner = owner

    # -- writer ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str) -> "YieldSignal":
        """Create (or take over) the page, lowered. The creator unlinks it at close()."""
        path = page_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, PAGE)
            mm = mmap.mmap(fd, PAGE)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        for off, val in ((_BUSY, 0), (_STEPS, 0), (_PID, os.getpid()), (_VERSION, VERSION), (_MAGIC, MAGIC)):
            struct.pack_into("<q", mm, off, val)
        sig = cls(path, mm, ino, owner=True)
        atexit.register(sig.close)     # a normal exit unlinks; a killed writer's page is taken over
        return sig

    def set_busy(self) -> None:
        struct.pack_into("<q", self._mm, _STEPS, struct.unpack_from("<q", self._mm, _STEPS)[0] + 1)
        struct.pack_into("<q", self._mm, _BUSY, _now_ns())

    def set_idle(self) -> None:
        struct.pack_into("<q", self._mm, _BUSY, 0)

    # -- reader ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, name: str) -> "YieldSignal | None":
        """The page if a writer created it (None otherwise)."""
        path = page_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size < PAGE:
                return None
            mm = mmap.mmap(fd, PAGE)
        finally:
            os.close(fd)
        if struct.unpack_from("<q", mm, _MAGIC)[0] != MAGIC or \
                struct.unpack_from("<q", mm, _VERSION)[0] != VERSION:
            mm.close()
            return None
        return cls(path, mm, st.st_ino, owner=False)

    def busy_for(self) -> float | None:
        """Seconds since the flag was raised, None while it is lowered."""
        since = struct.unpack_from("<q", self._mm, _BUSY)[0]
        if since == 0:
            return None
        return max(0.0, (_now_ns() - since) / 1e9)

    @property
    def steps(self) -> int:
        """Decode steps signalled since the page was created."""
        return struct.unpack_from("<q", self._mm, _STEPS)[0]

    def replaced(self) -> bool:
        """The name now points at another page (the writer restarted) or at nothing."""
        try:
            return os.stat(self.path).st_ino != self._ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        if self._mm is None:
            return
        if self._owner:
            self.set_idle()
            if not self.replaced():
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        self._mm.close()
        self._mm = None
