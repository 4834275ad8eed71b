"""Step caching (first-block residual reuse, per CFG branch) and CFG truncation.

- threshold 0 gives the exact image, bit for bit, through the generation service's HTTP API;
- in one packed forward a branch that reuses skips layers 1.. while the other branch of the same job
  computes them, and the engine's image equals the reference pipeline deciding per branch on its own;
- every response and /metrics report the steps each branch computed (under CFG-parallel, each rank's own
  branch: tests/generation/test_cfg_parallel.py, on its shared 2-rank server).
"""
from __future__ import annotations

import numpy as np
import pytest

from services.contract.image import CacheOptions, SamplerParams
from services.generation.engine import Engine
from services.generation.inputs import parse_job
from services.kit.errors import APIError
from services.model import reference as R
from services.model import sampler as S

from .genhelp import body, errors_of, generate, images_of, prefixes, publish


def _params(b: dict) -> SamplerParams:
    return SamplerParams(num_inference_steps=b["num_inference_steps"],
                           guidance_scale=b["guidance_scale"],
                           cfg_interval=tuple(b.get("cfg_interval", (0.0, 1.0))))


def _ref(model, pre, b: dict, cache: CacheOptions | None):
    steps: dict = {}
    x = R.denoise(model, pre, b["width"], b["height"], _params(b), seed=b["seed"], n=b.get("n", 1),
                  cache=cache, branch_steps=steps)
    return S.to_uint8(x).numpy(), steps


def test_threshold_zero_is_exact_through_http(gen_server, pool, ref_model):
    pre = prefixes(ref_model, guidance_scale=4.0)
    before = gen_server.metrics()
    got = {}
    for rid, cache in [("cache-off", None), ("cache-t0", {"mode": "first_block", "threshold": 0})]:
        b = body(rid, publish(pool, pre), num_inference_steps=3, n=2)
        if cache:
            b["cache"] = cache
        status, events = generate(gen_server.url, b)
        assert status == 200 and not errors_of(events), events
        imgs = [e for e in events if isinstance(e, dict) and e.get("type") == "image"]
        assert all(e["branch_steps"] == {"cond": {"computed": 3, "reused": 0},
                                         "uncond": {"computed": 3, "reused": 0}} for e in imgs)
        got[rid] = images_of(events)
    want, _ = _ref(ref_model[0], pre, b, None)
    for off, t0, w in zip(got["cache-off"], got["cache-t0"], want):
        assert np.array_equal(off, w) and np.array_equal(t0, w)
    after = gen_server.metrics()
    for branch in ("cond", "uncond"):
        key = f'u1_gen_branch_steps_computed_total{{branch="{branch}"}}'
        assert after[key] - before.get(key, 0.0) == 6


def _engine(ref_model, cache: dict | None, steps=5, guidance=4.0, rid="job"):
    model = ref_model[0]
    pre = prefixes(ref_model, guidance_scale=guidance)
    spec = parse_job({"request_id": rid, "handles": {b: {} for b in pre}, "width": 128,
                      "height": 128, "num_inference_steps": steps, "guidance_scale": guidance,
                      "seed": 3, **({"cache": cache} if cache else {})})
    engine = Engine(model, prefix_source=None)
    job = engine.admit_local(spec, {b: p.kv for b, p in pre.items()},
                             {b: p.t_offset for b, p in pre.items()})
    engine.add(job)
    return engine, job, pre


def _run(engine, job):
    while not job.flow.done:
        engine.step()
    return S.to_uint8(job.x).numpy()


def test_one_branch_reuses_while_the_other_computes(ref_model):
    # 1) measure each branch's first-block change at step 1 (a threshold that never reuses)
    engine, job, pre = _engine(ref_model, {"mode": "first_block", "threshold": 1e-12}, steps=4)
    engine.step()
    engine.step()
    changes = {b: s.last_change for b, s in job.branch_state.items()}
    assert set(changes) == {"cond", "uncond"} and changes["cond"] != changes["uncond"]
    # 2) a threshold between the two: at step 1 one branch reuses, the other computes
    lo, hi = sorted(changes.values())
    threshold = (lo + hi) / 2
    reuser = min(changes, key=changes.get)
    opts = {"mode": "first_block", "threshold": threshold, "max_consecutive": 1}
    engine, job, pre = _engine(ref_model, opts, steps=4)
    engine.step()
    engine.step()   # step 1: one forward in which only the other branch runs layers 1..
    other = "uncond" if reuser == "cond" else "cond"
    assert job.step_counts() == {reuser: (1, 1), other: (2, 0)}
    got = _run(engine, job)
    counts = job.step_counts()
    # 3) the packed engine decides exactly as the reference deciding per branch alone
    want, ref_counts = _ref(ref_model[0], pre, {"width": 128, "height": 128, "num_inference_steps": 4,
                                                "guidance_scale": 4.0, "seed": 3},
                            CacheOptions(**opts))
    assert ref_counts == counts
    assert np.array_equal(got, want)
    # and reuse changed the image (the cache did something)
    exact, _ = _ref(ref_model[0], pre, {"width": 128, "height": 128, "num_inference_steps": 4,
                                        "guidance_scale": 4.0, "seed": 3}, None)
    assert not np.array_equal(got, exact)


