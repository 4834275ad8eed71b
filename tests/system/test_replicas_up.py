"""`u1serve up --und-replicas 2 --gen-replicas 2` on one host: five services, a pool per understanding replica,
the gateway over all of them; a dry run shows the placement on GPUs (in the test process: tests/launcher/dryrun.py)."""
from __future__ import annotations

import httpx
import pytest

from tests.launcher.dryrun import cli, dry_run

from .stackproc import RunningStack, shm_entries

pytestmark = pytest.mark.timeout(600)


def test_dry_run_places_each_replica_on_its_own_gpus_ports_and_pool(tmp_path):
    model = str(tmp_path / "u1-8b")
    assert cli("tiny-checkpoint", model, "--variant", "u1-8b").returncode == 0
    base = ["--mode", "separate", "--und-replicas", "2", "--gen-replicas", "2", "--kv-pool-name", "kvp"]
    done = dry_run(model, *base, "--und-gpus", "0,1", "--gen-gpus", "2,3")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    lines = {ln.split(":", 1)[0]: ln for ln in out.splitlines()}
    assert set(lines) == {"und", "und1", "gen", "gen1", "gateway"}
    assert "CUDA_VISIBLE_DEVICES=0 " in lines["und"] and "CUDA_VISIBLE_DEVICES=1 " in lines["und1"]
    assert "CUDA_VISIBLE_DEVICES=2 " in lines["gen"] and "CUDA_VISIBLE_DEVICES=3 " in lines["gen1"]
    assert "--kv-pool-name kvp " in lines["und"] and "--kv-pool-name kvp-1 " in lines["und1"]
    assert "--kv-pool-name kvp-1 " in lines["gen1"]
    ports = {name: ln.split("--port ")[1].split()[0] for name, ln in lines.items()}
    assert len(set(ports.values())) == 5
    for name in ("und", "und1", "gen", "gen1"):
        assert f"http://127.0.0.1:{ports[name]}" in lines["gateway"]
    bad = dry_run(model, *base, "--und-gpus", "0", "--gen-gpus", "2,3")
    assert bad.returncode != 0 and "--und-gpus" in bad.stderr + bad.stdout


def test_two_by_two_replicas_on_one_host_serve_and_stop_clean(tiny_model, tmp_path):
    s = RunningStack(tiny_model, "colocate", str(tmp_path), extra=["--und-replicas", "2", "--gen-replicas", "2"])
    try:
        s.wait_ready()
        assert set(s.pids) == {"und", "und1", "gen", "gen1", "gateway"}
        for i in range(4):
            r = httpx.post(s.base + "/v1/images/generations", timeout=120,
                           json={"prompt": f"a boat {i}", "num_inference_steps": 2})
            assert r.status_code == 200, r.text
            r = httpx.post(s.base + "/v1/chat/completions", timeout=120,
                           json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            # an interleaved answer: its float images go into the pool of the understanding replica that
            # reads them back, whichever generation replica denoised them (token 262 = <img>, forced)
            r = httpx.post(s.base + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"draw two boats {i}"}], "modalities": ["text", "image"],
                "max_tokens": 8, "logit_bias": {"262": 100},
                "image_config": {"size": "64x64", "num_inference_steps": 2, "max_images": 2}})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["message"]["images"]) == 2
        health = httpx.get(s.base + "/health", timeout=10).json()
        assert health["status"] == "ok" and len(health["understanding"]) == len(health["generation"]) == 2
        assert {s.pool, s.pool + "-1"} <= shm_entries()
    finally:
        code = s.stop()
    groups, shm = s.leftovers()
    assert code == 0, s.output()
    assert not groups and not shm, (groups, shm)
