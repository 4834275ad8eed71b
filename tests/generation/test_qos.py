"""Colocate QoS protocol: the understanding side raises a shared-memory flag while a decode step runs,
the generation engine yields between layers within a budget. A real writer process drives the flag;
a hung writer is SIGSTOPped, a dead one SIGKILLed: the generation side never waits past its bounds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from services.generation.qos import YieldGate, YieldPolicy
from shm_transfer.yield_signal import YieldSignal, signal_name

from .genhelp import REPO, prefixes

WRITER = r"""
import sys, time
from shm_transfer.yield_signal import YieldSignal
sig = YieldSignal.create(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "busy":
        sig.set_busy()
    elif cmd[0] == "idle":
        sig.set_idle()
    elif cmd[0] == "busy_for":          # raise, hold, lower (one decode step)
        sig.set_busy(); time.sleep(float(cmd[1])); sig.set_idle()
    elif cmd[0] == "quit":
        break
    print("ok", flush=True)
sig.close()
"""


class Writer:
    """A real process holding the writer's end of the page (as the understanding engine does)."""

    def __init__(self, name: str):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert self.proc.stdout.readline().strip() == "ready"

    def send(self, cmd: str, wait: bool = True) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        if wait:
            assert self.proc.stdout.readline().strip() == "ok"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.send("quit", wait=False)
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def name():
    n = signal_name(f"u1qos-test-{uuid.uuid4().hex[:8]}")
    yield n
    try:
        os.unlink(os.path.join("/dev/shm", n))
    except FileNotFoundError:
        pass


@pytest.fixture
def writer(name):
    w = Writer(name)
    yield w
    w.close()


def _gate(name, **kw) -> YieldGate:
    return YieldGate(name, torch.device("cpu"), YieldPolicy(**{"max_wait_s": 2.0, "share": 1.0,
                                                               "burst_s": 5.0, **kw}))


def _timed(gate) -> float:
    t0 = time.monotonic()
    gate.boundary()
    return time.monotonic() - t0


def test_page_round_trip(name):
    assert YieldSignal.open(name) is None                  # no writer: nothing to yield to
    w = YieldSignal.create(name)
    r = YieldSignal.open(name)
    assert r.busy_for() is None and r.steps == 0
    w.set_busy()
    assert 0 <= r.busy_for() < 1 and r.steps == 1
    w.set_idle()
    assert r.busy_for() is None and not r.replaced()
    w.close()                                               # the creator unlinks
    assert r.replaced() and not os.path.exists(os.path.join("/dev/shm", name))
    r.close()


def test_no_writer_no_wait(name):
    gate = _gate(name)
    assert max(_timed(gate) for _ in range(50)) < 0.25 and gate.yields == 0   # a wait would be up to 2 s


def _until_busy(name) -> YieldSignal:
    r = YieldSignal.open(name)
    deadline = time.monotonic() + 10
    while r.busy_for() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return r


def test_waits_while_decode_runs_then_resumes(name, writer):
    gate = _gate(name)
    writer.send("busy_for 0.3", wait=False)
    r = _until_busy(name)
    waited = _timed(gate)
    assert r.busy_for() is None and 0 < waited < 1.5        # returned because the flag dropped
    assert gate.yields == 1
    writer.proc.stdout.readline()
    assert _timed(gate) < 0.25                              # lowered: no wait (a wait: up to 2 s)


def test_hung_writer_bounded_then_ignored(name, writer):
    gate = _gate(name, max_wait_s=0.1, stale_s=0.5)
    writer.send("busy")
    os.kill(writer.proc.pid, signal.SIGSTOP)                # hangs with the flag up
    assert 0.09 < _timed(gate) < 1.0                        # one bounded wait
    time.sleep(0.5)
    assert _timed(gate) < 0.09                              # stale: ignored from now on (a wait: 0.1 s)
    os.kill(writer.proc.pid, signal.SIGCONT)


def test_killed_writer_never_blocks(name, writer):
    gate = _gate(name, max_wait_s=0.1, stale_s=0.3)
    writer.send("busy")
    writer.proc.kill()
    writer.proc.wait()
    t0 = time.monotonic()
    for _ in range(20):
        gate.boundary()
    assert time.monotonic() - t0 < 1.5                      # at most the waits until it went stale
    assert gate.yielded_s < 0.3 + 0.1 + 0.2


def test_share_bounds_the_time_given_away(name, writer):
    """Decode steps back to back: generation still gets at least 1 - share of the wall time."""
    share = 0.25
    gate = _gate(name, max_wait_s=0.02, share=share, burst_s=0.02, stale_s=60)
    writer.send("busy")                                     # a decode step that never ends
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        gate.boundary()
        time.sleep(0.004)                                   # a layer of work
    elapsed = time.monotonic() - t0
    assert gate.yields > 5
    assert gate.yielded_s <= share * elapsed + 0.02 + 0.05  # burst + one overshooting sleep


def test_engine_yields_between_layers_same_image(name, writer, tiny_dir, ref_model):
    from services.generation.engine import Engine
    from services.generation.inputs import parse_job
    from services.model.loader import load_model
    pre = prefixes(ref_model, guidance_scale=4.0)
    body = {"request_id": "q", "handles": {b: {} for b in pre}, "width": 128, "height": 128,
            "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 9}
    model = load_model(tiny_dir, "gen")

    def run(gate):
        engine = Engine(model, None, yield_gate=gate)
        job = engine.admit_local(parse_job(body), {b: p.kv for b, p in pre.items()},
                                 {b: p.t_offset for b, p in pre.items()})
        engine.add(job)
        while engine.running:
            engine.step()
        return job.x

    want = run(None)
    gate = _gate(name, max_wait_s=0.05, stale_s=60)
    writer.send("busy")                                     # the understanding side never lets go
    got = run(gate)
    assert torch.equal(got, want)
    assert gate.yields >= 2 * model.num_layers            # every layer of both steps waited


def test_understanding_raises_the_flag_for_decode_steps(name, tiny_dir):
    """The real understanding service with --yield-signal: every decode step is signalled, and the flag
    is down between requests."""
    import httpx

    from .genhelp import HEADERS, UndServer
    und = UndServer(tiny_dir, f"u1qos-und-{uuid.uuid4().hex[:8]}")
    und.argv += ["--yield-signal", name]
    und.start()
    try:
        page = YieldSignal.open(name)
        assert page is not None and page.steps == 0
        r = httpx.post(und.url + "/v1/chat/completions", headers=HEADERS, timeout=120,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert page.steps >= 5                      # 6 tokens: the prefill samples one, decode steps the rest
        assert page.busy_for() is None
        page.close()
    finally:
        und.stop()
    assert not os.path.exists(os.path.join("/dev/shm", name))   # the writer unlinked it at exit
