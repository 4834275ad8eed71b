"""Bad input on every endpoint -> a 4xx with an OpenAI-shaped error that names the field and what is allowed,
decided at the gateway from the contract (services/contract) before any work; engines down -> 503."""
import base64
import io

import httpx
import pytest
from PIL import Image

from services.contract import limits as L

from .conftest import API_KEY, API_KEY_2, MAX_STEP_PIXELS, MAX_STEPS

GEN = "/v1/images/generations"
EDIT = "/v1/images/edits"
CHAT = "/v1/chat/completions"


def png(w=96, h=64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def assert_error(r: httpx.Response, status: int, *words: str):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    assert r.headers["x-request-id"]
    return err


# ------------------------------------------------------------------ auth
@pytest.mark.parametrize("path", ["/v1/models", GEN, CHAT, EDIT])
def test_missing_wrong_or_malformed_api_key_is_401(gateway, path):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY},
                    {"Authorization": "Bearer"}, {"Authorization": "Basic " + API_KEY},
                    {"Authorization": "Bearer sk-gat\u00e9way".encode("utf-8")},
                    {"Authorization": b"Bearer \xff\xfe"}):
        r = httpx.request("GET" if path == "/v1/models" else "POST", gateway + path,
                          headers=headers, json={"prompt": "x"})
        err = assert_error(r, 401, "API key")
        assert err["code"] == "invalid_api_key"


def test_every_key_of_the_key_file_works(gateway):
    for key in (API_KEY, API_KEY_2):
        r = httpx.get(gateway + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text


def test_health_needs_no_key_and_reports_engines_down_metrics_need_the_key(gateway):
    r = httpx.get(gateway + "/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable"
    assert body["understanding"][0]["status"] == "unavailable"
    assert body["generation"][0]["status"] == "unavailable"
    assert_error(httpx.get(gateway + "/metrics"), 401, "API key")
    m = httpx.get(gateway + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert m.status_code == 200 and "u1serve_gateway_requests_total" in m.text


def test_models_and_request_id(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["object"] == "model"
    assert r.headers["x-request-id"].startswith("req-")
    r = client.get("/v1/models", headers={"x-request-id": "my-trace-42"})
    assert r.headers["x-request-id"] == "my-trace-42"


def test_unknown_route_is_json_404(client):
    assert_error(client.get("/v1/nothing"), 404)


# ------------------------------------------------------------------ JSON bodies
@pytest.mark.parametrize("path", [GEN, CHAT])
@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"\xff\xfe", b"null"])
def test_malformed_json(client, path, raw):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize("body,param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "n": "two"}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "num_inference_steps": 1.5}, "num_inference_steps"),
    ({"prompt": "x", "size": 512}, "size"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": L.SEED_MAX + 1}, "seed"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
    ({"prompt": "x", "think": 2}, "think"),
    ({"prompt": "x", "max_think_tokens": L.MAX_THINK_TOKENS + 1}, "max_think_tokens"),
    ({"prompt": "x", "guidance_scale": L.MAX_GUIDANCE + 1}, "guidance_scale"),
    ({"prompt": "x", "timestep_shift": 0}, "timestep_shift"),
    ({"prompt": "x", "flow_shift": 1000}, "timestep_shift"),
    ({"prompt": "x", "t_eps": 2}, "t_eps"),
    ({"prompt": "x", "width": 16}, "width"),
    ({"prompt": "x", "cfg_norm": "bogus"}, "cfg_norm"),
    ({"prompt": "x", "cfg_interval": [0.8, 0.2]}, "cfg_interval"),
    ({"prompt": "x", "output_format": "gif"}, "output_format"),
    ({"prompt": "x", "response_format": "file"}, "response_format"),
    ({"prompt": "x", "extra_body": "nope"}, "extra_body"),
    ({"prompt": "x", "seed": 1, "extra_body": {"seed": 2}}, "seed"),
])
def test_generation_wrong_types_and_values(client, body, param):
    err = assert_error(client.post(GEN, json=body), 400)
    assert err["param"] == param


@pytest.mark.parametrize("size", ["100x100", "64x65", "16x64", "8192x64", "big", "64x64x64"])
def test_size_not_multiple_of_32_or_out_of_range(client, size):
    err = assert_error(client.post(GEN, json={"prompt": "x", "size": size}), 400, "multiples of 32")
    assert err["param"] == "size"


@pytest.mark.parametrize("steps", [0, -3, L.MAX_STEPS + 1])
def test_steps_out_of_the_contract_range(client, steps):
    for body in ({"prompt": "x", "num_inference_steps": steps}, {"prompt": "x", "steps": steps},
                 {"prompt": "x", "extra_body": {"num_inference_steps": steps}}):
        err = assert_error(client.post(GEN, json=body), 400, "than or equal to")
        assert err["param"] == "num_inference_steps"


def test_more_images_at_once_than_the_memory_plan_counts(client):
    """--max-step-pixels (what `u1serve plan` counts for one denoise step: n x CFG branches x pixels) refuses a
    request whose one job would take more, before any engine work; fewer branches or images pass the check."""
    big = {"prompt": "x", "size": "1024x1024"}
    assert 3 * 2 * 1024 * 1024 > MAX_STEP_PIXELS >= 2 * 2 * 1024 * 1024
    err = assert_error(client.post(GEN, json={**big, "n": 3}), 400, "n <= 2", "--max-step-pixels")
    assert (err["param"], err["code"]) == ("n", "request_too_large")
    for body in ({**big, "n": 2}, {**big, "n": 3, "guidance_scale": 1}, {"prompt": "x", "n": 4}):
        assert client.post(GEN, json=body).status_code == 503      # valid: the (dead) engines answer


def test_steps_over_the_server_limit(client):
    """--max-steps tightens the contract's limit; the message says this server's limit."""
    err = assert_error(client.post(GEN, json={"prompt": "x", "num_inference_steps": MAX_STEPS + 1}), 400,
                       f"at most {MAX_STEPS}")
    assert err["param"] == "num_inference_steps"


@pytest.mark.parametrize("n", [0, 5, 50])
def test_n_out_of_range(client, n):
    err = assert_error(client.post(GEN, json={"prompt": "x", "n": n}), 400)
    assert err["param"] == "n"


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "guidance_scale": NaN}', b'{"prompt": "x", "seed": Infinity}',
                                 b'{"prompt": "x", "t_eps": 1e999}',
                                 b'{"prompt": "x", "cfg_interval": [0, -Infinity]}'])
