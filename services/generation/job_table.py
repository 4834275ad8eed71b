"""The HTTP process's table of jobs in flight: who gets each job's events, and whether it still waits.

A job ends exactly once (`finish` pops it under the lock), whichever thread gets there first: the link
reader (done / error from the engine), the event loop (abort, client gone), the queue-timeout thread, or
the supervisor (engine died). The lock guards only the dict: nobody does I/O or calls out while holding it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from services.contract.image import GenerateRequest

from .leases import JobLease
from .protocol import JobFailed


class End:
    """The stream's last internal event (then [DONE])."""


Deliver = Callable[[object], None]   # a JobEvent or END; thread-safe and non-blocking (hands it to the stream's loop)
END = End()


@dataclass
class Ticket:
    job: GenerateRequest
    deliver: Deliver
    unit: object                                 # the engine incarnation it was sent to
    lease: JobLease                              # its pages in the pool: told how the job ends
    submitted: float = field(default_factory=time.monotonic)
    started: Optional[float] = None              # when the engine admitted it (its KV imported)

    @property
    def request_id(self) -> str:
        return self.job.request_id


class JobTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}

    def add_if(self, ticket: Ticket, admit: Callable[[int, bool], None]) -> None:
        """Insert, after `admit(queued, duplicate)` (it raises to refuse) ran under the same lock."""
        with self._lock:
            queued = sum(1 for t in self._tickets.values() if t.started is None)
            admit(queued, ticket.request_id in self._tickets)
            self._tickets[ticket.request_id] = ticket

    def get(self, request_id: str) -> Optional[Ticket]:
        with self._lock:
            return self._tickets.get(request_id)

    def mark_started(self, request_id: str) -> Optional[Ticket]:
        with self._lock:
            t = self._tickets.get(request_id)
            if t is not None and t.started is None:
                t.started = time.monotonic()
            return t

    def finish(self, request_id: str, final: Optional[JobFailed] = None) -> Optional[Ticket]:
        """End the job: deliver `final` (its error) if given, then END. None if it had already ended."""
        with self._lock:
            t = self._tickets.pop(request_id, None)
        if t is not None:
            if final is not None:
                t.deliver(final)
            t.deliver(END)
        return t

    def take_all(self) -> list[Ticket]:
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
        return tickets

    def waiting_longer_than(self, seconds: float) -> list[Ticket]:
        now = time.monotonic()
        with self._lock:
            return [t for t in self._tickets.values() if t.started is None and now - t.submitted > seconds]

    def counts(self) -> tuple[int, int]:
        """(queued, running)."""
        with self._lock:
            queued = sum(1 for t in self._tickets.values() if t.started is None)
            return queued, len(self._tickets) - queued

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._tickets
