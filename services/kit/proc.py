"""Process ties: a child dies with its parent (Linux PR_SET_PDEATHSIG), and engine ranks leave stop signals
to their server, so a group-wide SIGTERM shuts down through the server instead of looking like a crash."""
from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def ignore_stop_signals() -> None:
    """SIGINT/SIGTERM are the server's to handle; it stops us."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def preexec_die_with_parent() -> None:
    """`subprocess.Popen(preexec_fn=...)`: the launcher's children get SIGTERM when it dies."""
    die_with_parent(signal.SIGTERM)
