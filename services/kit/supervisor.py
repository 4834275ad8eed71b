"""The one supervisor of u1serve: keeps a unit (an engine's rank processes, or one of the launcher's services)
running. When the unit dies it reports why, lets its owner fail the work in flight, backs off exponentially
and starts a fresh unit; after the restart budget (kit.restart) it stays down and says why. A unit that never
became ready since the supervisor started is not restarted at all (a broken checkpoint fails at once, not in a
loop); a unit that exits because it was told to stop is not restarted either.

The watcher is a daemon thread, so the owner may be a thread-based server or an asyncio one (bridge the
callbacks into the loop with `loop.call_soon_threadsafe`)."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Protocol

from .restart import RestartBudget, RestartPolicy

log = logging.getLogger("u1serve.supervisor")


class Unit(Protocol):
    def alive(self) -> bool: ...
    def stop(self) -> None: ...              # kill whatever is left of it (idempotent, bounded time)
    def exit_reason(self) -> str: ...        # why it died, for logs and /health
    def stopped_on_purpose(self) -> bool: ...  # it exited because it was told to (no restart)


class Supervisor:
    STARTING, READY, RESTARTING, FAILED, STOPPED = "starting", "ready", "restarting", "failed", "stopped"

    def __init__(self, name: str, spawn: Callable[[], Unit], *, policy: RestartPolicy = RestartPolicy(),
                 on_death: Optional[Callable[[str], None]] = None,
                 on_give_up: Optional[Callable[[str], None]] = None, poll_s: float = 0.2):
        self.name = name
        self._spawn = spawn
        self.budget = RestartBudget(policy)
        self.on_death = on_death or (lambda reason: None)
        self.on_give_up = on_give_up or (lambda reason: None)
        self.poll_s = poll_s
        self.unit: Optional[Unit] = None
        self.state = self.STARTING
        self.restarts = 0
        self.last_error: Optional[str] = None   # why the previous unit died
        self.failure: Optional[str] = None      # why it stays down (FAILED)
        self._ever_ready = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    # -- owner's side --------------------------------------------------------------------------
    def start(self) -> None:
        self.unit = self._spawn()
        self._thread = threading.Thread(target=self._watch, name=f"{self.name}-supervisor", daemon=True)
        self._thread.start()

    def mark_ready(self, unit: Optional[Unit] = None) -> None:
        """The (given or current) unit is up and serving: the backoff starts over."""
        with self._lock:
            if unit is not None and unit is not self.unit:
                return                    # a late message of a dead unit
            if self.state in (self.STARTING, self.RESTARTING):
                self.state = self.READY
                self._ever_ready = True
                self.budget.healthy()
                if self.restarts:
                    log.warning("%s ready again (restart %d)", self.name, self.restarts)

    @property
    def ready(self) -> bool:
        return self.state == self.READY

    def status(self) -> dict:
        return {"state": self.state, "restarts": self.restarts, "last_error": self.last_error,
                "failure": self.failure}

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self.state = self.STOPPED
            unit = self.unit
        if unit is not None:
            unit.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # -- watcher ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            unit = self.unit
            if unit is None or unit.alive():
                continue
            reason = unit.exit_reason()
            with self._lock:
                if self._stop.is_set():
                    return
                was_ready = self.state == self.READY
                self.state = self.RESTARTING
                self.last_error = reason
            unit.stop()
            try:
                self.on_death(reason)
            except Exception:
                log.exception("%s: cleanup after a death failed", self.name)
            if unit.stopped_on_purpose():
                log.warning("%s stopped (%s); not restarting", self.name, reason)
                self._give_up(f"stopped: {reason}", self.STOPPED)
                return
            if not self._ever_ready:
                self._give_up(f"failed to start: {reason}")
                return
            delay = self.budget.failure(reason)
            if delay is None:
                self._give_up(self.budget.gave_up or reason)
                return
            log.error("%s died (%s)%s; restarting in %.1f s", self.name, reason,
                      "" if was_ready else " before it was ready", delay)
            if self._stop.wait(delay):
                return
            with self._lock:
                if self._stop.is_set():
                    return
                self.restarts += 1
                self.unit = self._spawn()

    def _give_up(self, why: str, state: str = FAILED) -> None:
        with self._lock:
            self.state = state
            self.failure = why
        if state == self.FAILED:
            log.error("%s: %s", self.name, why)
        try:
            self.on_give_up(why)
        except Exception:
            log.exception("%s: give-up handler failed", self.name)
