"""The restart policy of every supervisor (engine processes and the launcher's services): exponential backoff,
and a budget — after `max_failures` failures within `window_s` the unit stays down and says why."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RestartPolicy:
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    max_failures: int = 5
    window_s: float = 600.0


class RestartBudget:
    """Feed it failures; it answers the delay before the next start, or None once the budget is spent."""

    def __init__(self, policy: RestartPolicy = RestartPolicy(), clock=time.monotonic):
        self.policy = policy
        self.clock = clock
        self.failures: collections.deque[float] = collections.deque()
        self.streak = 0                 # failures since the unit last ran healthy
        self.gave_up: Optional[str] = None

    def failure(self, reason: str) -> Optional[float]:
        now = self.clock()
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.window_s:
            self.failures.popleft()
        self.streak += 1
        if len(self.failures) >= self.policy.max_failures:
            self.gave_up = (f"{len(self.failures)} failures in {self.policy.window_s:.0f} s "
                            f"(last: {reason}); not restarting")
            return None
        return min(self.policy.max_delay_s, self.policy.base_delay_s * 2 ** (self.streak - 1))

    def healthy(self) -> None:
        """The unit came up and served: the backoff starts again from the base delay (the window keeps counting)."""
        self.streak = 0
