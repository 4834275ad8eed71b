"""The generation server with `--sp 2` in both `--sp-mode`s (two gloo ranks on CPU, the real HTTP service
and pool): its images equal the sequential reference's within fp32 tolerance (the reference is SP1's, bit
for bit: test_generate_reference); /health reports sp, the mode and the trained size limit; a larger
request is 400 `invalid_size` before any KV is imported (its pages freed); an sp that does not divide the
head counts is a start-up error under ulysses, and an unknown mode is one too."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.waiting import wait_until
from .genhelp import (GenServer, body, errors_of, generate, generate_all, images_of, prefixes, publish,
                      reference_pixels)


@pytest.fixture(scope="module", params=["ulysses", "kv-gather"])
def sp_server(request, tiny_dir, pool):
    s = GenServer(tiny_dir, pool.name, "--sp", "2", "--sp-mode", request.param).start()
    s.sp_mode = request.param
    yield s
    s.stop()


def test_health_reports_sp_and_the_trained_size_limit(sp_server):
    status, health = sp_server.health()
    assert status == 200, health
    assert (health["cfg_parallel"], health["sp"], len(health["engine_pids"])) == (1, 2, 2)
    assert health["sp_mode"] == sp_server.sp_mode
    assert health["max_image_tokens"] == 4096            # tiny U1: trained up to 2048² like U1


def test_sp2_images_equal_the_reference(sp_server, pool, ref_model):
    # run together: one forward packs both jobs' segments (rank-major -> canonical rows); 96x96 is 9
    # tokens a segment (5 rows on rank 0, 4 on rank 1)
    cases = [
        ("sp-cfg", prefixes(ref_model, guidance_scale=4.0), dict(width=64, height=64, n=2)),
        ("sp-g1", prefixes(ref_model, guidance_scale=1.0), dict(guidance_scale=1.0, width=96, height=96)),
    ]
    bodies = {rid: body(rid, publish(pool, pre), num_inference_steps=2, **kw) for rid, pre, kw in cases}
    results = generate_all(sp_server.url, bodies)
    for rid, pre, _ in cases:
        status, events = results[rid]
        assert status == 200 and not errors_of(events), events
        want = reference_pixels(ref_model[0], pre, bodies[rid])
        got = images_of(events)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            # fp32: SP changes GEMM row counts, so a value on a rounding edge may move by one level
            diff = np.abs(g.astype(np.int16) - w.astype(np.int16))
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (rid, diff.max(), (diff > 0).mean())
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)   # SP rank 0 freed them after both read


def test_larger_than_trained_is_400_invalid_size_and_frees_the_pages(sp_server, pool, ref_model):
    handles = publish(pool, prefixes(ref_model, guidance_scale=4.0))
    assert pool.stats()["pages_used"] > 0
    status, err = generate(sp_server.url, body("too-big", handles, width=4096, height=2048))
    assert status == 400, err
    assert err["error"]["code"] == "invalid_size" and err["error"]["param"] == "size"
    assert "8192 image tokens" in err["error"]["message"] and "2048x2048" in err["error"]["message"]
    assert wait_until(lambda: pool.stats()["pages_used"] == 0, 10)
    status, health = sp_server.health()
    assert status == 200 and health["running"] == 0 and health["queued"] == 0


def test_sp_that_does_not_divide_the_heads_is_a_startup_error(tiny_dir, pool):
    r = subprocess.run(GenServer(tiny_dir, pool.name, "--sp", "4").argv, env=GenServer.env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--sp 4: sequence parallel 4 must divide the model's 4 attention heads and 2 KV heads" in r.stderr, r.stderr


def test_bad_sp_mode_is_a_startup_error(tiny_dir, pool):
    r = subprocess.run(GenServer(tiny_dir, pool.name, "--sp", "2", "--sp-mode", "ring").argv, env=GenServer.env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--sp-mode: invalid choice" in r.stderr and "ring" in r.stderr and "kv-gather" in r.stderr, r.stderr
