"""Bad input on every endpoint -> a 4xx with an OpenAI-shaped error, never a 500; engines down -> 503."""
import io
import json

import httpx
import pytest
from PIL import Image

from .conftest import API_KEY

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
def test_missing_or_wrong_api_key_is_401(gateway, path):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        r = httpx.request("GET" if path == "/v1/models" else "POST", gateway + path,
                          headers=headers, json={"prompt": "x"})
        assert_error(r, 401, "API key")


def test_health_and_metrics_need_no_key_and_health_reports_engines_down(gateway):
    r = httpx.get(gateway + "/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable"
    assert body["understanding"][0]["status"] == "unavailable"
    assert body["generation"][0]["status"] == "unavailable"
    m = httpx.get(gateway + "/metrics")
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
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "num_inference_steps": 1.5}, "num_inference_steps"),
    ({"prompt": "x", "size": 512}, "size"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "think": 1}, "think"),
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


@pytest.mark.parametrize("steps", [0, 500, -3])
def test_steps_out_of_range(client, steps):
    assert_error(client.post(GEN, json={"prompt": "x", "num_inference_steps": steps}), 400, "between 1")
    # the same option under extra_body is validated the same way
    assert_error(client.post(GEN, json={"prompt": "x", "extra_body": {"num_inference_steps": steps}}),
                 400, "between 1")


@pytest.mark.parametrize("n", [0, 5, 50])
def test_n_out_of_range(client, n):
    assert_error(client.post(GEN, json={"prompt": "x", "n": n}), 400, "'n'")


@pytest.mark.parametrize("prompt", ["", "   ", None])
def test_empty_or_missing_prompt(client, prompt):
    body = {} if prompt is None else {"prompt": prompt}
    err = assert_error(client.post(GEN, json=body), 400, "prompt")
    assert err["param"] == "prompt"


def test_prompt_too_long(client):
    assert_error(client.post(GEN, json={"prompt": "x" * 20000}), 400, "longer than")


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
    {"messages": [{"role": "user", "content": "x"}], "stream": "true"},
    {"messages": [{"role": "user", "content": "x"}], "modalities": "image"},
])
def test_chat_bad_bodies(client, body):
    assert_error(client.post(CHAT, json=body), 400)


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
        {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}
    assert_error(client.post(CHAT, json={**base, "messages": [remote]}), 400, "data URL")


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
                                         ("guidance_scale", "x"), ("stream", "maybe"), ("prompt", "")])
def test_edit_bad_form_fields(client, field, value):
    data = {"prompt": "x", field: value}
    r = client.post(EDIT, data=data, files={"image": ("a.png", png(), "image/png")})
    assert_error(r, 400)


def test_edit_needs_multipart_or_json(client):
    assert_error(client.post(EDIT, content=b"prompt=x", headers={"content-type": "text/plain"}), 400)
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