def test_non_finite_numbers(client, raw):
    err = assert_error(client.post(GEN, content=raw, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"


def test_cfg_zero_star_is_only_for_text_to_image(client):
    png_file = {"image": ("a.png", png(), "image/png")}
    err = assert_error(client.post(EDIT, data={"prompt": "x", "cfg_norm": "cfg_zero_star"}, files=png_file), 400,
                       "only defined for text-to-image")
    assert err["param"] == "cfg_norm"
    data_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    assert_error(client.post(EDIT, json={"prompt": "x", "image": data_url, "cfg_norm": "cfg_zero_star"}), 400,
                 "only defined for text-to-image")
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "image_url", "image_url": {"url": data_url}}]}],
            "modalities": ["image"], "image_config": {"cfg_norm": "cfg_zero_star"}}
    assert_error(client.post(CHAT, json=chat), 400, "only defined for text-to-image")


@pytest.mark.parametrize("prompt", ["", "   ", None])
def test_empty_or_missing_prompt(client, prompt):
    body = {} if prompt is None else {"prompt": prompt}
    err = assert_error(client.post(GEN, json=body), 400, "prompt")
    assert err["param"] == "prompt"


def test_prompt_too_long(client):
    err = assert_error(client.post(GEN, json={"prompt": "x" * (L.MAX_PROMPT_CHARS + 1)}), 400, "at most")
    assert err["param"] == "prompt"


def test_50mb_body_is_413(client):
    blob = b'{"prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
    r = client.post(GEN, content=blob, headers={"content-type": "application/json"})
    assert_error(r, 413, "larger than")


def test_50mb_chunked_body_is_413(client):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"a" * (1024 * 1024)
        yield b'"}'
    r = client.post(GEN, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "larger than")


# ------------------------------------------------------------------ chat
@pytest.mark.parametrize("body", [
    {"messages": "hi"}, {"messages": []}, {}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "x"}], "stream": "maybe"},
    {"messages": [{"role": "user", "content": "x"}], "modalities": "image"},
    {"messages": [{"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
])
def test_chat_bad_bodies(client, body):
    assert_error(client.post(CHAT, json=body), 400)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", L.MAX_TEMPERATURE + 0.1), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("presence_penalty", -3), ("frequency_penalty", 2.5),
    ("repetition_penalty", 0), ("seed", -1), ("seed", L.SEED_MAX + 1), ("max_tokens", 0), ("n", 0),
    ("n", L.MAX_CHAT_CHOICES + 1), ("top_logprobs", L.MAX_TOP_LOGPROBS + 1), ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"\u00b2": 1}), ("logit_bias", {"9" * 5000: 1}),
    ("stop", [""]), ("stop", ["s"] * (L.MAX_STOP_STRINGS + 1)), ("stop", 5), ("cache_salt", ""),
])
def test_chat_sampling_out_of_range(client, field, value):
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    err = assert_error(client.post(CHAT, json=body), 400)
    assert err["param"] == field, err


