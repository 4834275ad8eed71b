"""The issue-13 GPU hand-off script's CPU smoke mode runs (tiny geometry, gloo ranks): bench/gpu_sp_qos.sh
with bench/parts.sh and bench/bench_sp.py, both SP modes (the default), so a refactor cannot break the lead's
GPU run silently."""
import json
import os
import subprocess

from tests.conftest import ROOT as REPO


def test_gpu_sp_qos_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(["bash", "bench/gpu_sp_qos.sh", "--smoke", "--only", "sp,comm"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.load(open(tmp_path / "sp_qos.json"))
    assert set(res) == {"sp", "comm"}
    assert all("step_s" in r for r in res["sp"].values()), res["sp"]
    for mode in ("ulysses", "kv-gather"):      # every SP case and each mode's per-layer collective
        assert {"tiny g1 sp x2 " + mode, "tiny g4 sp x2 " + mode, "tiny g1 sp x2 " + mode + " graphs"} <= set(res["sp"])
        assert sum(k.endswith(", " + mode) and "step_s" in r for k, r in res["comm"].items()) == 1, res["comm"]
    # the final state of every multi-rank case matches one rank's (fp32 here; a layout bug is O(1))
    assert all(r["diff_vs_one_gpu"] < 1e-4 for k, r in res["sp"].items() if " x2" in k), res["sp"]
