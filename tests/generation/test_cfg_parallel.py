"""CFG-parallel over 2 gloo ranks: each rank imports only its branches' prefix KV, velocities are
all-gathered, every rank runs combine + Euler; the image equals the sequential (reference) one."""
from __future__ import annotations

import threading

import pytest
from .genhelp import (assert_same_images_as_reference, GenServer, body, generate, photo, prefixes, publish)


@pytest.fixture(scope="module")
def cfgp_server(tiny_dir, pool):
    # Same torch thread count as the test process: CPU reductions (norms, sums) split work by
    # thread, so bit-exactness with the in-process reference needs it.
    s = GenServer(tiny_dir, pool.name, cfg_parallel=2).start()
    yield s
    s.stop()


def test_cfg_parallel_equals_sequential(cfgp_server, pool, ref_model):
    status, health = cfgp_server.health()
    assert status == 200 and health["cfg_parallel"] == 2 and len(health["engine_pids"]) == 2
    cases = [
        ("cfgp-t2i", prefixes(ref_model, guidance_scale=4.0),
         dict(n=2, cfg_norm="cfg_zero_star")),
        ("cfgp-1branch", prefixes(ref_model, guidance_scale=1.0),
         dict(guidance_scale=1.0, width=160)),
        ("cfgp-edit3", prefixes(ref_model, "edit", "make it blue", [photo(5)], guidance_scale=4.0,
                                image_guidance_scale=1.5),
         dict(mode="edit", guidance_scale=4.0, image_guidance_scale=1.5, num_inference_steps=3)),
    ]
    bodies = {rid: body(rid, publish(pool, pre), **kw) for rid, pre, kw in cases}
    results = {}

    def run(rid):
        results[rid] = generate(cfgp_server.url, bodies[rid])

    threads = [threading.Thread(target=run, args=(rid,)) for rid in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert_same_images_as_reference(ref_model[0], results, cases, bodies)
    assert pool.stats()["pages_used"] == 0  # each rank released its own branches' pages
