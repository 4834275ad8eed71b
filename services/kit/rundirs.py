"""Private per-process directories in the temp dir (the understanding service's ZMQ sockets: `u1und-*`) that do
not outlive their owner.

The owner holds an exclusive flock on `<dir>/.owner` for as long as it lives (the kernel drops it when the
process dies, however it dies). A directory whose lock can be taken belongs to nobody alive: the next owner
of the same prefix removes it when it starts. The owner removes its own at exit.
"""
from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time

log = logging.getLogger("u1serve.rundirs")
OWNER_FILE = ".owner"
_UNCLAIMED_GRACE_S = 60.0      # a directory without its owner file yet (being created), or from an older build


def owned_tempdir(prefix: str) -> str:
    """A fresh directory `<tmp>/<prefix>XXXX` owned by this process (stale ones of dead owners removed first)."""
    reclaim_stale(prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\n".encode())      # for people; the lock is what counts
    pid = os.getpid()
    atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
    return path           # the fd stays open (it holds the lock) until the process ends


def _owner_gone(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return time.time() - os.lstat(path).st_mtime > _UNCLAIMED_GRACE_S
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False      # held: its owner lives
    finally:
        os.close(fd)      # (releases our probe lock)


def reclaim_stale(prefix: str, root: str | None = None) -> list[str]:
    """Remove this user's `<root>/<prefix>*` directories whose owner is dead; returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = [e for e in os.listdir(root) if e.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(root, entry)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or not _owner_gone(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d stale %s* director%s of dead processes", len(removed), prefix,
                 "y" if len(removed) == 1 else "ies")
    return removed
