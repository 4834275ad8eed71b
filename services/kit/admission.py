"""Admission control: a bounded number of requests waiting or running; the rest get 429 with Retry-After."""
from __future__ import annotations

import contextlib

from .errors import overloaded


class AdmissionGate:
    def __init__(self, limit: int, what: str, retry_after_s: float = 1.0):
        if limit < 1:
            raise ValueError("admission limit must be >= 1")
        self.limit = limit
        self.what = what
        self.retry_after_s = retry_after_s
        self.active = 0
        self.rejected = 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            self.rejected += 1
            raise overloaded(f"too many {self.what} in flight ({self.limit}); retry after "
                             f"{self.retry_after_s:.0f} s", self.retry_after_s)
        self.active += 1

    def release(self) -> None:
        self.active = max(0, self.active - 1)

    @contextlib.contextmanager
    def slot(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()
