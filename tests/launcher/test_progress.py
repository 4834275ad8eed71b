"""Progress where people wait (services/launch/progress.py), drawn only on a terminal: `u1serve up`'s line per engine
(a stack of stand-in services, and a CPU stack whose engines report their phase in /health, under a
pseudo-terminal), `u1serve convert`'s shards; nothing on a pipe or with U1SERVE_PROGRESS=0. And a CPU start says
nothing of GPU sharing or MPS."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import httpx

from services.contract.health import EnginePhase
from services.launch.progress import Phase, starting_line
from tests.system.stackproc import ROOT, RunningStack, in_terminal

STACK = """
import io, sys
from services.launch.launcher import Stack
from tests.launcher.test_launcher import spec
stack = Stack([spec("alpha", "ok"), spec("beta", "ok")], out=io.StringIO(), grace_s=2, startup_timeout_s=30)
stack.start()
stack.stop()
"""


def test_up_shows_each_engine_on_a_terminal_only():
    code, shown, _ = in_terminal([sys.executable, "-c", STACK])
    assert code == 0, shown
    assert "[u1serve] alpha: ready" in shown and "[u1serve] beta: ready" in shown, shown
    code, shown, _ = in_terminal([sys.executable, "-c", STACK], U1SERVE_PROGRESS="0")
    assert code == 0 and "ready" not in shown, shown
    piped = subprocess.run([sys.executable, "-c", STACK], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert piped.returncode == 0 and "ready" not in piped.stderr, piped.stderr


def test_convert_shows_its_shards(tiny_dir, tmp_path):
    code, shown, _ = in_terminal([sys.executable, "-m", "services.launch.cli", "convert", tiny_dir, str(tmp_path / "q"),
                               "--to", "int8"])
    assert code == 0, shown
    assert "[u1serve] convert to int8" in shown and "shard" in shown, shown


def test_a_cpu_start_says_nothing_of_gpu_sharing():
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", "up", "--model", "tiny", "--device", "cpu",
                        "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert "MPS" not in r.stderr and "GPU sharing" not in r.stderr, r.stderr
    assert "engines share the CPU" in r.stderr


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_engines_line_goes_loading_warming_ready_from_its_health():
    assert starting_line({"status": "loading", "phase": "starting"}) == "loading (starting the engine)"
    assert starting_line({"status": "starting", "phase": "loading_weights"}) == "loading (weights)"
    assert starting_line({"status": "starting", "phase": "warming"}) == "warming (first steps)"
    assert starting_line({"status": "loading", "phase": "capturing_cuda_graphs"}) == \
        "warming (capturing CUDA graphs)"
    assert starting_line({"status": "starting", "phase": "attaching_kv_pool"}) == "warming (attaching the KV pool)"
    assert starting_line({"status": "ok", "phase": "ready"}) == "ready"
    assert starting_line({"status": "starting"}) == "starting (starting)"     # a service without phases
    screen = _Tty()
    line = Phase("[u1serve] generation", stream=screen)
    for phase in ("starting", "loading_weights", "warming", "attaching_kv_pool"):
        line(starting_line({"status": "starting", "phase": phase}))
    line.close("ready")
    shown = screen.getvalue()
    order = [shown.index(f"[u1serve] generation: {text}") for text in
             ("loading (starting the engine)", "loading (weights)", "warming (first steps)",
              "warming (attaching the KV pool)", "ready")]
    assert order == sorted(order), shown
    quiet = io.StringIO()                   # not a terminal: nothing drawn
    line = Phase("[u1serve] generation", stream=quiet)
    line(starting_line({"phase": "warming"}))
    line.close("ready")
    assert quiet.getvalue() == ""


def test_a_cpu_start_shows_each_engines_phases_in_its_health_and_on_the_terminal(tiny_checkpoint, tmp_path):
    stack = RunningStack(tiny_checkpoint(), "colocate", str(tmp_path), terminal=True)
    urls = {"understanding": f"http://127.0.0.1:{stack.und_port}/health",
            "generation": f"http://127.0.0.1:{stack.gen_port}/health"}
    seen: dict[str, list[str]] = {name: [] for name in urls}
    deadline = time.monotonic() + 240
    try:
        while any(seq[-1:] != ["ready"] for seq in seen.values()):
            assert stack.proc.poll() is None and time.monotonic() < deadline, stack.output()
            for name, url in urls.items():
                try:
                    phase = httpx.get(url, timeout=5).json()["phase"]
                except httpx.HTTPError:      # not listening yet
                    continue
                if seen[name][-1:] != [phase]:
                    seen[name].append(phase)
            time.sleep(0.01)
        stack.wait_ready()
        while "gateway healthy" not in stack.output():    # the launcher's start-up is over (Ctrl-C now is a stop)
            assert stack.proc.poll() is None and time.monotonic() < deadline, stack.output()
            time.sleep(0.1)
    finally:
        stack.stop_clean()
    order = list(EnginePhase)
    for name, seq in seen.items():
        # each phase once, in the declared order, from the engine starting to ready
        steps = [order.index(EnginePhase(p)) for p in seq]
        assert steps == sorted(set(steps)), (name, seq)
        assert seq[0] == "starting" and seq[-1] == "ready", (name, seq)
    # a phase can pass between two polls on a fast start (the tiny checkpoint loads in ~0.1 s, its warm-up is short:
    # understanding went from starting to ready between two polls): the log has each one
    assert "loading_weights" in seen["understanding"] or \
        "understanding engine start: loading_weights" in stack.output(), seen
    assert "warming" in seen["generation"] or "generation engine start: warming" in stack.output(), seen
    shown = stack.terminal_output()          # the launcher's line per service, drawn from those /health bodies
    for name in ("und", "gen"):
        assert f"[u1serve] {name}: loading (" in shown and f"[u1serve] {name}: ready" in shown, shown
