"""Tiny networking helpers shared by the launcher, the engines' rank setup and the tests."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on loopback that is free right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
