"""A named POSIX shared-memory segment (/dev/shm/<name>) mapped with mmap.

We do not use multiprocessing.shared_memory: its resource_tracker unlinks segments that a consumer merely
attached to when the consumer exits (Python < 3.13), which would pull the pool from under the producer.
Here only the creator unlinks, and only the segment it created (checked by inode).

Ownership is recorded IN the segment, never inferred from its name: `Segment.create` makes the file with
O_EXCL (mode 0600), takes the creator's liveness lock (shm_transfer.locks, slot 0) and writes an owner record at
bytes [OWNER_OFF, OWNER_OFF + 128): magic, the owning stack's id (`u1serve up` makes one per stack), the creator's
pid and a random token. Whoever finds a segment decides by that record and that lock: a live creator's segment is
never touched (`take_name` refuses it); a dead creator's is unlinked and made again by the next owner of the name,
whatever its pid; a launcher removes only the segments whose record names its own stack (`unlink_if_owned`).
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import struct

from . import locks
from .errors import PoolError

SHM_DIR = "/dev/shm"
CREATOR_SLOT = 0  # the creator holds this liveness lock (shm_transfer.locks) for as long as it lives
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")
OWNER_OFF = 128              # owner record: after the first 16 header words of every segment kind
OWNER_MAGIC = b"U1OWNER1"
_OWNER = struct.Struct("<8s32sq16s")     # magic, stack id (ascii, NUL-padded), creator pid, random token
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


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
    def create(cls, name: str, size: int, owner: str = "", what: str = "KV pool",
               reserve: bool = False) -> "Segment":
        """Create /dev/shm/<name> (it must not exist: see take_name), hold the creator lock and record `owner` (a
        stack id) in the segment. `reserve`: allocate every page now (posix_fallocate), so a full /dev/shm is an
        OSError (ENOSPC) here rather than a SIGBUS at the first write of a page that tmpfs cannot back."""
        path = shm_path(name)
        if not os.path.isdir(SHM_DIR):
            raise PoolError(f"{SHM_DIR} does not exist: POSIX shared memory is required for the {what}")
        free = shm_free_bytes()
        if free is not None and size > free:
            raise PoolError(
                f"{what} needs {size / 2**30:.2f} GiB but {SHM_DIR} has {free / 2**30:.2f} GiB free "
                "(in Docker use --ipc=host or a larger --shm-size)")
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise PoolError(f"shared-memory segment {path} appeared while creating it (another process is "
                            "creating a pool of that name)") from None
        try:
            locks.try_hold(fd, CREATOR_SLOT)  # first: from now on a concurrent create sees a live owner
            if reserve:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            os.pwrite(fd, owner_record(owner), OWNER_OFF)
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
            fd = os.open(path, _OPEN_FLAGS)
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

    def unmap(self) -> None:
        """Unmap but keep the fd (and the locks it holds). If tensors still view the mapping, the unmap happens
        when they die."""
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # exported views alive; the mapping goes away with the last of them

    def close(self) -> None:
        """Unmap and close. If tensors still view the mapping, the unmap happens when they die."""
        self.unmap()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def owner_record(owner: str) -> bytes:
    stack = owner.encode("ascii")
    if len(stack) > 32:
        raise ValueError(f"owner id {owner!r} is longer than 32 characters")
    return _OWNER.pack(OWNER_MAGIC, stack, os.getpid(), secrets.token_bytes(16))


def owner_of(head: bytes) -> dict | None:
    """{stack, pid} of the owner record in a segment's first bytes; None when there is none."""
    raw = head[OWNER_OFF:OWNER_OFF + _OWNER.size]
    if len(raw) < _OWNER.size:
        return None
    magic, stack, pid, _token = _OWNER.unpack(raw)
    if magic != OWNER_MAGIC:
        return None
    return {"stack": stack.rstrip(b"\0").decode("ascii", "replace"), "pid": pid}


def probe(name: str, head: int = 4096, slots: tuple[int, ...] = (CREATOR_SLOT,)) -> tuple[int, bool, bytes] | None:
    """(inode, alive: a live process holds one of `slots` (the creator's by default), first `head` bytes) of an
    existing segment, or None if there is none. PoolError for something at that name that is not ours: another
    user's file, a link, not a regular file."""
    path = shm_path(name)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:          # ELOOP: a symbolic link planted at the name
        raise PoolError(f"{path} is not a shared-memory segment of ours ({exc.strerror}); refusing to use or "
                        "remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PoolError(f"{path} belongs to uid {st.st_uid} or is not a regular file; refusing to use or "
                            "remove it: pick another name")
        return st.st_ino, any(locks.held_by_other(fd, s) for s in slots), os.pread(fd, head, 0)
    finally:
        os.close(fd)


def take_name(name: str, what: str = "segment") -> None:
    """Before creating `name`: unlink a segment left by a dead creator (whatever its pid or stack); refuse one
    whose creator lives (another stack, or this one still running), naming it."""
    found = probe(name)
    if found is None:
        return
    inode, alive, head = found
    if alive:
        owner = owner_of(head) or {}
        who = f"creator pid {owner.get('pid', 'unknown')}" + (f", stack {owner['stack']}" if owner.get("stack") else "")
        raise PoolError(f"{what} {name!r} (/dev/shm/{name}) belongs to a live process ({who}); refusing to "
                        "replace it: stop that stack or pick another name (--kv-pool-name)")
    unlink_exact(name, inode)  # its creator died (e.g. SIGKILL): what it held dies with it


def unlink_if_owned(name: str, owner: str) -> bool:
    """Remove /dev/shm/<name> only if its owner record names stack `owner` and its creator is gone (a launcher's
    cleanup after its services stopped). Never touches another stack's segment. Returns whether it removed it."""
    try:
        found = probe(name)
    except (PoolError, ValueError):
        return False
    if found is None:
        return False
    inode, alive, head = found
    record = owner_of(head)
    if alive or not owner or record is None or record["stack"] != owner:
        return False
    return unlink_exact(name, inode)


def reclaim_orphans(prefix: str, slots: tuple[int, ...] = (CREATOR_SLOT,)) -> list[str]:
    """Unlink this user's /dev/shm/<prefix>* segments that no live process holds (none of `slots` locked, by
    default the creator's: their holders died, e.g. SIGKILL); returns their names. A segment some live process
    holds is never touched, so servers that share the prefix may all run this (take_name's rule, for owners with
    no launcher to clean up after them: a Ray replica killed with its node, a rollout's trajectory)."""
    try:
        names = [e for e in os.listdir(SHM_DIR) if e.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            found = probe(name, head=0, slots=slots)
        except (PoolError, ValueError, OSError):
            continue
        if found is not None and not found[1] and unlink_exact(name, found[0]):
            removed.append(name)
    return removed


def unlink_exact(name: str, inode: int | None = None) -> bool:
    """Remove /dev/shm/<name> and nothing else (no prefix matching: other stacks' segments may share a
    prefix). With `inode`, only if the name still refers to that file. Returns whether it removed it."""
    path = shm_path(name)
    if inode is not None:
        try:
            if os.stat(path).st_ino != inode:
                return False
        except FileNotFoundError:
            return False
    return _unlink_quiet(path)


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def shm_free_bytes() -> int | None:
    """Bytes this user may still allocate in /dev/shm (None when it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
