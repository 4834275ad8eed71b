"""bench/gpu_memcap.sh's CPU smoke (tiny checkpoint): the accuracy part and one capped colocated stack (and the same
with both engines in one process, `--colocate-engines fused`, and the engines on separate cards) fill every
figure the GPU run reports: per request kind a result, the over-budget requests refused with a clear 4xx (a size over
the plan's limit, a prompt over the context) or served, the engines still up afterwards, the peak memory of each
engine next to the plan's prediction."""
import json
import os
import subprocess

from tests.bench.test_bench_smoke import ROOT, Smoke, assert_every_part_filled

LABEL = "cap4-int8-int8"
RESULT = f"cap24/results/{LABEL}/"
PARTS = ("accuracy/rows",) + tuple(RESULT + p for p in (
    "chat/tokens_per_s", "image-64/s_per_step", "image-128/s_per_step", "edit/s", "interleave/images",
    "over_budget", "peak_bytes/und", "peak_bytes/gen", "plan_bytes/und", "plan_bytes/gen", "startup_s"))


def test_gpu_memcap_smoke_fills_every_part(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OUT=str(tmp_path))
    proc = subprocess.run(["bash", "bench/gpu_memcap.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads((tmp_path / "memcap.json").read_text())
    assert_every_part_filled(data, Smoke(argv=(), parts=PARTS))
    r = data["cap24"]["results"][LABEL]
    for kind in ("chat", "image-64", "image-128", "edit", "interleave"):
        assert r[kind]["status"] == 200, (kind, r[kind])
    over = r["over_budget"]
    assert over["size-over-limit"]["status"] == 400 and "pixels" in over["size-over-limit"]["message"]
    assert over["prompt-over-kv"]["status"] == 400 and over["prompt-over-kv"]["code"] == "context_length_exceeded"
    assert over["four-largest"]["status"] == 200
    assert r["engines_up_after"] is True
    assert (tmp_path / "cap24.md").read_text().count("| 4 GiB | int8 / int8 |") == 1
    fused = data["cap24fused"]["results"][LABEL + "-fused"]
    for kind in ("chat", "image-64", "image-128", "edit", "interleave"):
        assert fused[kind]["status"] == 200, (kind, fused[kind])
    assert fused["over_budget"]["prompt-over-kv"]["status"] == 400 and fused["engines_up_after"] is True
    assert set(fused["peak_bytes"]) == {"fused"} and fused["peak_bytes"]["fused"] > 0
    assert "fused process" in (tmp_path / "cap24fused.md").read_text()
    sep = data["cap24sep"]["results"][LABEL + "-separate"]
    for kind in ("chat", "image-64", "image-128", "edit", "interleave"):
        assert sep[kind]["status"] == 200, (kind, sep[kind])
    assert sep["over_budget"]["prompt-over-kv"]["status"] == 400 and sep["engines_up_after"] is True
    assert sep["peak_bytes"]["und"] > 0 and sep["peak_bytes"]["gen"] > 0
    assert "| 4 GiB per card, separate | int8 / int8 |" in (tmp_path / "cap24sep.md").read_text()
