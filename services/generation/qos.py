"""Colocate QoS, the generation side: between decoder layers, give the GPU to a waiting decode step.

The understanding engine raises a shared-memory flag while a step with decode rows runs
(shm_transfer/yield_signal.py). At every layer boundary (the engine's `attend` callback) this gate:
  1. keeps this process at most about one layer ahead of its GPU (CUDA events), so stopping to launch
     actually frees the GPU within one layer instead of after a whole queued step;
  2. if the flag is up, fresh, and the budget allows: waits for its own queued work to finish, then
     polls until the flag drops or `max_wait_s` passed.
The budget is a token bucket: yielding may take at most `share` of wall time (burst `burst_s`), so
image steps slow down by at most about that fraction however busy the chat side is. A flag older than
`stale_s` (a writer that died or hangs mid-step) is ignored; each wait is bounded. Yielding never
changes results, only when kernels are launched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shm_transfer.yield_signal import ThreadSignal, YieldSignal

from .config import YIELD_MAX_WAIT_S, YIELD_SHARE

_POLL_S = 50e-6
_REOPEN_EVERY_S = 1.0


@dataclass
class YieldPolicy:
    max_wait_s: float = YIELD_MAX_WAIT_S   # one wait (a decode step of the colocated engine takes ~10 ms)
    share: float = YIELD_SHARE    # at most this fraction of wall time spent yielding
    burst_s: float = 0.1          # ... with bursts up to this long
    stale_s: float = 1.0          # a flag raised longer ago than this is a dead or hung writer


class YieldGate:
    def __init__(self, name: str, device: torch.device, policy: YieldPolicy | None = None):
        self.name = name
        self.device = device
        self.policy = policy or YieldPolicy()
        self.signal: YieldSignal | ThreadSignal | None = None
        self._next_open = 0.0
        self._cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else []
        self._n = 0
        self._budget = self.policy.burst_s
        self._last = time.monotonic()
        self.yields = 0              # waits taken
        self.yielded_s = 0.0         # time spent draining + waiting

    def wrap(self, attend):
        """attend with a yield point before each layer's attention."""
        def gated(layer: int, q, k, v):
            self.boundary()
            return attend(layer, q, k, v)
        return gated

    def _signal(self) -> YieldSignal | ThreadSignal | None:
        now = time.monotonic()
        if now >= self._next_open:
            self._next_open = now + _REOPEN_EVERY_S
            if self.signal is not None and self.signal.replaced():
                self.signal.close()
                self.signal = None
            if self.signal is None:
                self.signal = YieldSignal.open(self.name)
        return self.signal

    def _refill(self, now: float) -> None:
        p = self.policy
        self._budget = min(p.burst_s, self._budget + p.share * (now - self._last))
        self._last = now

    def _wanted(self, sig: YieldSignal | ThreadSignal) -> bool:
        age = sig.busy_for()
        return age is not None and age < self.policy.stale_s

    def boundary(self) -> None:
        sig = self._signal()
        if sig is None:
            return
        ev = None
        if self._cuda:   # stay about one layer ahead of the GPU
            ev = self._events[self._n % 2]
            ev.record()
            if self._n:
                self._events[(self._n + 1) % 2].synchronize()
            self._n += 1
        now = time.monotonic()
        self._refill(now)
        if self._budget <= 0 or not self._wanted(sig):
            return
        if ev is not None:
            ev.synchronize()          # our queued kernels done: the GPU is the decode step's
        deadline = now + min(self.policy.max_wait_s, self._budget)
        while self._wanted(sig) and time.monotonic() < deadline:
            sig.wait_idle(deadline - time.monotonic())
        end = time.monotonic()
        self._refill(end)
        self._budget -= end - now
        self.yields += 1
        self.yielded_s += end - now

    def stats(self) -> dict:
        return {"yields": self.yields, "yielded_s": round(self.yielded_s, 4)}

    def close(self) -> None:
        if self.signal is not None:
            self.signal.close()
            self.signal = None
