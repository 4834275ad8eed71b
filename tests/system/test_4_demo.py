"""`u1serve demo` (the README's first command) works from an empty cache."""
import os
import subprocess
import sys

from PIL import Image

from .stackproc import ROOT


def test_demo_from_scratch(tmp_path):
    out = tmp_path / "demo.png"
    env = {**os.environ, "U1SERVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "services.launch.cli", "demo", "--out", str(out), "--steps", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "[demo] chat reply" in r.stdout and "[demo] timings" in r.stdout
    assert Image.open(out).size == (64, 64)
    assert os.path.exists(tmp_path / "cache" / "tiny-u1" / "config.json")
    assert "[u1serve] stopped" in r.stdout