def test_cache_and_exact_jobs_batched_together(ref_model):
    """A caching job and an exact job in one forward: each equals its own reference."""
    opts = {"mode": "first_block", "threshold": 0.5}
    engine, a, pre = _engine(ref_model, opts, steps=4, rid="a")
    _, b, _ = _engine(ref_model, None, steps=4, rid="b")
    engine.add(b)
    while engine.running:
        engine.step()
    spec = {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 4.0, "seed": 3}
    want_a, counts = _ref(ref_model[0], pre, spec, CacheOptions(**opts))
    want_b, _ = _ref(ref_model[0], pre, spec, None)
    assert sum(r for _, r in counts.values()) > 0     # threshold 0.5 reuses on the tiny model
    assert np.array_equal(S.to_uint8(a.x).numpy(), want_a)
    assert np.array_equal(S.to_uint8(b.x).numpy(), want_b)
    assert a.branch_steps == {k: {"computed": c, "reused": r} for k, (c, r) in counts.items()}


def test_cfg_truncation_reuses_the_interval_rule(ref_model):
    engine, job, pre = _engine(ref_model, {"cfg_truncation": 0.4}, steps=5)
    got = _run(engine, job)
    # same as asking for cfg_interval [0, 0.4] directly
    spec = {"width": 128, "height": 128, "num_inference_steps": 5, "guidance_scale": 4.0, "seed": 3,
            "cfg_interval": (0.0, 0.4)}
    want, counts = _ref(ref_model[0], pre, spec, None)
    assert np.array_equal(got, want)
    grid = S.timesteps(5, 3.0).tolist()
    assert job.branch_steps["uncond"]["computed"] == sum(t <= 0.4 for t in grid[:5]) < 5
    assert job.branch_steps["cond"]["computed"] == 5 == counts["cond"][0]


def test_cache_options_validation():
    base = {"request_id": "r", "handles": {"cond": {}}, "guidance_scale": 1.0, "width": 64, "height": 64, "seed": 1}
    ok = parse_job({**base, "cache": {"mode": "first_block", "threshold": 0.1}})
    assert ok.cache.mode == "first_block" and ok.cache.warmup_steps == 1
    defaults = CacheOptions(mode="first_block", threshold=0.2)
    assert parse_job(base, cache_defaults=defaults).cache.threshold == 0.2
    assert parse_job({**base, "cache": {"mode": "off"}},
                     cache_defaults=defaults).cache.model_dump() == {**defaults.model_dump(), "mode": "off"}
    for bad in [{"mode": "tea"}, {"threshold": -1}, {"threshold": "x"}, {"warmup_steps": 1.5},
                {"bogus": 1}, "fast", {"cfg_truncation": 2}]:
        with pytest.raises(APIError) as e:
            parse_job({**base, "cache": bad})
        assert e.value.status == 400 and e.value.param.startswith("cache")
    with pytest.raises(APIError, match="editing ignores"):
        parse_job({**base, "mode": "edit", "guidance_scale": 4.0, "handles": {"cond": {}, "img_cond": {}},
                   "cache": {"cfg_truncation": 0.5}})


def test_bad_cache_is_a_400_over_http(gen_server, pool, ref_model):
    pre = prefixes(ref_model, guidance_scale=4.0)
    handles = publish(pool, pre)
    status, err = generate(gen_server.url, {**body("bad-cache", handles), "cache": {"threshold": -0.5}})
    assert status == 400 and err["error"]["param"].startswith("cache")
    from shm_transfer import KVHandle
    for h in handles.values():   # a rejected job never owned its pages
        pool.release(KVHandle.from_dict(h))


@pytest.mark.parametrize("guidance", [4.0])
def test_reference_threshold_zero_is_exact(ref_model, guidance):
    pre = prefixes(ref_model, guidance_scale=guidance)
    spec = {"width": 128, "height": 128, "num_inference_steps": 3, "guidance_scale": guidance, "seed": 1}
    a, _ = _ref(ref_model[0], pre, spec, None)
    b, counts = _ref(ref_model[0], pre, spec, CacheOptions(mode="first_block", threshold=0.0))
    assert np.array_equal(a, b) and counts == {"cond": (3, 0), "uncond": (3, 0)}


def test_gateway_passes_only_the_cache_fields_the_client_set():
    """Generation fills in its own server defaults for the rest (CacheOptions.over)."""
    from services.contract.image import ImageGenerationRequest
    from services.gateway.config import GatewayConfig
    from services.gateway.jobs import build_job

    def job(body):
        opts = ImageGenerationRequest.model_validate({"prompt": "a fox", **body})
        return build_job(GatewayConfig(), opts, mode="t2i", prompt="a fox", request_id="r")
    handles = {"cond": {}, "uncond": {}}
    assert job({"cache": {"mode": "first_block", "threshold": 0.1}}).generate_body(handles)["cache"] == \
        {"mode": "first_block", "threshold": 0.1}
    assert "cache" not in job({}).generate_body(handles)
