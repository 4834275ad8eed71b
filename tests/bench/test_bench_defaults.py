"""bench/gpu_defaults.sh's CPU smoke (the new defaults' side, tiny checkpoint) fills every figure the GPU run
reports: startup, first vs steady per size, the concurrent pair, what `applied` says. Its stack runs the
deployment modes that compose — separate placement, CFG parallelism 2, sequence parallelism 2, fp8 — so this is
also where `applied` is checked in those modes (colocate: tests/system/test_speed_options_per_mode.py): the step
cache's reuse counted over every rank's branches, graphs "not_applicable" (no CUDA), fp8 "emulated" (CPU)."""
import json
import os
import subprocess

from tests.bench.test_bench_smoke import ROOT, Smoke, assert_every_part_filled

SIDE = "cpu-separate-cfg2-sp2.after"
PARTS = tuple(f"defaults-after/results/{SIDE}/{p}" for p in (
    "startup_s", "sizes/64x64/first/e2e_s", "sizes/64x64/steady/step_s", "sizes/64x64/first_over_steady",
    "pair/alone_s", "pair/together_s", "pair/pair_ratio", "applied/cache", "applied_cached/cache", "warmup"))
STEPS, BRANCHES = 4, 2                   # bench_defaults.applied: 4 steps, CFG


def test_gpu_defaults_smoke_fills_every_part(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OUT=str(tmp_path))
    proc = subprocess.run(["bash", "bench/gpu_defaults.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(tmp_path / "defaults.json") as f:
        data = json.load(f)
    assert_every_part_filled(data, Smoke(argv=(), parts=PARTS))
    result = data["defaults-after"]["results"][SIDE]
    plain, cached = result["applied"], result["applied_cached"]
    assert plain["cache"] == {"computed": STEPS * BRANCHES, "reused": 0} and plain["cache_mode"] == "off"
    assert cached["cache_mode"] == "first_block"
    assert cached["cache"] == {"computed": BRANCHES, "reused": (STEPS - 1) * BRANCHES}   # the cache took effect
    for a in (plain, cached):
        assert a["graphs"] == "not_applicable" and a["graph_steps"] == 0                 # no CUDA: said so
        assert a["fp8"] == "emulated" and a["fp8_steps"] == STEPS                        # fp8 numerics on a CPU
