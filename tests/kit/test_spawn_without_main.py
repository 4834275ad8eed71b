"""Engine ranks start without a copy of their server's main module (services/kit/proc.py start_without_main): a
`spawn` child of a `python -m` process normally re-runs that module (for a server: FastAPI and its routers, about a
second of every start); started this way it imports only its target's module, and the parent's __main__ is as it
was. A real process tree: the probe imports FastAPI and starts one child each way."""
import os
import subprocess
import sys

from tests.system.stackproc import ROOT


def test_the_child_imports_its_target_not_the_parents_main():
    out = subprocess.run([sys.executable, "-m", "tests.kit.spawn_probe"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["plain"] == str({"fastapi": True, "ran": True})            # re-ran the probe's imports
    assert lines["without_main"] == str({"fastapi": False, "ran": True})    # only its target's module
    assert lines["main_keeps"] == "tests.kit.spawn_probe"
