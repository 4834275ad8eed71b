"""`u1serve up --qos-yield-share 0.5` on CPU (colocate, tiny checkpoint, the real process tree): both engines
get the one page named after the KV pool, chat decode steps raise it, images still run, the gateway refuses
sizes above the checkpoint's trained limit, and the page is gone after stop even when the understanding
service (the page's writer) was SIGKILLed."""
from __future__ import annotations

import os
import signal

import httpx

from services.kit.yield_signal import YieldSignal, signal_name
from tests.system.stackproc import RunningStack, group_alive
from tests.waiting import wait_until


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def _groups_mapping(path: str) -> set[int]:
    """Process groups of the processes that have `path` mapped."""
    out = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/maps") as f:
                if path not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                out.add(int(f.read().split(") ", 1)[1].split()[2]))
        except OSError:
            pass
    return out


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_up_with_qos_yield_share(tiny_dir, tmp_path):
    s = RunningStack(tiny_dir, "colocate", str(tmp_path), extra=["--qos-yield-share", "0.5"])
    name = signal_name(s.pool)
    path = os.path.join("/dev/shm", name)
    try:
        s.wait_ready()
        und, gen = _cmdline(s.pids["und"]), _cmdline(s.pids["gen"])
        assert _flag(und, "--yield-signal") == name
        assert _flag(gen, "--yield-to") == name and _flag(gen, "--yield-share") == "0.5"
        page = YieldSignal.open(name)
        assert page is not None and page.busy_for() is None
        with httpx.Client(base_url=s.base, timeout=120) as c:
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert page.steps >= 5 and page.busy_for() is None     # each decode step raised it, then lowered
            r = c.post("/v1/images/generations", json={"prompt": "a fox", "size": "64x64", "num_inference_steps": 2,
                                                       "seed": 3})
            assert r.status_code == 200, r.text
            # the writer (understanding rank 0) and the reader (the generation rank's YieldGate, which reads
            # it before each layer's attention) have the page mapped
            assert {s.pids["und"], s.pids["gen"]} <= _groups_mapping(path)
            # the trained size limit (tiny U1: 2048²) reaches the gateway: refused before any prefill
            r = c.post("/v1/images/generations", json={"prompt": "a fox", "size": "4096x2048"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_size", r.text
        page.close()
        # the writer killed outright leaves its page behind (no exit handler runs) ...
        os.killpg(s.pids["und"], signal.SIGKILL)
        assert wait_until(lambda: not group_alive(s.pids["und"]), 30)
        assert os.path.exists(path)
    finally:
        code = s.stop()
    # ... and stopping the stack removes it with the KV pool
    groups, shm = s.leftovers()
    assert code == 0, s.output()
    # (a SIGKILLed Python may leave multiprocessing semaphores, sem.mp-*: not this test's subject)
    assert not groups and not [e for e in shm if e.startswith(s.pool)], (groups, shm)
    assert not os.path.exists(path)
