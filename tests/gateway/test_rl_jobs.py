"""An RL request as jobs, as pure functions: the server's limits checked as an image request's are (size, steps,
prompt length through jobs.check_options, the field named as the RL body spells it) plus RL's compute and
trajectory bounds; the plan's bodies carry the checked sampler parameters; the adapters' name resolution."""
import dataclasses

import pytest

from services.contract.image import SamplerParams
from services.contract.rl import RolloutRequest
from services.gateway.adapters import Adapters
from services.gateway.config import GatewayConfig
from services.gateway.rl_jobs import ROLLOUT_PATH, check, own_salt, plan
from services.kit.errors import APIError

BODY = {"prompts": [{"prompt": "a red cat"}, {"prompt": "a blue dog"}], "group_size": 2, "size": "64x64",
        "num_inference_steps": 4, "guidance_scale": 2.0}


def refused(cfg: GatewayConfig, stores: bool = False, **body) -> APIError:
    with pytest.raises(APIError) as e:
        check(cfg, RolloutRequest.model_validate({**BODY, **body}), stores)
    return e.value


def test_rl_limits_are_the_image_requests_and_name_the_rl_field():
    cfg = dataclasses.replace(GatewayConfig(), max_steps=8, max_prompt_chars=20, max_side=128,
                              default_size=(64, 64), sampler=SamplerParams(num_inference_steps=4))
    e = refused(cfg, num_inference_steps=9)
    assert (e.status, e.param) == (400, "num_inference_steps")
    e = refused(cfg, prompts=[{"prompt": "short"}, {"prompt": "x" * 21}])
    assert (e.status, e.param, e.code) == (400, "prompts[1].prompt", "prompt_too_long")
    e = refused(cfg, size="256x64")
    assert (e.status, e.param, e.code) == (400, "size", "invalid_size")
    # RL's own bounds come first (413)
    small = dataclasses.replace(cfg, rl_max_pixel_steps=4 * 4 * 64 * 64 - 1)
    assert refused(small).code == "rl_compute_too_large"
    tight = dataclasses.replace(cfg, rl_max_trajectory_bytes=1024)
    assert refused(tight, stores=True).code == "trajectory_too_large"
    assert check(tight, RolloutRequest.model_validate(BODY), False)      # no trajectory kept: no bound
    # a prompt's group is one job: group_size x branches x pixels in one denoise step (--max-step-pixels)
    rows = dataclasses.replace(cfg, max_step_pixels=2 * 2 * 64 * 64 - 1)
    e = refused(rows)
    assert (e.status, e.param, e.code) == (400, "group_size", "request_too_large")
    assert check(rows, RolloutRequest.model_validate({**BODY, "guidance_scale": 1.0}))   # one branch: fits
    assert check(rows, RolloutRequest.model_validate({**BODY, "think": {"enabled": True}}))   # a job per sample


def test_the_plan_carries_the_checked_sampler_parameters():
    req = RolloutRequest.model_validate({**BODY, "timestep_shift": 2.5, "cfg_norm": "global"})
    samplers = check(GatewayConfig(), req)
    assert samplers == [SamplerParams(mode="t2i", num_inference_steps=4, guidance_scale=2.0, timestep_shift=2.5,
                                      cfg_norm="global")] * 2
    salt = own_salt(None, "rid")
    jobs = plan(req, samplers, "rid", [[], []], salt, ROLLOUT_PATH,
                lambda p, first, n: ({"seed": first, "rl": {"seeds": list(range(first, first + n))}}, n),
                lambda p, sample: {})
    assert [(j.request_id, j.n, j.first_sample) for j in jobs] == [("rid-rl0", 2, 0), ("rid-rl2", 2, 2)]
    assert [j.prefix.cache_salt for j in jobs] == [f"{salt}-0", f"{salt}-1"]
    body = jobs[1].generate_body({"cond": {}, "uncond": {}})
    assert (body["timestep_shift"], body["cfg_norm"], body["width"], body["rl"]["seeds"]) == (2.5, "global", 64,
                                                                                              [2, 3])
    assert "cache" not in body


def test_adapters_resolve_a_requests_model():
    off = Adapters("base", {}, enabled=False)
    assert off.resolve("anything") is None                   # without adapters every name is the model
    on = Adapters("base", {"a": "/p/a"}, enabled=True)
    assert on.resolve("base") is None and on.resolve(None) is None and on.resolve("a") == "a"
    with pytest.raises(APIError) as e:
        on.resolve("b")
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    assert on.models() == [{"id": "a", "object": "model", "created": 0, "owned_by": "u1serve", "root": "/p/a",
                            "parent": "base"}]
