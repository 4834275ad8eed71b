"""The yield gate between two engine threads of one process (the fused colocate mode): the in-process signal has
the shm page's API, wakes a waiting denoiser the moment the decode step ends, and keeps the page's bounds."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from services.generation.qos import YieldGate, YieldPolicy
from shm_transfer.yield_signal import ThreadSignal, YieldSignal, in_process


@pytest.fixture
def name():
    return f"u1-fused-yield-{uuid.uuid4().hex[:8]}"


def _gate(name, **kw) -> YieldGate:
    return YieldGate(name, torch.device("cpu"), YieldPolicy(**{"max_wait_s": 2.0, "share": 1.0, "burst_s": 5.0,
                                                               **kw}))


def test_both_engines_get_the_one_in_process_signal(name):
    sig = in_process(name)
    assert YieldSignal.create(name) is sig and YieldSignal.open(name) is sig and in_process(name) is sig
    assert isinstance(sig, ThreadSignal) and sig.busy_for() is None and not sig.replaced()
    sig.set_busy()
    assert 0 <= sig.busy_for() < 1 and sig.steps == 1
    sig.set_idle()
    assert sig.busy_for() is None


def test_the_gate_wakes_when_the_decode_step_ends(name):
    sig = in_process(name)
    gate = _gate(name)
    sig.set_busy()
    threading.Timer(0.2, sig.set_idle).start()
    t0 = time.monotonic()
    gate.boundary()
    waited = time.monotonic() - t0
    assert 0.15 < waited < 0.6 and gate.yields == 1          # woke on the event, not after max_wait_s (2 s)
    t0 = time.monotonic()
    gate.boundary()
    assert time.monotonic() - t0 < 0.1                         # lowered: no wait


def test_bounds_hold_in_process(name):
    """A decode step that never ends: each wait is bounded, all waits within the share; a stale flag is ignored."""
    sig = in_process(name)
    gate = _gate(name, max_wait_s=0.02, share=0.25, burst_s=0.02, stale_s=0.6)
    sig.set_busy()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        gate.boundary()
        time.sleep(0.004)
    elapsed = time.monotonic() - t0
    assert gate.yields > 3 and gate.yielded_s <= 0.25 * elapsed + 0.02 + 0.05
    time.sleep(0.2)
    before = gate.yields
    for _ in range(5):
        gate.boundary()
    assert gate.yields == before                               # older than stale_s: ignored
