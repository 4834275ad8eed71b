"""The whole stack through real clients: the openai SDK and raw SSE (colocate mode, CPU, tiny model)."""
import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from services.kit import sse

STEPS = 4


def decode(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()
    return im


def png_bytes(w: int, h: int, color=(30, 160, 90)) -> bytes:
    buf = io.BytesIO()
    arr = np.zeros((h, w, 3), np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    arr[..., 1:] = color[1:]
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def close_to(a: Image.Image, b: Image.Image):
    x = np.asarray(a.convert("RGB"), np.int16)
    y = np.asarray(b.convert("RGB"), np.int16)
    assert x.shape == y.shape
    diff = np.abs(x - y)
    assert diff.mean() < 1.5 and np.percentile(diff, 99) <= 8, (diff.mean(), diff.max())


def test_models(openai_client):
    ids = [m.id for m in openai_client.models.list().data]
    assert ids == ["sensenova-u1"]      # the name the README's examples use


def test_chat(openai_client):
    r = openai_client.chat.completions.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "Hello there"}])
    assert r.model == "sensenova-u1"    # one model name through the stack (understanding serves it too)
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="m", max_tokens=8, stream=True, messages=[{"role": "user", "content": "Count"}]))
    assert chunks
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_images_generate_n2_matches_reference(openai_client, reference):
    import services.model.reference as R
    from services.contract.image import SamplerParams
    r = openai_client.images.generate(model="m", prompt="a red fox", n=2, size="64x64",
                                      response_format="b64_json",
                                      extra_body={"num_inference_steps": STEPS, "seed": 7})
    assert len(r.data) == 2
    got = [decode(d.b64_json) for d in r.data]
    assert all(im.size == (64, 64) and im.format == "PNG" for im in got)
    model, tok = reference
    x, _ = R.text_to_image(model, tok, "a red fox", 64, 64, SamplerParams(num_inference_steps=STEPS), seed=7, n=2)
    for im, ref in zip(got, R.to_pil(x)):
        close_to(im, ref)


def test_images_generate_url_and_formats(openai_client):
    r = openai_client.images.generate(model="m", prompt="a boat", size="96x64", response_format="url",
                                      extra_body={"num_inference_steps": 2, "seed": 1})
    url = r.data[0].url
    assert url.startswith("data:image/png;base64,")
    assert decode(url.split(",", 1)[1]).size == (96, 64)
    for fmt, pil_name in (("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")):
        r = openai_client.images.generate(model="m", prompt="a boat", size="64x32",
                                          extra_body={"num_inference_steps": 2, "seed": 1,
                                                      "output_format": fmt})
        im = decode(r.data[0].b64_json)
        assert im.format == pil_name and im.size == (64, 32)


def test_images_edit_two_files_matches_reference(openai_client, reference):
    import services.model.reference as R
    from services.model.images import load_image
    from services.contract.image import SamplerParams
    a, b = png_bytes(128, 32), png_bytes(64, 64, (0, 40, 200))
    r = openai_client.images.edit(model="m", prompt="make it blue",
                                  image=[("a.png", a, "image/png"), ("b.png", b, "image/png")],
                                  extra_body={"num_inference_steps": STEPS, "seed": 3})
    im = decode(r.data[0].b64_json)
    assert im.size == (128, 32)    # first input's aspect ratio at the default area (64x64)
    model, tok = reference
    x, _ = R.edit(model, tok, "make it blue", [load_image(a), load_image(b)], 128, 32,
                  SamplerParams(num_inference_steps=STEPS, mode="edit"), seed=3)
    close_to(im, R.to_pil(x)[0])


