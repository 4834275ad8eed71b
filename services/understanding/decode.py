"""The decode phase of a step: one row for every running request with a single token to feed."""
from __future__ import annotations

from .request import Req


class DecodeManager:
    """Picks a step's decode rows. Each takes one KV slot; while the cache cannot give every row one, the newest
    running request is preempted (its computed tokens stay in the prefix cache), or fails when it is alone."""

    def __init__(self, sched):
        self.sched = sched      # the Scheduler: running requests, free KV, preemption

    def rows(self) -> list[Req]:
        s = self.sched
        decodes = [r for r in s.running if r.is_decode]
        while decodes and s.available() < len(decodes):
            victim = max(s.running, key=lambda r: r.arrival)
            if len(s.running) == 1:
                s.finish(victim, "error", "KV cache exhausted while decoding", "kv_cache_exhausted")
            else:
                s.preempt(victim)
            if victim in decodes:
                decodes.remove(victim)
        return decodes
