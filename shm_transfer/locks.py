"""Process liveness through open-file-description (OFD) byte-range locks on the pool segment.

A process proves it is alive by holding a write lock on one byte of the segment's lock space; the kernel
drops the lock when the process dies (any signal, SIGKILL included) or closes the segment. Any other
process that maps the same file can test for the lock. Unlike a pid (+ start time) this works across pid
namespaces (the two services in separate containers sharing only /dev/shm) and cannot be fooled by pid
reuse. The lock bytes lie far beyond the segment's end (locks may cover ranges past EOF); they are
independent of the flock that serialises page-table operations.

A lock taken through one open file description never conflicts with itself: `held_by_other` answers
False for the caller's own lock, so callers compare slots with their own first.
"""
from __future__ import annotations

import errno
import fcntl
import struct

LOCK_SPACE = 1 << 40  # byte offset of slot 0 in the lock space
_FLOCK = "hhxxxxqqixxxx"  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid


def _flock(kind: int, slot: int) -> bytes:
    return struct.pack(_FLOCK, kind, 0, LOCK_SPACE + slot, 1, 0)


def try_hold(fd: int, slot: int) -> bool:
    """Take slot's lock for this open file description; False if another holder has it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, slot))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def held_by_other(fd: int, slot: int) -> bool:
    """True while a process other than this open file description's holder keeps slot's lock."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, slot))
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK
