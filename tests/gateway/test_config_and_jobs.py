"""Settings and job building as pure functions: defaults come from the contract (flags override them), limits
only tighten, secrets come from flags, files or the environment; a request's options become the two internal
bodies under one name per parameter."""
import pytest
from pydantic import ValidationError

from services.contract import limits as L
from services.contract.chat import ChatCompletionRequest
from services.contract.image import ImageGenerationRequest, ImageOptions, SamplerParams, default
from services.gateway.config import GatewayConfig, build_arg_parser, config_from_args
from services.gateway.jobs import build_job, generate_fields, size_for_aspect
from services.gateway.routers.chat import chat_image_options
from services.kit.errors import APIError


def config(*argv: str, env: dict | None = None, monkeypatch=None) -> GatewayConfig:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return config_from_args(build_arg_parser().parse_args(list(argv)))


def job(body: dict, cfg: GatewayConfig = GatewayConfig(), mode: str = "t2i", **kw):
    req = ImageGenerationRequest.model_validate({"prompt": "p", **body})
    return build_job(cfg, req, mode=mode, prompt=req.prompt, request_id="rid-1", **kw)


def test_defaults_are_the_contracts(monkeypatch):
    for var in ("U1SERVE_DEFAULT_STEPS", "U1SERVE_MAX_STEPS", "U1SERVE_DEFAULT_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = config()
    assert cfg.sampler == SamplerParams()
    assert cfg.default_size == (L.DEFAULT_IMAGE_SIDE, L.DEFAULT_IMAGE_SIDE)
    assert cfg.default_think_tokens == default("max_think_tokens")
    assert (cfg.max_steps, cfg.max_side, cfg.max_think_tokens) == (L.MAX_STEPS, L.MAX_IMAGE_SIDE, L.MAX_THINK_TOKENS)
    j = job({}, cfg)
    gen = j.generate_body({"cond": {}, "uncond": {}})
    for name in ("num_inference_steps", "guidance_scale", "image_guidance_scale", "cfg_norm", "timestep_shift",
                 "t_eps"):
        assert gen[name] == default(name), name
    assert (j.width, j.height, j.n, j.output_format, j.response_format) == (2048, 2048, 1, "png", "b64_json")
    assert j.prefix.max_think_tokens == default("max_think_tokens")


def test_flags_and_env_override_defaults(monkeypatch):
    cfg = config("--default-steps", "8", "--default-guidance", "2.5", "--default-timestep-shift", "2",
                 "--default-think-tokens", "64", "--default-size", "512x256",
                 env={"U1SERVE_MAX_STEPS": "100", "U1SERVE_UPSTREAM_IDLE_TIMEOUT_S": "7",
                      "U1SERVE_MAX_CONCURRENT_REQUESTS": "3"}, monkeypatch=monkeypatch)
    assert (cfg.sampler.num_inference_steps, cfg.sampler.guidance_scale, cfg.sampler.timestep_shift) == (8, 2.5, 2.0)
    assert (cfg.max_steps, cfg.upstream_idle_timeout_s, cfg.max_concurrent_requests) == (100, 7.0, 3)
    j = job({}, cfg)
    assert (j.width, j.height, j.prefix.max_think_tokens) == (512, 256, 64)
    assert j.generate_body({"cond": {}, "uncond": {}})["num_inference_steps"] == 8


@pytest.mark.parametrize("argv", [("--max-steps", str(L.MAX_STEPS + 1)), ("--max-side", "8192"),
                                  ("--default-size", "100x100"), ("--default-steps", "0"),
                                  ("--default-steps", "300", "--max-steps", "200"), ("--cache-salt-by-api-key",),
                                  ("--upstream-idle-timeout-s", "0")])
def test_bad_settings_stop_the_start(argv, monkeypatch):
    monkeypatch.delenv("U1SERVE_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        config(*argv)


def test_secrets_from_flags_files_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("U1SERVE_API_KEY", raising=False)
    monkeypatch.delenv("U1SERVE_INTERNAL_TOKEN", raising=False)
    assert config().api_keys == () and config().internal_token is None
    assert config(env={"U1SERVE_API_KEY": "k-env", "U1SERVE_INTERNAL_TOKEN": "t-env"},
                  monkeypatch=monkeypatch).api_keys == ("k-env",)
    assert config().internal_token == "t-env"
    keys, token = tmp_path / "keys", tmp_path / "token"
    keys.write_text("k1\n# comment\n\nk2\n")
    token.write_text("t-file\n")
    cfg = config("--api-key-file", str(keys), "--internal-token-file", str(token), "--cache-salt-by-api-key")
    assert cfg.api_keys == ("k1", "k2") and cfg.internal_token == "t-file" and cfg.cache_salt_by_api_key
    keys.write_text("\n# nothing\n")
    with pytest.raises(SystemExit):
        config("--api-key-file", str(keys))


def test_aliases_extra_body_and_one_name_per_parameter():
    j = job({"extra_body": {"steps": 8, "cfg_scale": 2.5, "seed": 7, "flow_shift": 1.5}, "size": "1536x1024"})
    gen = j.generate_body({"cond": {}, "uncond": {}})
    assert (gen["num_inference_steps"], gen["guidance_scale"], gen["timestep_shift"], gen["seed"]) == (8, 2.5, 1.5, 7)
    assert (j.width, j.height) == (1536, 1024)
    assert job({"size": "auto"}).size == "2048x2048"
    assert job({"output_format": "JPG"}).output_format == "jpeg"
    assert j.prefix_body()["mode"] == "t2i" and j.prefix_body()["guidance_scale"] == 2.5


def test_branches_decide_the_handles_generation_needs():
    assert set(job({"guidance_scale": 1}).prefix.branches()) == {"cond"}
    with pytest.raises(APIError) as e:
        job({"guidance_scale": 1}).generate_body({"cond": {}, "uncond": {}})
    assert e.value.status == 502 and e.value.code == "upstream_protocol_error"


def test_edit_default_size_follows_first_image_aspect_at_default_area():
    j = job({}, mode="edit", images=["x"], first_image_wh=(1600, 900))
    assert j.width % 32 == 0 and j.height % 32 == 0
    assert abs(j.width / j.height - 16 / 9) < 0.05
    assert abs(j.width * j.height - 2048 * 2048) / (2048 * 2048) < 0.05
    with pytest.raises(ValidationError):
        job({"cfg_norm": "cfg_zero_star"}, mode="edit", images=["x"], first_image_wh=(64, 64))


def test_aspect_ratio_sizes():
    assert size_for_aspect(GatewayConfig(), 1.0) == (2048, 2048)
    assert size_for_aspect(GatewayConfig(default_size=(64, 64)), 3.0) == (96, 32)
    assert job({"aspect_ratio": "16:9"}, GatewayConfig(default_size=(64, 64))).size == "96x64"


def test_tightened_limits_are_enforced():
    cfg = GatewayConfig(max_side=1024, max_steps=10, max_think_tokens=100, default_size=(512, 512),
                        sampler=SamplerParams(num_inference_steps=10), default_think_tokens=100)
    with pytest.raises(APIError) as e:
        job({"size": "2048x2048"}, cfg)
    assert "1024" in e.value.message and e.value.param == "size"
    for body, param in (({"num_inference_steps": 11}, "num_inference_steps"),
                        ({"think": True, "max_think_tokens": 101}, "max_think_tokens")):
        with pytest.raises(APIError) as e:
            job({"size": "512x512", **body}, cfg)
        assert e.value.param == param


def test_form_values_are_coerced():
    form = {"n": "2", "num_inference_steps": "4", "guidance_scale": "3.5", "stream": "true",
            "cfg_interval": "[0.1, 0.9]", "size": ""}
    j = job(form, mode="edit", images=["x"], first_image_wh=(64, 64))
    gen = j.generate_body({b: {} for b in j.prefix.branches()})
    assert (j.n, gen["num_inference_steps"], gen["guidance_scale"], j.stream) == (2, 4, 3.5, True)
    assert gen["cfg_interval"] == [0.1, 0.9]


def test_chat_image_options_honour_top_level_aliases_and_image_config():
    body = {"messages": [{"role": "user", "content": "a fox"}], "modalities": ["image"], "flow_shift": 1.25,
            "seed": 9, "stream": True, "extra_body": {"steps": 6},
            "image_config": {"aspect_ratio": "16:9", "cfg_scale": 3.0, "seed": 11},
            "chat_template_kwargs": {"enable_thinking": True}}
    opts = chat_image_options(body, ChatCompletionRequest.model_validate(body))
    assert isinstance(opts, ImageOptions)
    assert (opts.timestep_shift, opts.num_inference_steps, opts.guidance_scale) == (1.25, 6, 3.0)
    assert (opts.seed, opts.aspect_ratio, opts.think, opts.stream) == (11, "16:9", True, True)
    assert opts.n == 1 and opts.response_format == "b64_json"      # chat's n / response_format mean other things
    with pytest.raises(APIError) as e:
        chat_image_options({**body, "extra_body": {"flow_shift": 2}}, ChatCompletionRequest.model_validate(body))
    assert e.value.param == "timestep_shift"


def test_prefix_body_is_a_prefix_request():
    from services.contract.image import PrefixRequest
    body = job({}, cache_salt="s").prefix_body()
    assert body["mode"] == "t2i" and body["cache_salt"] == "s" and body["stream"] is True
    assert PrefixRequest.model_validate(body).mode == "t2i"
    with pytest.raises(ValidationError):          # internal bodies take no unknown fields
        PrefixRequest.model_validate({**body, "kind": "edit"})


def test_an_interleaved_answers_images_use_the_image_job_fields():
    """One builder (jobs.generate_fields) for an image job and each image of an interleaved answer: the same
    options give the same generation body, plus the per-image fields; the step cache carries only what the
    client set (generation fills in its own defaults), in both."""
    from services.contract.chat import ChatImageOptions
    from services.gateway.interleave import Answer, Segment
    cfg = GatewayConfig()
    options = {"size": "96x64", "num_inference_steps": 3, "guidance_scale": 3.0, "image_guidance_scale": 2.0,
               "seed": 5, "output_format": "jpeg", "cache": {"mode": "first_block", "threshold": 0.1}}
    handles = {"cond": {}, "img_cond": {}, "uncond": {}}
    image_job = job(options, cfg, mode="edit", images=["x"])
    answer = Answer(request_id="rid-1", messages=[], think=False, max_tokens=8, max_images=2,
                    generate=generate_fields(cfg, ChatImageOptions.model_validate(options), mode="edit", prompt="",
                                             export_image=True))
    answer.floats.append({})                               # the answer's second image
    seg = Segment(answer, 1).generate_body(handles)
    assert seg == {**image_job.generate_body(handles), "request_id": "rid-1-1", "noise_draws": [[96, 64]],
                   "export_image": True}
    assert seg["cache"] == {"mode": "first_block", "threshold": 0.1}
    with pytest.raises(APIError) as e:                     # understanding sent the wrong branches
        Segment(answer, 1).generate_body({"cond": {}})
    assert e.value.status == 502 and e.value.code == "upstream_protocol_error"
    with pytest.raises(ValidationError):                   # checked before any work: export_image takes n = 1
        generate_fields(cfg, ChatImageOptions.model_validate({**options, "n": 2}), mode="edit", prompt="",
                        export_image=True)
