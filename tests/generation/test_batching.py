"""Step-level dynamic batching: concurrent jobs of different sizes, step counts and CFG settings share
forwards, and each result equals the job run alone (== the reference pipeline, bit-exact in fp32)."""
from __future__ import annotations

from .genhelp import assert_same_images_as_reference, body, generate_all, prefixes, publish


def test_three_concurrent_jobs_equal_each_alone(gen_server, pool, ref_model):
    jobs = [
        ("batch-a", prefixes(ref_model, guidance_scale=4.0),
         dict(width=128, height=128, num_inference_steps=6, seed=1)),
        ("batch-b", prefixes(ref_model, prompt="a green dog", guidance_scale=2.5, cfg_norm="global"),
         dict(width=160, height=128, n=2, num_inference_steps=3, seed=2, guidance_scale=2.5,
              cfg_norm="global")),
        ("batch-c", prefixes(ref_model, prompt="a house", guidance_scale=1.0),
         dict(width=128, height=192, num_inference_steps=4, seed=3, guidance_scale=1.0)),
    ]
    before = gen_server.metrics()
    bodies = {rid: body(rid, publish(pool, pre), **kw) for rid, pre, kw in jobs}
    results = generate_all(gen_server.url, bodies, timeout=120)
    after = gen_server.metrics()

    assert_same_images_as_reference(ref_model[0], results, jobs, bodies)

    # They really shared forwards: more job-steps than batched steps.
    steps = after["u1_gen_steps_total"] - before.get("u1_gen_steps_total", 0)
    job_steps = after["u1_gen_job_steps_total"] - before.get("u1_gen_job_steps_total", 0)
    assert job_steps == 6 + 3 + 4
    assert steps < job_steps
    assert pool.stats()["pages_used"] == 0
