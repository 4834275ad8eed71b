"""A named POSIX shared-memory segment (/dev/shm/<name>) mapped with mmap.

We do not use multiprocessing.shared_memory: its resource_tracker unlinks segments that a consumer merely
attached to when the consumer exits (Python < 3.13), which would pull the pool from under the producer.
Here only the creator unlinks, and only the segment it created (checked by inode).
"""
from __future__ import annotations

import mmap
import os
import re

from .errors import PoolError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")


def shm_path(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise ValueError(f"bad shared-memory name {name!r}: use letters, digits, '_', '.', '-' (no '/')")
    return os.path.join(SHM_DIR, name)


class Segment:
    """An open, mapped segment. `mm` is the whole mapping; `fd` stays open (it carries the flock)."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, created: bool):
        self.name = name
        self.fd = fd
        self.mm = mm
        self.created = created
        self.inode = os.fstat(fd).st_ino
        self.size = len(mm)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        path = shm_path(name)
        if not os.path.isdir(SHM_DIR):
            raise PoolError(f"{SHM_DIR} does not exist: POSIX shared memory is required for the KV pool")
        _unlink_quiet(path)  # a stale segment of a dead producer: its handles die with it
        free = _shm_free_bytes()
        if free is not None and size > free:
            raise PoolError(
                f"KV pool needs {size / 2**30:.2f} GiB but {SHM_DIR} has {free / 2**30:.2f} GiB free "
                "(in Docker use --ipc=host or a larger --shm-size)")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quiet(path)
            raise
        return cls(name, fd, mm, created=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PoolError(f"KV pool {name!r} does not exist ({path}); is the understanding service up?") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise PoolError(f"KV pool {name!r} is empty (being created?)")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, created=False)

    def is_current(self) -> bool:
        """True while /dev/shm/<name> is still the segment we mapped (not unlinked or replaced)."""
        try:
            return os.stat(shm_path(self.name)).st_ino == self.inode
        except FileNotFoundError:
            return False

    def unlink(self) -> bool:
        """Remove the name if it still refers to our segment. Returns whether it removed it."""
        if self.is_current():
            return _unlink_quiet(shm_path(self.name))
        return False

    def close(self) -> None:
        """Unmap and close. If tensors still view the mapping, the unmap happens when they die."""
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # exported views alive; the mapping goes away with the last of them
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
