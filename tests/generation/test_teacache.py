"""TeaCache, the second step-cache policy (services/model/step_cache.py, `"cache": {"mode": "teacache"}`).

- threshold 0 gives the exact image, bit for bit, through the generation service's HTTP API; a positive
  threshold skips steps, and the response's `branch_steps` and /metrics say how many, as for first_block;
- the rescaled change accumulates until it reaches the threshold (a constant polynomial makes the
  schedule of computed steps exact), per resolution bucket of the coefficients file;
- a reused TeaCache step runs no layer at all (not even layer 0) and takes the input + the residual of
  the last computed step;
- a first_block job and a teacache job batched in one forward each equal their own reference.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.contract.image import CacheOptions, SamplerParams
from services.generation.engine import Engine
from services.generation.inputs import parse_job
from services.base.knobs import TEACACHE_COEFFICIENTS
from services.model import reference as R
from services.model import sampler as S
from services.model.step_cache import (BranchState, CacheGroup, StepCache, StepCacheOptions,
                                       polyval, rescaled_change, teacache_bucket)

from tests.model.fused_add_norm_forwards import inputs
from .genhelp import body, errors_of, generate, images_of, prefixes, publish

SPEC = {"width": 128, "height": 128, "num_inference_steps": 4, "guidance_scale": 4.0, "seed": 3}


def _ref(model, pre, spec: dict, cache: CacheOptions | None):
    steps: dict = {}
    params = SamplerParams(num_inference_steps=spec["num_inference_steps"], guidance_scale=spec["guidance_scale"])
    x = R.denoise(model, pre, spec["width"], spec["height"], params, seed=spec["seed"], cache=cache,
                  branch_steps=steps)
    return S.to_uint8(x).numpy()[0], steps


def _coefficients_file(tmp_path, buckets, name: str = "tea.json") -> str:
    path = tmp_path / name      # a new name per content: files are read once per path
    path.write_text(json.dumps({"buckets": [{"max_tokens": m, "coefficients": c} for m, c in buckets]}))
    return str(path)


def test_threshold_zero_is_exact_and_a_positive_one_skips_through_http(gen_server, pool, ref_model):
    pre = prefixes(ref_model, guidance_scale=4.0)
    before = gen_server.metrics()
    got, steps = {}, {}
    cases = [("tea-off", None), ("tea-t0", {"mode": "teacache", "threshold": 0}),
             ("tea-skip", {"mode": "teacache", "threshold": 10.0})]
    for rid, cache in cases:
        b = body(rid, publish(pool, pre), num_inference_steps=3, seed=5)
        if cache:
            b["cache"] = cache
        status, events = generate(gen_server.url, b)
        assert status == 200 and not errors_of(events), events
        steps[rid] = [e["branch_steps"] for e in events if isinstance(e, dict) and e.get("type") == "image"][0]
        got[rid] = images_of(events)[0]
    spec = {**SPEC, "num_inference_steps": 3, "seed": 5}
    exact, _ = _ref(ref_model[0], pre, spec, None)
    assert np.array_equal(got["tea-off"], exact) and np.array_equal(got["tea-t0"], exact)
    assert steps["tea-t0"] == {b: {"computed": 3, "reused": 0} for b in ("cond", "uncond")}
    # the largest threshold: every step after the first reuses (the change of the input is far below 10)
    assert steps["tea-skip"] == {b: {"computed": 1, "reused": 2} for b in ("cond", "uncond")}
    want, counts = _ref(ref_model[0], pre, spec, CacheOptions(mode="teacache", threshold=10.0))
    assert counts == {"cond": (1, 2), "uncond": (1, 2)} and np.array_equal(got["tea-skip"], want)
    assert not np.array_equal(want, exact)
    after = gen_server.metrics()
    for branch in ("cond", "uncond"):
        key = f'u1_gen_branch_steps_reused_total{{branch="{branch}"}}'
        assert after[key] - before.get(key, 0.0) == 2


def test_the_rescaled_change_accumulates_to_the_threshold(ref_model, tmp_path, monkeypatch):
    """A constant polynomial 0.3 and threshold 0.5: reuse once (0.3), compute at 0.6 (the sum resets)."""
    pre = prefixes(ref_model, guidance_scale=4.0)
    monkeypatch.setenv(TEACACHE_COEFFICIENTS.name, _coefficients_file(tmp_path, [(16, [0.3]), (10**6, [5.0])]))
    _, counts = _ref(ref_model[0], pre, SPEC, CacheOptions(mode="teacache", threshold=0.5))
    assert counts == {"cond": (2, 2), "uncond": (2, 2)}      # computed at steps 0 and 2 (128²: 16 tokens)
    monkeypatch.setenv(TEACACHE_COEFFICIENTS.name, _coefficients_file(tmp_path, [(8, [0.3]), (10**6, [5.0])], "tea2.json"))
    _, counts = _ref(ref_model[0], pre, SPEC, CacheOptions(mode="teacache", threshold=0.5))
    assert counts == {"cond": (4, 0), "uncond": (4, 0)}      # the bucket of 16 tokens: 5.0, over the threshold


def test_coefficients_pick_the_bucket_of_the_image(tmp_path):
    path = _coefficients_file(tmp_path, [(4096, [2.0, 0.0]), (1024, [1.0, 0.5, 0.0])])
    assert teacache_bucket(1024, path)["coefficients"] == [1.0, 0.5, 0.0]
    assert teacache_bucket(1025, path)["coefficients"] == [2.0, 0.0]
    assert teacache_bucket(10**6, path)["coefficients"] == [2.0, 0.0]       # past the last bucket: the largest
    assert polyval((1.0, 0.5, 0.0), 2.0) == 5.0 and rescaled_change(2.0, 1000, path) == 5.0
    assert teacache_bucket(16)["coefficients"] == [1.0, 0.0]                 # the packaged file: identity
    # outside the calibrated input range the prediction scales from the range's edge, never below 0
    ranged = tmp_path / "ranged.json"
    ranged.write_text(json.dumps({"buckets": [{"max_tokens": 64, "coefficients": [-5.0, 1.0, 0.0],
                                               "input_change": [0.01, 0.1]}]}))
    assert polyval((-5.0, 1.0, 0.0), 0.2) == 0.0                             # the raw fit past the range
    assert rescaled_change(0.2, 16, str(ranged)) == pytest.approx(2 * (-5 * 0.01 + 0.1))
    assert rescaled_change(0.05, 16, str(ranged)) == pytest.approx(-5 * 0.0025 + 0.05)
    assert rescaled_change(0.005, 16, str(ranged)) == pytest.approx(0.5 * (-5 * 1e-4 + 0.01))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"buckets": []}))
    with pytest.raises(ValueError):
        teacache_bucket(16, str(bad))


def test_a_reused_step_runs_no_layer(ref_model, monkeypatch):
    model = ref_model[0]
    x, rope, attend = inputs(model)
    calls = []
    real = model.gen_layers
    monkeypatch.setattr(model, "gen_layers", lambda *a, **k: calls.append(k) or real(*a, **k))
    group = CacheGroup(0, x.shape[0], BranchState(), StepCacheOptions("teacache", 10.0, 1, 0, None), step=0)
    first = StepCache([group], lambda gs: attend).forward(model, x, rope, attend)
    assert group.compute and calls == [{"start": 0, "stop": None}]
    group.step = 1
    x2 = x * 0.99
    second = StepCache([group], lambda gs: attend).forward(model, x2, rope, attend)
    assert not group.compute and len(calls) == 1                   # no layer ran
    assert torch.equal(second, x2 + (first - x))
    assert group.state.streak == 1 and (group.state.computed, group.state.reused) == (1, 1)


def _engine_job(ref_model, engine, cache: dict | None, rid: str):
    pre = prefixes(ref_model, guidance_scale=4.0)
    spec = parse_job({"request_id": rid, "handles": {b: {} for b in pre}, **SPEC,
                      **({"cache": cache} if cache else {})})
    job = engine.admit_local(spec, {b: p.kv for b, p in pre.items()}, {b: p.t_offset for b, p in pre.items()})
    engine.add(job)
    return job, pre


def test_first_block_and_teacache_jobs_batched_together(ref_model):
    """(An exact job next to a caching one: tests/generation/test_step_cache.py.)"""
    engine = Engine(ref_model[0], prefix_source=None)
    opts = {"fb": {"mode": "first_block", "threshold": 0.5}, "tea": {"mode": "teacache", "threshold": 1.0}}
    jobs = {}
    for rid, cache in opts.items():
        jobs[rid], pre = _engine_job(ref_model, engine, cache, rid)
    while engine.running:
        engine.step()
    for rid, cache in opts.items():
        want, counts = _ref(ref_model[0], pre, SPEC, CacheOptions(**cache))
        assert np.array_equal(S.to_uint8(jobs[rid].x).numpy()[0], want), rid
        assert jobs[rid].branch_steps == {k: {"computed": c, "reused": r} for k, (c, r) in counts.items()}, rid
        assert sum(r for _, r in counts.values()) > 0, rid           # both policies reused on the tiny model


def test_the_public_contract_takes_teacache():
    """The gateway validates image requests with the same contract: the mode is accepted there, a typo is a 400
    naming the field."""
    from pydantic import ValidationError

    from services.contract.image import ImageGenerationRequest
    ok = ImageGenerationRequest.model_validate({"prompt": "a fox", "cache": {"mode": "teacache", "threshold": 0.2}})
    assert ok.cache.mode == "teacache" and ok.cache.reuses
    assert not CacheOptions(mode="teacache", threshold=0).reuses
    with pytest.raises(ValidationError) as e:
        ImageGenerationRequest.model_validate({"prompt": "a fox", "cache": {"mode": "tea_cache"}})
    assert e.value.errors()[0]["loc"][:2] == ("cache", "mode")
