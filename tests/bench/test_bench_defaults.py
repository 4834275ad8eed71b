"""bench/gpu_defaults.sh's CPU smoke (the new defaults' side on the tiny checkpoint) fills every figure the GPU run
reports: startup, first vs steady per size, the concurrent pair, what `applied` says."""
import json
import os
import subprocess

from tests.bench.test_bench_smoke import ROOT, Smoke, assert_every_part_filled

SIDE = "cpu-colocate.after"
PARTS = tuple(f"defaults-after/results/{SIDE}/{p}" for p in (
    "startup_s", "sizes/64x64/first/e2e_s", "sizes/64x64/steady/step_s", "sizes/96x64/first_over_steady",
    "pair/alone_s", "pair/together_s", "pair/pair_ratio", "applied/cache", "warmup"))


def test_gpu_defaults_smoke_fills_every_part(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OUT=str(tmp_path))
    proc = subprocess.run(["bash", "bench/gpu_defaults.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(tmp_path / "defaults.json") as f:
        data = json.load(f)
    assert_every_part_filled(data, Smoke(argv=(), parts=PARTS))
    applied = data["defaults-after"]["results"][SIDE]["applied"]
    assert applied["graphs"] == "not_applicable" and applied["fp8"] is False     # CPU, no --quantization
