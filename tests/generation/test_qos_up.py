"""`u1serve up` in colocate on CPU with no QoS flag (tiny checkpoint, the real process tree): the default colocate
QoS (services/launch/colocate_qos.py) is wired — both engines get the one page named after the KV pool with the default
share, generation's /health names its gate, stack.json and the ready line report the GPU-sharing choice (time
slicing: MPS is opt-in) — chat decode steps raise the page, images still run with their step cache taking effect,
the gateway refuses sizes above the checkpoint's trained limit, and the page is gone after stop even when the
understanding service (the page's writer) was SIGKILLed."""
from __future__ import annotations

import json
import os
import signal

import httpx

from services.launch.colocate_qos import DEFAULT_YIELD_SHARE
from shm_transfer.yield_signal import YieldSignal, signal_name
from tests.step_cache_probe import assert_cache_took_effect
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


def test_default_colocate_stack_wires_the_qos(tiny_dir, tmp_path):
    s = RunningStack(tiny_dir, "colocate", str(tmp_path))
    name = signal_name(s.pool)
    path = os.path.join("/dev/shm", name)
    try:
        s.wait_ready()
        und, gen = _cmdline(s.pids["und"]), _cmdline(s.pids["gen"])
        assert _flag(und, "--yield-signal") == name
        assert _flag(gen, "--yield-to") == name and float(_flag(gen, "--yield-share")) == DEFAULT_YIELD_SHARE
        with open(s.state_file) as f:
            qos = json.load(f)["qos"]
        assert qos["gpu_sharing"] == "time-slice" and qos["gpu_sharing_asked"] == "auto", qos
        assert qos["gpu_sharing_why"].startswith("MPS is opt-in") and qos["yield_share"] == DEFAULT_YIELD_SHARE, qos
        # on a CPU the console says nothing of GPU sharing or MPS (stack.json still records the choice)
        assert "engines share the CPU; yield gate share 0.05" in s.output() and "MPS" not in s.output()
        health = httpx.get(f"http://127.0.0.1:{s.gen_port}/health", timeout=10).json()
        assert health["yield_gate"] == {"page": name, "share": DEFAULT_YIELD_SHARE}, health
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
            assert_cache_took_effect(s.base)          # the step cache under the gate (issue 25)
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
