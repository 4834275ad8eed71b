"""Tiny networking helpers shared by the launcher, the engines' rank setup and the tests."""
from __future__ import annotations

import os
import random
import socket
import stat
import tempfile
import time

# Ports handed out below the kernel's ephemeral range: an OS-picked port (bind to 0) lies inside that range, where any
# outgoing connection or any process binding port 0 (Ray starts dozens) may take it between our pick and the
# listener's bind -- CI lost a Ray Serve proxy that way ("Failed to bind to address"). Ray's worker ports end at 19999.
_LOW = 20000
_given: set[int] = set()
# A port handed out is claimed on this host for CLAIM_S (a file named after it, in a directory of this user's): another
# process's free_port skips it. Without the claim, two processes that both pick before either binds (parallel test
# workers, a test and a launcher) can get the same port; the first to bind wins and the other's health poll is
# answered by the winner (a test set up against another test's server finds "connection refused" once that one stops:
# the likely cause of tests/generation/test_e2e_understanding.py failing beside a second pytest-xdist worker).
CLAIM_S = 600.0
CLAIMS = os.path.join(tempfile.gettempdir(), f"u1serve-ports-{os.getuid()}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _claims_dir() -> str | None:
    """The claim directory (made private on first use); None where it cannot be trusted (another user's, a link)."""
    try:
        os.makedirs(CLAIMS, mode=0o700, exist_ok=True)
        st = os.lstat(CLAIMS)
    except OSError:
        return None
    return CLAIMS if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None


def _claim(port: int) -> bool:
    """Claim `port` on this host unless a claim younger than CLAIM_S holds it; True without a claim directory."""
    home = _claims_dir()
    if home is None:
        return True
    path = os.path.join(home, str(port))
    try:
        if time.time() - os.stat(path).st_mtime < CLAIM_S:
            return False
        os.unlink(path)                  # an old claim: its listener bound (or gave up) long ago
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
    except OSError:                      # another process claimed it just now
        return False
    return True


def free_port() -> int:
    """A TCP port on loopback that is free right now, outside the ephemeral range where it can be (else OS-picked);
    never the same port twice in one process, nor in two processes of this user within CLAIM_S."""
    high = _ephemeral_low() - 1
    if high - _LOW >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randint(_LOW, high)
            if port not in _given and _bindable(port) and _claim(port):
                _given.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port
