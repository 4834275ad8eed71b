"""Interleaved text-and-image answers through the whole stack (chat `modalities: ["text", "image"]`), against the
reference interleave loop on the same tiny checkpoint: the same text segments, the same images (each one the k-th
noise draw of one seeded generator, re-encoded from its float pixels for what follows), live progress and previews
in the stream, and nothing left behind when the client goes away mid-answer. The random tiny model never predicts
<img> by itself: a small logit_bias on <img> (the reference gets it too) gives "<img>, two tokens, <img>, ..."."""
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from services.kit import sse
from tests.waiting import wait_until

SIZE, STEPS, SEED, BIAS = 64, 2, 9, 0.2
MSGS = [{"role": "user", "content": "Draw a red house, then describe it"}]
IMAGE_CONFIG = {"size": f"{SIZE}x{SIZE}", "num_inference_steps": STEPS, "seed": SEED, "guidance_scale": 4.0,
                "image_guidance_scale": 1.0, "max_images": 2}


def _decode_url(url: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    im.load()
    return im


def _close(a: Image.Image, b: Image.Image):
    x, y = np.asarray(a.convert("RGB"), np.int16), np.asarray(b.convert("RGB"), np.int16)
    assert x.shape == y.shape
    diff = np.abs(x - y)
    assert diff.mean() < 1.5 and np.percentile(diff, 99) <= 8, (diff.mean(), diff.max())


@pytest.fixture(scope="module")
def expected(reference):
    import services.model.reference as R
    from services.contract.image import SamplerParams
    model, tok = reference
    params = SamplerParams(mode="edit", num_inference_steps=STEPS, guidance_scale=4.0, image_guidance_scale=1.0)
    ans = R.interleave(model, tok, MSGS, params, SIZE, SIZE, seed=SEED, think=True, max_new_tokens=40,
                       max_images=2, logit_bias={tok.img_start_id: BIAS})
    assert len(ans.images) == 2 and any(ans.segments), ans.segments
    text = "".join(tok.decode(s, skip_special_tokens=True) for s in ans.segments)
    return ans, text, R.to_pil(__import__("torch").cat(ans.images))


def _body(**kw):
    return {"model": "m", "messages": MSGS, "modalities": ["text", "image"], "max_tokens": 40,
            "logit_bias": {"262": BIAS}, "image_config": dict(IMAGE_CONFIG), **kw}


def test_interleaved_answer_matches_the_reference(openai_client, expected):
    ans, text, ref_images = expected
    r = openai_client.chat.completions.create(**{k: v for k, v in _body().items() if k != "image_config"},
                                              extra_body={"image_config": IMAGE_CONFIG})
    msg = r.choices[0].message
    extra = msg.model_extra or {}
    parts = msg.content
    assert [p["type"] for p in parts].count("image_url") == 2
    images = extra["images"]
    assert [p["image_url"]["url"] for p in parts if p["type"] == "image_url"] == \
        [p["image_url"]["url"] for p in images]
    got_text = (extra.get("reasoning_content") or "") + "".join(p["text"] for p in parts if p["type"] == "text")
    assert got_text == text
    for part, ref in zip(images, ref_images):
        _close(_decode_url(part["image_url"]["url"]), ref)
    assert r.choices[0].finish_reason == ans.finish_reason
    assert r.usage.completion_tokens == sum(len(s) for s in ans.segments)


def _stream(stack, body: dict) -> list:
    with httpx.stream("POST", stack.base + "/v1/chat/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        return list(sse.events(resp.iter_lines(), done=True))


def test_interleaved_stream_in_order_with_progress_and_previews(stack, expected):
    ans, text, ref_images = expected
    cfg = {**IMAGE_CONFIG, "partial_images": 1}
    events = _stream(stack, _body(stream=True, image_config=cfg, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    order, streamed_text = [], ""
    for ev in events[:-1]:
        if not ev["choices"]:
            order.append("usage")
            continue
        delta = ev["choices"][0]["delta"]
        if delta.get("content") or delta.get("reasoning_content"):
            streamed_text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
            order.append("text")
        for key in ("image_progress", "partial_image", "images"):
            if key in delta:
                order.append(key)
        if ev["choices"][0]["finish_reason"]:
            order.append("finish")
    assert streamed_text == text
    images = [img for ev in events[:-1] if ev["choices"] for img in ev["choices"][0]["delta"].get("images", [])]
    assert [img["index"] for img in images] == [0, 1]
    for img, ref in zip(images, ref_images):
        _close(_decode_url(img["image_url"]["url"]), ref)
    # each image: its progress steps, then its preview (x0 estimate), then the image; text in between
    first = order.index("images")
    assert order[:first].count("image_progress") == STEPS and "partial_image" in order[:first]
    assert order[-2:] == ["finish", "usage"]
    previews = [ev["choices"][0]["delta"]["partial_image"] for ev in events[:-1]
                if ev["choices"] and "partial_image" in ev["choices"][0]["delta"]]
    assert [p["index"] for p in previews] == [0, 1] and all(p["partial_image_index"] == 0 for p in previews)
    assert _decode_url(previews[0]["image_url"]["url"]).size == (SIZE, SIZE)


def test_interleaved_answer_validation(stack):
    bad = [({"image_config": {**IMAGE_CONFIG, "cfg_norm": "cfg_zero_star"}}, "cfg_norm"),
           ({"image_config": {**IMAGE_CONFIG, "max_images": 99}}, "max_images"),
           ({"image_config": {**IMAGE_CONFIG, "n": 2}}, "image_config.n"),
           ({"n": 2}, "n")]
    for extra, param in bad:
        r = httpx.post(stack.base + "/v1/chat/completions", json=_body(**extra), timeout=30)
        assert r.status_code == 400, r.text
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def _und_health(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.und_port}/health", timeout=10).json()


def test_client_gone_mid_answer_frees_everything(stack):
    """Disconnect while the second image denoises: the segment's pages, the first image's float pixels and the
    engines' work are all released."""
    body = _body(stream=True, image_config={**IMAGE_CONFIG, "num_inference_steps": 400})
    with httpx.stream("POST", stack.base + "/v1/chat/completions", json=body, timeout=180) as resp:
        seen_image = False
        for line in resp.iter_lines():
            if '"images"' in line:
                seen_image = True
            if seen_image and '"image_progress"' in line:
                break            # the second image is denoising
    assert seen_image

    def idle():
        h = _und_health(stack)
        g = httpx.get(f"http://127.0.0.1:{stack.gen_port}/health", timeout=10).json()
        return h["shm_pages_used"] == 0 and h["running"] == 0 and g["running"] == 0
    assert wait_until(idle, 60, interval=0.2)
    # and the stack still answers
    r = httpx.post(stack.base + "/v1/chat/completions", json=_body(image_config={**IMAGE_CONFIG, "max_images": 1}),
                   timeout=180)
    assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["images"]) == 1
    assert wait_until(idle, 60, interval=0.2)


def test_interleaved_answer_with_an_input_image_three_branches_non_think(stack, reference):
    """An input image (it sits in cond and in tu), g != g_i != 1 (cond, tu and iu branches), enable_thinking false
    (the empty think block), a size list (image k takes size k, the last one repeats): still the reference's
    answer (which equals the official loop bit for bit: tests/model/test_interleave_golden.py). With
    return_token_ids: the prompt's ids, and the answer's as the model's sequence (text, each image's span)."""
    import torch

    import services.model.reference as R
    from services.model.images import load_image
    from services.contract.image import SamplerParams
    model, tok = reference
    buf = io.BytesIO()
    Image.fromarray((np.arange(64 * 96 * 3) % 251).astype(np.uint8).reshape(64, 96, 3)).save(buf, format="PNG")
    png = buf.getvalue()
    text = "Redraw this picture twice"
    ref_msgs = [{"role": "user", "content": [{"type": "image", "image": load_image(png)}, {"type": "text", "text": text}]}]
    params = SamplerParams(mode="edit", num_inference_steps=STEPS, guidance_scale=3.0, image_guidance_scale=2.0)
    sizes = [(SIZE, SIZE), (96, SIZE)]
    ans = R.interleave(model, tok, ref_msgs, params, SIZE, SIZE, seed=SEED, think=False, max_new_tokens=40,
                       max_images=2, logit_bias={tok.img_start_id: BIAS}, sizes=sizes)
    assert len(ans.images) == 2
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = _body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": text}]}],
                 chat_template_kwargs={"enable_thinking": False}, return_token_ids=True,
                 image_config={**IMAGE_CONFIG, "guidance_scale": 3.0, "image_guidance_scale": 2.0,
                               "size": ["64x64", "96x64"]})
    r = httpx.post(stack.base + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    msg = out["choices"][0]["message"]
    assert "".join(p["text"] for p in msg["content"] if p["type"] == "text") == \
        "".join(tok.decode(s, skip_special_tokens=True) for s in ans.segments)
    assert len(msg["images"]) == len(ans.images)
    for part, ref in zip(msg["images"], [R.to_pil(x)[0] for x in ans.images]):
        _close(_decode_url(part["image_url"]["url"]), ref)
    # return_token_ids: the cond prompt, and the answer as the sequence the model holds
    import services.model.prompts as P
    cond, _ = P.interleave_heads(tok, ref_msgs, False, P.interleave_system_message())
    assert out["prompt_token_ids"] == cond.input_ids
    want = []
    for k, seg in enumerate(ans.segments):
        want += seg
        if k < len(ans.images):
            w, h = sizes[k]
            want += [tok.img_start_id] + [tok.img_context_id] * (w // 32) * (h // 32) + [tok.img_end_id]
    want += [ans.stop_token] if ans.finish_reason == "stop" else []     # vLLM: the stop token ends token_ids
    assert out["choices"][0]["token_ids"] == want
    # streamed: prompt ids on the first chunk, the chunks' ids add up to the same sequence
    events = _stream(stack, {**body, "stream": True})
    chunks = [ev for ev in events[:-1] if ev["choices"]]
    assert chunks[0]["prompt_token_ids"] == cond.input_ids
    assert [t for ev in chunks for t in ev["choices"][0].get("token_ids", [])] == want


def test_size_list_checks(stack):
    for size, param in ((["64x64", "65x64"], "image_config.size[1]"), ([], "size"),
                        (["64x64"] * 17, "size")):
        r = httpx.post(stack.base + "/v1/chat/completions", json=_body(image_config={**IMAGE_CONFIG, "size": size}),
                       timeout=30)
        assert r.status_code == 400, r.text
        assert param in (r.json()["error"]["param"] or ""), r.text
    r = httpx.post(stack.base + "/v1/chat/completions", timeout=30,
                   json={**_body(image_config={**IMAGE_CONFIG, "size": ["64x64"]}), "modalities": ["image"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_config.size", r.text
