"""The prefill phase of a step: chunks of running requests, then of newly admitted ones, up to the step's budget."""
from __future__ import annotations

from .request import Req

Entry = tuple[Req, int, int]     # (request, first token, end) of one prefill chunk


class PrefillManager:
    """Picks a step's prefill chunks (never splitting an image span, Req.chunk_end)."""

    def __init__(self, sched):
        self.sched = sched      # the Scheduler: running and waiting requests, free KV, admission

    def take(self, budget: int, reserved: int) -> list[Entry]:
        """Chunks of at most `budget` tokens together: running requests first, in arrival order (one that does not
        fit is passed over), then waiting requests admitted in queue order (the first that cannot be admitted or
        does not fit ends the intake). `reserved`: KV slots the step already takes (its decode rows)."""
        s = self.sched
        batch = _Batch(budget, reserved)
        for r in sorted((r for r in s.running if not r.is_decode and r.pending > 0), key=lambda r: r.arrival):
            if batch.budget <= 0:
                break
            batch.add(r, s.available())
        while s.waiting and batch.budget > 0:
            r = s.waiting[0]
            if not (s.admitting or r.admitted_once) or not s.try_admit(r, batch.reserved):
                break
            if not batch.add(r, s.available()):
                break
        return batch.entries


class _Batch:
    def __init__(self, budget: int, reserved: int):
        self.budget, self.reserved = budget, reserved   # reserved: slots the step takes (allocated after selection)
        self.entries: list[Entry] = []

    def add(self, r: Req, available: int) -> bool:
        """Take r's next chunk if it fits the budget (a first chunk may exceed it: an image span) and free KV."""
        end = r.chunk_end(self.budget)
        n = end - r.num_computed
        if (n > self.budget and self.entries) or n + self.reserved > available:
            return False
        self.entries.append((r, r.num_computed, end))
        self.budget -= n
        self.reserved += n
        return True