def test_chat_modalities_image(openai_client):
    r = openai_client.chat.completions.create(
        model="m", modalities=["image"], messages=[{"role": "user", "content": "a lighthouse"}],
        extra_body={"image_config": {"size": "64x64", "num_inference_steps": 2, "seed": 5}})
    msg = r.choices[0].message
    images = msg.model_extra["images"] if msg.model_extra and "images" in msg.model_extra else msg.images
    url = images[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert decode(url.split(",", 1)[1]).size == (64, 64)
    assert msg.content[0]["type"] == "image_url"


def test_chat_modalities_image_with_input_image_is_an_edit(stack):
    data = "data:image/png;base64," + base64.b64encode(png_bytes(64, 32)).decode()
    body = {"model": "m", "modalities": ["image"],
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}},
                                                      {"type": "text", "text": "add a hat"}]}],
            "image_config": {"num_inference_steps": 2, "seed": 5}}
    r = httpx.post(stack.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    url = r.json()["choices"][0]["message"]["images"][0]["image_url"]["url"]
    assert decode(url.split(",", 1)[1]).size[0] > decode(url.split(",", 1)[1]).size[1]


def sse_events(resp):
    return list(sse.events(resp.iter_lines(), done=True))


def test_streaming_image_request_events(stack):
    body = {"prompt": "a castle", "size": "64x64", "num_inference_steps": STEPS, "seed": 11,
            "stream": True, "think": True, "max_think_tokens": 6}
    with httpx.stream("POST", stack.base + "/v1/images/generations", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    kinds = [e["type"] for e in events[:-1]]
    assert "image_generation.think_delta" in kinds
    steps = [e["step"] for e in events[:-1] if e["type"] == "image_generation.progress"]
    assert steps == list(range(1, STEPS + 1))
    done = [e for e in events[:-1] if e["type"] == "image_generation.completed"]
    assert len(done) == 1 and decode(done[0]["b64_json"]).size == (64, 64)
    # order: think before progress before the image
    assert kinds.index("image_generation.think_delta") < kinds.index("image_generation.progress") \
        < kinds.index("image_generation.completed")


def test_streaming_edit_events(stack):
    files = [("image", ("a.png", png_bytes(64, 64), "image/png"))]
    with httpx.stream("POST", stack.base + "/v1/images/edits", files=files, timeout=120,
                      data={"prompt": "x", "stream": "true", "num_inference_steps": "2"}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert [e["type"] for e in events[:-1] if "progress" in e["type"]] == ["image_edit.progress"] * 2
    assert events[-2]["type"] == "image_edit.completed" and events[-1] == "[DONE]"


def test_bad_input_against_the_live_stack_then_still_serving(stack, openai_client):
    import openai
    for body in ({"prompt": "x", "size": "65x64"}, {"prompt": "x", "num_inference_steps": 0},
                 {"prompt": "x", "n": 50}, {"prompt": ""}):
        r = httpx.post(stack.base + "/v1/images/generations", json=body, timeout=30)
        assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(stack.base + "/v1/images/edits", data={"prompt": "x"}, timeout=30,
                   files={"image": ("a.png", b"\x89PNG broken", "image/png")})
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        openai_client.images.generate(model="m", prompt="x", size="100x100")
    r = openai_client.images.generate(model="m", prompt="still alive", size="64x64",
                                      extra_body={"num_inference_steps": 1})
    assert decode(r.data[0].b64_json).size == (64, 64)


def test_health_and_metrics(stack):
    h = httpx.get(stack.base + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = httpx.get(stack.base + "/metrics", timeout=10).text
    assert "u1serve_gateway_images_total" in m


def test_chat_modalities_image_stream(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="m", modalities=["image"], stream=True,
        messages=[{"role": "user", "content": "a tree"}],
        extra_body={"image_config": {"size": "64x64", "num_inference_steps": 4, "partial_images": 2},
                    "chat_template_kwargs": {"enable_thinking": True}, "max_think_tokens": 4}))
    deltas = [c.choices[0].delta.model_extra or {} for c in chunks if c.choices]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    images = [img for d in deltas for img in d.get("images") or []]
    previews = [d["partial_image"] for d in deltas if d.get("partial_image")]
    assert reasoning
    assert len(images) == 1 and images[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert [p["partial_image_index"] for p in previews] == [0, 1] and all(p["index"] == 0 for p in previews)
    assert all(p["image_url"]["url"].startswith("data:image/jpeg;base64,") for p in previews)
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="m", modalities=["image"], n=2,
                                              messages=[{"role": "user", "content": "a tree"}])
    assert err.value.body["param"] == "n"


def test_sdk_streaming_images(openai_client):
    events = list(openai_client.images.generate(model="m", prompt="a kite", size="64x64", stream=True,
                                                extra_body={"num_inference_steps": 3, "seed": 2}))
    kinds = [e.type for e in events]
    assert kinds.count("image_generation.progress") == 3
    assert kinds[-1] == "image_generation.completed"
    assert decode(events[-1].b64_json).size == (64, 64)
    edit_events = list(openai_client.images.edit(
        model="m", prompt="x", image=[("a.png", png_bytes(64, 64), "image/png")], stream=True,
        extra_body={"num_inference_steps": 2}))
    assert [e.type for e in edit_events][-1] == "image_edit.completed"
