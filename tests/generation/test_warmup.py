"""Warm start: the generation engine runs its warm-up jobs before /health turns 200; the understanding
runner's warm-up touches only its scratch slot."""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from services.generation.warmup import parse_sizes

from .genhelp import GenServer


def test_health_waits_for_the_warmup(tiny_dir, pool):
    server = GenServer(tiny_dir, pool.name, "--default-size", "64x64", "--warmup-sizes",
                       "512x512,64x64", "--warmup-steps", "3")
    server.launch()        # /health is watched from the first moment
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = httpx.get(server.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1][0] == 200, seen[-3:]
        assert any(code == 503 for code, _ in seen)          # not ready while loading / warming up
        warm = seen[-1][1]["warmup"]                          # the first 200 already reports it done
        assert warm["sizes"] == ["64x64", "512x512"] and warm["steps"] == 3 and warm["seconds"] > 0
        assert server.metrics()["u1_gen_warmup_seconds"] == warm["seconds"]
        kv_pool = seen[-1][1]["kv_pool"]                      # the pool was there: opened before ready
        assert kv_pool["attached"] and kv_pool["before_ready"] and kv_pool["pool"] == pool.name
        assert kv_pool["warm_import_seconds"] is not None
    finally:
        server.stop()


def test_warmup_sizes_parse():
    assert parse_sizes("2048x2048", "1024x1024, 2048x2048,") == [(2048, 2048), (1024, 1024)]
    assert parse_sizes(None, "") == []
    for bad in ("1000x1024", "big", "0x32"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_warmup_runs_a_cfg_and_a_guidance_1_job_per_size(tiny_checkpoint):
    """Both row counts a request brings (2N with CFG, N without: different GEMM shapes, and for fp8
    possibly different GEMM paths) are warmed; nothing is left running."""
    from services.generation.engine import Engine
    from services.generation.warmup import run_warmup, warmup_jobs
    from services.model.loader import load_model
    jobs = warmup_jobs([(64, 64), (96, 64)], 2)
    assert [(j.width, j.height, len(j.handles), j.guidance_scale) for j in jobs] == [
        (64, 64, 2, 4.0), (64, 64, 1, 1.0), (96, 64, 2, 4.0), (96, 64, 1, 1.0)]
    assert len({j.request_id for j in jobs}) == 4 and warmup_jobs([(64, 64)], 0) == []
    engine = Engine(load_model(tiny_checkpoint("u1"), "gen", quantization="fp8"), None)
    warm = run_warmup(engine, [(64, 64)], 1)
    assert warm["sizes"] == ["64x64"] and warm["steps"] == 1 and not engine.running


def test_understanding_runner_warmup_uses_only_scratch(tiny_checkpoint):
    from services.model.loader import load_model
    from services.understanding.model_runner import ModelRunner
    model = load_model(tiny_checkpoint("u1"), "und")
    runner = ModelRunner(model, 64, 4, 600, "cpu", torch.float32, warmup=True)
    assert runner.kv_pool[:, :, :64].abs().sum() == 0      # no real slot written
    assert runner.kv_pool[:, :, 64].abs().sum() > 0        # the scratch slot was
    assert runner.req_to_token[:4].abs().sum() == 0
    assert ModelRunner(model, 64, 4, 600, "cpu", torch.float32).kv_pool.abs().sum() == 0  # cpu: off by default
