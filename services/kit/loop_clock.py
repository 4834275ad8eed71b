"""How long each engine loop's steps take and how much of that its thread ran on a CPU (the GIL's share, measured,
not assumed). Two clock reads per step: wall time (perf_counter) and the loop thread's CPU time (thread_time: the
time it ran, holding the GIL or inside C code that released it; never the time it waited for the GIL, a lock, a
pipe or a device). So for one step:
  cpu_s / wall_s        how much of the step the loop thread ran (the most it can have held the GIL)
  wall_s - cpu_s        how long it waited: for the device, its peers, the GIL
`GilProbe` measures the other side: a thread that sleeps a few ms in a loop and records how late it wakes up is late by
about the time it waited for the GIL (plus the OS's scheduling). Both are cheap enough to run always; the fused
process exposes them at /internal/fused of either service (services/fused/stats.py) and bench/bench_fused.py reads
them under mixed load. Step starts double as the fused process's hang watchdog (`busy_for`)."""
from __future__ import annotations

import threading
import time
from typing import Optional

_clocks: dict[str, "LoopClock"] = {}
_lock = threading.Lock()


class LoopClock:
    def __init__(self, name: str):
        self.name = name
        self.steps = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.max_step_s = 0.0
        self._t0 = self._c0 = 0.0
        self._since: Optional[float] = None   # monotonic start of the step in progress

    def begin(self) -> None:
        self._since = time.monotonic()
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def end(self) -> None:
        if self._since is None:
            return
        wall, cpu = time.perf_counter() - self._t0, time.thread_time() - self._c0
        self._since = None
        self.steps += 1
        self.wall_s += wall
        self.cpu_s += cpu
        self.max_step_s = max(self.max_step_s, wall)

    def busy_for(self) -> Optional[float]:
        """Seconds the step in progress has run (None between steps)."""
        since = self._since
        return None if since is None else time.monotonic() - since

    def stats(self) -> dict:
        n = max(1, self.steps)
        return {"steps": self.steps, "wall_s": round(self.wall_s, 4), "cpu_s": round(self.cpu_s, 4),
                "cpu_share": round(self.cpu_s / self.wall_s, 4) if self.wall_s else 0.0,
                "mean_step_ms": round(1e3 * self.wall_s / n, 3), "mean_cpu_ms": round(1e3 * self.cpu_s / n, 3),
                "max_step_ms": round(1e3 * self.max_step_s, 3)}


def loop_clock(name: str) -> LoopClock:
    """The process's clock of the loop `name` (a fresh one each time the loop starts)."""
    with _lock:
        _clocks[name] = clock = LoopClock(name)
    return clock


def clocks() -> dict[str, LoopClock]:
    with _lock:
        return dict(_clocks)


class GilProbe:
    """A daemon thread: sleeps `period_s`, records how much later than asked it woke up."""

    def __init__(self, period_s: float = 0.001):
        self.period_s = period_s
        self.samples = 0
        self.late_s = 0.0
        self.max_late_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="u1-gil-probe", daemon=True)

    def start(self) -> "GilProbe":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            late = max(0.0, time.perf_counter() - t0 - self.period_s)
            self.samples += 1
            self.late_s += late
            self.max_late_s = max(self.max_late_s, late)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict:
        n = max(1, self.samples)
        return {"samples": self.samples, "mean_wait_ms": round(1e3 * self.late_s / n, 4),
                "max_wait_ms": round(1e3 * self.max_late_s, 3), "period_ms": 1e3 * self.period_s}
