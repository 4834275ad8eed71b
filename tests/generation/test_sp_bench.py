"""The issue-13 GPU hand-off script's CPU smoke mode runs (tiny geometry, gloo ranks): bench/gpu_sp_qos.sh
with bench/parts.sh and bench/bench_sp.py, so a refactor cannot break the lead's GPU run silently."""
import json
import os
import subprocess

from .genhelp import REPO


def test_gpu_sp_qos_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(["bash", "bench/gpu_sp_qos.sh", "--smoke", "--only", "sp,comm"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.load(open(tmp_path / "sp_qos.json"))
    assert set(res) == {"sp", "comm"}
    assert all("step_s" in r for r in res["sp"].values()), res["sp"]