def test_chat_image_modality_validates_options(client):
    base = {"messages": [{"role": "user", "content": "a cat"}], "modalities": ["image"]}
    assert_error(client.post(CHAT, json={**base, "image_config": {"size": "33x33"}}), 400, "multiples")
    assert_error(client.post(CHAT, json={**base, "image_config": {"num_inference_steps": 0}}), 400)
    assert_error(client.post(CHAT, json={**base, "image_config": {"aspect_ratio": "wide"}}), 400)
    bad_img = {"role": "user", "content": [
        {"type": "text", "text": "edit"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    assert_error(client.post(CHAT, json={**base, "messages": [bad_img]}), 400, "readable image")
    remote = {"role": "user", "content": [
        {"type": "text", "text": "edit"},
        {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}
    err = assert_error(client.post(CHAT, json={**base, "messages": [remote]}), 400, "data URL")
    assert err["code"] == "remote_images_disabled"
    # a text chat's image parts are checked at the gateway too
    err = assert_error(client.post(CHAT, json={"messages": [remote]}), 400, "data URL")
    assert err["param"] == "messages[0].content[1]"
    only_image = {"role": "user", "content": [bad_img["content"][1]]}
    assert_error(client.post(CHAT, json={**base, "messages": [only_image]}), 400, "needs text")
    assert_error(client.post(CHAT, json={**base, "max_think_tokens": L.MAX_THINK_TOKENS + 1}), 400)
    assert_error(client.post(CHAT, json={**base, "flow_shift": 0}), 400, "timestep_shift")


# ------------------------------------------------------------------ edits (multipart)
def test_edit_broken_image_file(client):
    r = client.post(EDIT, data={"prompt": "x"}, files={"image": ("a.png", b"not a png", "image/png")})
    err = assert_error(r, 400, "readable image")
    assert err["code"] == "invalid_image"


def test_edit_truncated_image_file(client):
    r = client.post(EDIT, data={"prompt": "x"}, files={"image": ("a.png", png()[:60], "image/png")})
    assert_error(r, 400, "readable image")


def test_edit_image_count(client):
    assert_error(client.post(EDIT, data={"prompt": "x"}, files={"unrelated": ("a", b"x")}), 400)
    files = [("image[]", (f"{i}.png", png(), "image/png")) for i in range(5)]
    assert_error(client.post(EDIT, data={"prompt": "x"}, files=files), 400, "at most 4")
    r = client.post(EDIT, data={"prompt": "x"}, files=[("image", ("e.png", b"", "image/png"))])
    assert_error(r, 400)


@pytest.mark.parametrize("field,value", [("n", "many"), ("size", "50x50"), ("num_inference_steps", "0"),
                                         ("guidance_scale", "x"), ("stream", "maybe"), ("prompt", ""),
                                         ("seed", str(L.SEED_MAX + 1)), ("cfg_interval", "[0.9, 0.1]"),
                                         ("max_think_tokens", "99999"), ("timestep_shift", "nan")])
def test_edit_bad_form_fields(client, field, value):
    data = {"prompt": "x", field: value}
    r = client.post(EDIT, data=data, files={"image": ("a.png", png(), "image/png")})
    err = assert_error(r, 400)
    assert err["param"] in (field, "size"), err


def test_edit_needs_multipart_or_json(client):
    err = assert_error(client.post(EDIT, content=b"prompt=x", headers={"content-type": "text/plain"}), 415)
    assert err["code"] == "unsupported_media_type"
    assert_error(client.post(EDIT, json={"prompt": "x"}), 400, "image")


# ------------------------------------------------------------------ engines down -> 503
def test_valid_requests_with_engines_down_are_503(client):
    assert_error(client.post(GEN, json={"prompt": "a cat"}), 503, "unreachable")
    assert_error(client.post(GEN, json={"prompt": "a cat", "stream": True}), 503)
    r = client.post(EDIT, data={"prompt": "x"},
                    files=[("image[]", ("a.png", png(), "image/png")),
                           ("image[]", ("b.png", png(64, 64), "image/png"))])
    assert_error(r, 503)
    msgs = [{"role": "user", "content": "hi"}]
    assert_error(client.post(CHAT, json={"messages": msgs}), 503)
    assert_error(client.post(CHAT, json={"messages": msgs, "stream": True}), 503)
    assert_error(client.post(CHAT, json={"messages": msgs, "modalities": ["image"]}), 503)


def test_openai_sdk_sees_503_as_api_error(gateway):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=gateway + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        c.images.generate(model="m", prompt="a cat", size="64x64")
    assert info.value.status_code == 503
    with pytest.raises(openai.BadRequestError):
        c.images.generate(model="m", prompt="a cat", size="65x64")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway + "/v1", api_key="wrong", max_retries=0).models.list()


def test_still_serving_after_bad_input(client):
    assert client.get("/v1/models").status_code == 200
    metrics = client.get("/metrics").text
    assert 'status="500"' not in metrics
