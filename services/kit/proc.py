"""Process ties: a child dies with its parent (Linux PR_SET_PDEATHSIG), and engine ranks leave stop signals
to their server, so a group-wide SIGTERM shuts down through the server instead of looking like a crash; engine
ranks start without a copy of their server's main module (`start_without_main`)."""
from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_MAIN_HIDDEN = threading.Lock()      # two starts at once must not save each other's hidden __main__ as the original


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


def start_without_main(process) -> None:
    """Start a `spawn` child that imports only its target's module, not a copy of this process's __main__ (a server
    run with `python -m`: FastAPI, its routers and models, ~1 s of a start on an idle core, which an engine rank never
    uses). multiprocessing re-runs __main__ in the child when it has a module spec or a file; for the moment of the
    start it has neither. The target and its arguments must not live in __main__ (they are pickled by name). Anything
    else with a start() (an engine thread) just starts."""
    if not isinstance(process, multiprocessing.process.BaseProcess):
        process.start()
        return
    with _MAIN_HIDDEN:
        main = sys.modules["__main__"]
        spec, had_file = getattr(main, "__spec__", None), hasattr(main, "__file__")
        file = getattr(main, "__file__", None)
        main.__spec__ = None
        if had_file:
            del main.__file__
        try:
            process.start()
        finally:
            main.__spec__ = spec
            if had_file:
                main.__file__ = file
