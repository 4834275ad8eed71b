"""Every bench script's CPU smoke mode runs (tiny geometry, seconds), so a refactor cannot break one silently.
The GPU numbers come from the same scripts without the smoke flags (docs/benchmarks/)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMOKE = {
    "generation": ["bench/bench_generation.py", "--device", "cpu", "--tiny", "--size", "128", "--steps", "2"],
    "generation-cfg-parallel": ["bench/bench_generation.py", "--device", "cpu", "--tiny", "--size", "128",
                                "--steps", "2", "--cfg-parallel", "2", "--skip-batching"],
    # the speed-option parts (bench/genperf_parts.py, what bench/gpu_genperf.sh runs on the GPU)
    **{f"generation-{part}": ["bench/bench_generation.py", "--part", part, "--device", "cpu", "--tiny", "--size", "128",
                              "--steps", "1", "--warmup", "1"] for part in ("fp8", "fp8-profile", "warmstart", "preset",
                                                                               "graphs", "addnorm", "fp8-fused",
                                                                               "formats")},
    "handoff": ["bench/bench_handoff.py", "--device", "cpu", "--layers", "2", "--tokens", "17,100", "--iters", "3"],
    "understanding": ["bench/bench_understanding.py", "--tiny", "--device", "cpu", "--dtype", "float32",
                      "--batches", "1,4", "--decode-tokens", "8", "--ttft-len", "64", "--prefix-len", "40",
                      "--ref-tokens", "4"],
    "kernels": ["bench/bench_kernels.py", "--smoke", "--out", "{tmp}"],
    "fp8-kernels": ["bench/bench_fp8_kernels.py", "--smoke"],
    "deployment": ["bench/bench_deployment.py", "--tiny", "--profiles", "cpu-colocate", "--size", "64x64",
                   "--steps", "2", "--chat-tokens", "8", "--requests", "1", "--log-dir", "{tmp}"],
    "quality": ["bench/bench_quality.py", "--smoke"],
    "breakdown-engine": ["bench/bench_breakdown.py", "--part", "engine", "--device", "cpu", "--sizes", "256",
                         "--repeat", "2"],
    "breakdown-services": ["bench/bench_breakdown.py", "--part", "services", "--model", "tiny", "--device", "cpu",
                           "--size", "64", "--steps", "4", "--repeat", "2"],
    "weight-update": ["bench/bench_weight_update.py", "--tiny", "--profiles", "cpu-colocate", "--repeat", "1",
                      "--log-dir", "{tmp}"],
    "interleave": ["bench/bench_interleave.py", "--tiny", "--profiles", "cpu-colocate", "--size", "64x64",
                   "--steps", "2", "--requests", "1", "--log-dir", "{tmp}"],
}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_bench_smoke_mode_runs(name, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in SMOKE[name]]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable] + argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def test_bench_rl_smoke_produces_every_figure(tmp_path):
    """bench/bench_rl.py on the tiny checkpoint: rollout vs plain throughput, the group-prefill comparison and the
    weight-update latency all measured (the GPU run fills docs/benchmarks/rl.md from the same script)."""
    import json
    out = tmp_path / "out"
    argv = ["bench/bench_rl.py", "--tiny", "--profiles", "cpu-colocate", "--sizes", "32", "--steps", "2",
            "--group-size", "2", "--prompts", "2", "--repeat", "1", "--out", str(out), "--log-dir", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable] + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    r = json.loads((out / "bench_rl.json").read_text())["results"]["cpu-colocate"]
    (t,) = r["throughput"]
    assert t["images"] == 4 and t["rollout_img_per_min"] > 0 and t["plain_img_per_min"] > 0
    assert t["trajectory_mb"] > 0
    shared, separate = r["prefill"]
    assert (shared["prefixes"], separate["prefixes"]) == (2, 4)
    assert r["weights"]["api_s"] > 0 and r["weights"]["tensors"] > 0
    assert "| 32² | 2 | 4 |" in (out / "bench_rl.md").read_text()


def test_calibrate_teacache_smoke_writes_every_bucket(tmp_path):
    """bench/calibrate_teacache.py on the tiny checkpoint: one fitted bucket per size, which the step cache reads."""
    import json
    import math

    from services.model.step_cache import rescaled_change
    out = tmp_path / "tea.json"
    argv = ["bench/calibrate_teacache.py", "--smoke", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable] + argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert [b["max_tokens"] for b in data["buckets"]] == [1, 4] and data["random_weights"]
    for b in data["buckets"]:
        assert b["points"] == 8 and len(b["coefficients"]) == 5      # 2 branches x 4 step pairs, degree 4
        assert all(math.isfinite(c) for c in b["coefficients"]) and b["fit_rel_rms_err"] < 1.0
        lo, hi = b["input_change"]
        assert 0 < lo <= hi and rescaled_change((lo + hi) / 2, b["max_tokens"], str(out)) >= 0.0
    assert "| 64² | 4 | 8 |" in proc.stdout
