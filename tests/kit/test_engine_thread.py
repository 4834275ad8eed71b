"""An engine loop as a thread (the fused mode's unit, kit/engine_thread.py) and the per-loop clocks and GIL probe
(kit/loop_clock.py)."""
from __future__ import annotations

import os
import threading
import time

from services.kit.engine_thread import EngineThread
from services.kit.loop_clock import GilProbe, clocks, loop_clock
from services.kit.supervisor import Supervisor


def test_a_thread_unit_reports_like_a_process():
    stop = threading.Event()
    ok = EngineThread(stop.wait, (10,), "ok-loop")
    ok.start()
    assert ok.is_alive() and ok.pid == os.getpid() and ok.exitcode is None
    stop.set()
    ok.join(5)
    assert not ok.is_alive() and ok.exitcode == 0 and ok.error is None

    def broken():
        raise RuntimeError("CUDA error: boom")

    bad = EngineThread(broken, (), "bad-loop")
    bad.start()
    bad.join(5)
    assert bad.exitcode == 1 and bad.error == "RuntimeError: CUDA error: boom"


class _Unit:
    """The smallest supervisor unit over an EngineThread (as the engines' units hold their loops)."""

    def __init__(self, target):
        self.loop = EngineThread(target, (), "unit-loop")
        self.loop.start()

    def alive(self):
        return self.loop.is_alive()

    def stop(self):
        self.loop.kill()

    def exit_reason(self):
        return self.loop.error or "ended"

    def stopped_on_purpose(self):
        return False


def test_a_dead_thread_unit_is_not_restarted_in_place():
    """With the thread units' budget of one failure, a dead loop means FAILED with its reason, no second start."""
    from services.kit.restart import RestartPolicy
    started = []

    def spawn():
        started.append(1)
        return _Unit(lambda: (time.sleep(0.3), 1 / 0))

    sup = Supervisor("t", spawn, policy=RestartPolicy(max_failures=1), poll_s=0.05)
    sup.start()
    sup.mark_ready()
    deadline = time.monotonic() + 5
    while sup.state != Supervisor.FAILED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.state == Supervisor.FAILED and "ZeroDivisionError" in sup.last_error and len(started) == 1
    sup.stop()


def test_loop_clock_and_gil_probe():
    clock = loop_clock("test-loop")
    assert clocks()["test-loop"] is clock and clock.busy_for() is None
    clock.begin()
    x = 0
    for i in range(200000):       # holds the GIL: CPU time ~ wall time
        x += i
    assert clock.busy_for() is not None
    clock.end()
    clock.begin()
    time.sleep(0.05)               # waits: no CPU time
    clock.end()
    s = clock.stats()
    assert s["steps"] == 2 and s["wall_s"] >= 0.05 and s["cpu_s"] < s["wall_s"] and s["max_step_ms"] >= 50
    probe = GilProbe(0.001).start()
    time.sleep(0.1)
    probe.stop()
    st = probe.stats()
    assert st["samples"] > 5 and st["mean_wait_ms"] >= 0
