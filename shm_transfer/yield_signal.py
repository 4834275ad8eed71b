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

The page is a shm_transfer Segment: created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) with the owner
record and the creator's liveness lock (shm_transfer/segment.py), so the KV pool's rule holds: a page whose
writer lives is never replaced, a dead writer's is reclaimed by the next one, a file someone else planted at
the name (another user's, a link, not a regular file) is refused by the writer and ignored by readers, and a
reader trusts only a page whose owner record names its own stack (U1SERVE_STACK_ID) when it has one.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import stat
import struct
import threading
import time

from services.base import knobs
from .segment import Segment, owner_of, take_name

MAGIC = 0x55315949454C4400      # "U1YIELD"
VERSION = 1
PAGE = 4096
_MAGIC, _VERSION, _BUSY, _STEPS, _PID = (8 * i for i in range(5))
SHM_DIR = "/dev/shm"
log = logging.getLogger("u1serve.qos")
_warned: set[str] = set()
_POLL_S = 50e-6                 # a reader's poll while it waits for another process's flag to drop
_in_process: dict[str, "ThreadSignal"] = {}


def _distrust(path: str, why: str) -> None:
    if path not in _warned:          # readers look again every few seconds: say it once
        _warned.add(path)
        log.warning("QoS page %s ignored: %s", path, why)


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

    def __init__(self, path: str, mm: mmap.mmap, ino: int, segment: Segment | None = None):
        self.path = path
        self._mm = mm
        self._ino = ino
        self._segment = segment           # the writer's: its fd holds the liveness lock

    # -- writer ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str) -> "YieldSignal | ThreadSignal":
        """The fused process's in-process signal of that name (ThreadSignal) if it registered one; else create the
        page, lowered (a dead writer's page of that name is replaced; a live writer's or a foreign
        file is refused: PoolError). The creator unlinks it at close()."""
        page_path(name)
        if name in _in_process:
            return _in_process[name]
        take_name(name, "QoS page")
        seg = Segment.create(name, PAGE, owner=knobs.STACK_ID.get())
        for off, val in ((_BUSY, 0), (_STEPS, 0), (_PID, os.getpid()), (_VERSION, VERSION), (_MAGIC, MAGIC)):
            struct.pack_into("<q", seg.mm, off, val)
        sig = cls(os.path.join(SHM_DIR, name), seg.mm, seg.inode, seg)
        atexit.register(sig.close)     # a normal exit unlinks; a killed writer's page is reclaimed by the next
        return sig

    def set_busy(self) -> None:
        struct.pack_into("<q", self._mm, _STEPS, struct.unpack_from("<q", self._mm, _STEPS)[0] + 1)
        struct.pack_into("<q", self._mm, _BUSY, _now_ns())

    def set_idle(self) -> None:
        struct.pack_into("<q", self._mm, _BUSY, 0)

    # -- reader ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, name: str) -> "YieldSignal | ThreadSignal | None":
        """The fused process's in-process signal of that name if it registered one; else the page if a writer of
        ours created it (None otherwise: absent, or not to be trusted)."""
        path = page_path(name)
        if name in _in_process:
            return _in_process[name]
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            _distrust(path, exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                    or st.st_size < PAGE):
                if st.st_size >= PAGE:
                    _distrust(path, "not a private regular file of this user")
                return None
            mm = mmap.mmap(fd, PAGE)
        finally:
            os.close(fd)
        stack = knobs.STACK_ID.get()
        owner = owner_of(bytes(mm[:PAGE]))
        if struct.unpack_from("<q", mm, _MAGIC)[0] != MAGIC or struct.unpack_from("<q", mm, _VERSION)[0] != VERSION \
                or owner is None or (stack and owner["stack"] != stack):
            mm.close()
            return None
        return cls(path, mm, st.st_ino)

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

    def wait_idle(self, timeout_s: float) -> None:
        """Until the flag drops or `timeout_s` passed (polled: another process writes the page)."""
        deadline = time.monotonic() + timeout_s
        while self.busy_for() is not None and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def replaced(self) -> bool:
        """The name now points at another page (the writer restarted) or at nothing."""
        try:
            return os.stat(self.path).st_ino != self._ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        if self._mm is None:
            return
        if self._segment is not None:
            self.set_idle()
            self._mm = None
            self._segment.unlink()        # only if the name is still this page
            self._segment.close()
            return
        self._mm.close()
        self._mm = None


class ThreadSignal:
    """The same flag between two engine threads of one process (the fused colocate mode, services/fused/): a
    threading.Event instead of the page, so a waiting reader wakes the moment the decode step's tokens are sampled
    instead of polling. Same methods as YieldSignal; it is never replaced (the process restarts as a whole)."""

    def __init__(self, name: str):
        self.path = name
        self._idle = threading.Event()
        self._idle.set()
        self._since: int = 0
        self.steps = 0

    def set_busy(self) -> None:
        self.steps += 1
        self._since = _now_ns()
        self._idle.clear()

    def set_idle(self) -> None:
        self._since = 0
        self._idle.set()

    def busy_for(self) -> float | None:
        since = self._since
        return None if since == 0 else max(0.0, (_now_ns() - since) / 1e9)

    def wait_idle(self, timeout_s: float) -> None:
        self._idle.wait(max(0.0, timeout_s))

    def replaced(self) -> bool:
        return False

    def close(self) -> None:
        self.set_idle()


def in_process(name: str) -> ThreadSignal:
    """Register (or get) the in-process signal `name`: from now on YieldSignal.create / open of that name in this
    process return it (both engines' code stays the same in the fused mode)."""
    page_path(name)
    return _in_process.setdefault(name, ThreadSignal(name))
