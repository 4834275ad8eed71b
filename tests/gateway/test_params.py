"""Option parsing: defaults, aliases, size rules (pure functions, no server)."""
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError
from services.gateway.params import Options, build_job, merge_options, size_for_aspect


def job(body, cfg=GatewayConfig(), **kw):
    return build_job(cfg, Options(merge_options(body)), "t2i", body.get("prompt", "p"), **kw)


def test_defaults_follow_the_model_spec():
    j = job({"prompt": "p"})
    assert (j.width, j.height, j.num_inference_steps, j.guidance_scale) == (2048, 2048, 50, 4.0)
    assert (j.cfg_norm, j.timestep_shift, j.image_guidance_scale, j.n) == ("none", 3.0, 1.0, 1)
    assert j.response_format == "b64_json" and j.output_format == "png"


def test_extra_body_and_aliases():
    j = job({"prompt": "p", "extra_body": {"steps": 8, "cfg_scale": 2.5, "seed": 7}, "size": "1536x1024"})
    assert (j.num_inference_steps, j.guidance_scale, j.seed, j.width, j.height) == (8, 2.5, 7, 1536, 1024)
    assert job({"prompt": "p", "size": "auto"}).size == "2048x2048"
    assert job({"prompt": "p", "output_format": "JPG"}).output_format == "jpeg"


def test_edit_default_size_follows_first_image_aspect_at_default_area():
    j = build_job(GatewayConfig(), Options({}), "edit", "p", ["x"], first_image_wh=(1600, 900))
    assert j.width % 32 == 0 and j.height % 32 == 0
    assert abs(j.width / j.height - 16 / 9) < 0.05
    assert abs(j.width * j.height - 2048 * 2048) / (2048 * 2048) < 0.05


def test_aspect_ratio_sizes():
    assert size_for_aspect(GatewayConfig(), 1.0) == (2048, 2048)
    w, h = size_for_aspect(GatewayConfig(default_size=(64, 64)), 3.0)
    assert (w, h) == (96, 32)


def test_form_values_are_coerced():
    opts = Options({"n": "2", "num_inference_steps": "4", "guidance_scale": "3.5", "stream": "true",
                    "cfg_interval": "[0.1, 0.9]"}, form=True)
    j = build_job(GatewayConfig(), opts, "edit", "p", ["x"], first_image_wh=(64, 64))
    assert (j.n, j.num_inference_steps, j.guidance_scale, j.stream) == (2, 4, 3.5, True)
    assert j.cfg_interval == (0.1, 0.9)


def test_limits_are_configurable():
    cfg = GatewayConfig(max_side=1024, max_steps=10)
    with pytest.raises(APIError) as e:
        job({"prompt": "p", "size": "2048x2048"}, cfg)
    assert "1024" in e.value.message
    with pytest.raises(APIError):
        job({"prompt": "p", "size": "512x512", "num_inference_steps": 11}, cfg)
