"""An engine loop run as a thread of the serving process (the fused colocate mode, services/fused/), with the face of
the `multiprocessing.Process` the engines' supervisor units hold: start, is_alive, join, kill, exitcode, pid, name.
So a unit's rules stay the same whichever runs the loop: it is dead when its loop returned or raised, its error is
its exit reason.

A thread cannot be killed: `kill()` leaves a loop that ignores its stop request running (it is a daemon thread). The
fused process does not restart a dead or hung engine thread in place: it exits non-zero and its launcher restarts the
whole process (docs/architecture.md, "Fused colocate")."""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

log = logging.getLogger("u1serve.engine_thread")

UNITS = ("process", "thread")     # --engine-unit of both engine servers


class EngineThread:
    def __init__(self, target: Callable, args: tuple, name: str):
        self.name = name
        self._target, self._args = target, args
        self.exitcode: Optional[int] = None
        self.error: Optional[str] = None         # what the loop raised
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self._target(*self._args)
            self.exitcode = 0
        except BaseException as e:   # noqa: BLE001 - the loop's death is this unit's exit reason
            self.error = f"{type(e).__name__}: {e}"
            self.exitcode = 1
            log.error("engine thread %s died: %s", self.name, self.error)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def kill(self) -> None:
        if self._thread.is_alive():
            log.error("engine thread %s did not stop when asked; it cannot be killed (the process must exit)",
                      self.name)

    @property
    def pid(self) -> int:
        return os.getpid()
