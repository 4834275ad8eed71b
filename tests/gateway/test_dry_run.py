"""`u1serve up --dry-run` shows the placement of a multi-GPU profile without starting anything."""
import subprocess
import sys


def test_separate_four_gpu_placement_dry_run(tmp_path):
    model = tmp_path / "u1-8b"
    subprocess.run([sys.executable, "-m", "services.cli", "tiny-checkpoint", str(model), "--variant", "u1-8b"],
                   check=True, capture_output=True)
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--model", str(model), "--mode", "separate",
                          "--device", "cuda", "--und-gpus", "0,1", "--gen-gpus", "2,3", "--und-tp", "2",
                          "--gen-cfg-parallel", "2", "--dry-run"], check=True, capture_output=True, text=True).stdout
    lines = {ln.split(":", 1)[0]: ln for ln in out.splitlines()}
    assert "CUDA_VISIBLE_DEVICES=0,1" in lines["und"] and "--tp 2" in lines["und"]
    assert "CUDA_VISIBLE_DEVICES=2,3" in lines["gen"] and "--cfg-parallel 2" in lines["gen"]
    assert "U1SERVE_GPU_MEMORY_FRACTION" not in out  # separate: each engine owns its GPUs
    bad = subprocess.run([sys.executable, "-m", "services.cli", "up", "--model", str(model), "--mode", "separate",
                          "--device", "cuda", "--und-gpus", "0,1", "--gen-gpus", "1,2", "--dry-run"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "disjoint" in bad.stderr + bad.stdout
