"""Tiny networking helpers shared by the launcher, the engines' rank setup and the tests."""
from __future__ import annotations

import random
import socket

# Ports handed out below the kernel's ephemeral range: an OS-picked port (bind to 0) lies inside that range, where any
# outgoing connection or any process binding port 0 (Ray starts dozens) may take it between our pick and the
# listener's bind -- CI lost a Ray Serve proxy that way ("Failed to bind to address"). Ray's worker ports end at 19999.
_LOW = 20000
_given: set[int] = set()


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


def free_port() -> int:
    """A TCP port on loopback that is free right now, outside the ephemeral range where it can be (else OS-picked);
    never the same port twice in one process."""
    high = _ephemeral_low() - 1
    if high - _LOW >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randint(_LOW, high)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port
