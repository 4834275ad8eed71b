"""The OpenAI details clients rely on, through the gateway with the openai SDK: partial_images (typed stream events
of generations and edits), the official default chat prompt, logprobs / top_logprobs, n choices, stop strings,
stream_options.include_usage, logit_bias."""
import base64
import io

import httpx
import pytest
from PIL import Image

from services.kit import sse

MSGS = [{"role": "user", "content": "Write a short poem"}]


def _img(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()
    return im


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 60)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("partial", [1, 3])
def test_partial_images_generation_typed_events(openai_client, partial):
    events = list(openai_client.images.generate(model="m", prompt="a kite", size="64x64", stream=True,
                                                partial_images=partial, output_format="png",
                                                extra_body={"num_inference_steps": 8, "seed": 2}))
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert all(isinstance(e, ImageGenPartialImageEvent) for e in partials)
    assert [e.partial_image_index for e in partials] == list(range(partial))
    assert all(e.type == "image_generation.partial_image" for e in partials)
    assert all(e.output_format == "jpeg" and _img(e.b64_json).format == "JPEG" for e in partials)
    assert isinstance(events[-1], ImageGenCompletedEvent)
    kinds = [e.type for e in events]
    # evenly spaced among the progress events, all before the final image
    assert kinds.index("image_generation.partial_image") > kinds.index("image_generation.progress")
    assert max(i for i, k in enumerate(kinds) if k == "image_generation.partial_image") < len(kinds) - 1


def test_partial_images_edit_typed_events(openai_client):
    events = list(openai_client.images.edit(model="m", prompt="x", image=[("a.png", _png(64, 64), "image/png")],
                                            stream=True, partial_images=2, output_format="webp",
                                            extra_body={"num_inference_steps": 6}))
    from openai.types import ImageEditPartialImageEvent
    partials = [e for e in events if e.type == "image_edit.partial_image"]
    assert all(isinstance(e, ImageEditPartialImageEvent) for e in partials)
    assert [e.partial_image_index for e in partials] == [0, 1]
    assert partials[0].type == "image_edit.partial_image" and _img(partials[0].b64_json).format == "WEBP"
    assert events[-1].type == "image_edit.completed"


def test_partial_images_out_of_range(stack):
    r = httpx.post(stack.base + "/v1/images/generations", timeout=30,
                   json={"prompt": "x", "stream": True, "partial_images": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "partial_images"


def test_chat_default_prompt_is_the_official_one(openai_client, reference):
    """No chat_template_kwargs: greedy ids equal the reference on the official template string."""
    import services.model.reference as R
    from services.model.prompts import PromptInput
    model, tok = reference
    r = openai_client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, temperature=0,
                                              extra_body={"return_token_ids": True})
    official = "<|im_start|>user\nWrite a short poem<|im_end|>\n<|im_start|>assistant\n"
    want = R.generate_text(model, tok, PromptInput(tok.encode(official)), max_new_tokens=8, keep_stop=True)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.model_extra["prompt_token_ids"] == tok.encode(official)      # vLLM's field names
    chunks = list(openai_client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, temperature=0,
                                                        stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == tok.encode(official)
    assert [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])] == want


def test_chat_logprobs_and_n(openai_client):
    r = openai_client.chat.completions.create(model="m", messages=MSGS, max_tokens=5, temperature=0.9, seed=3,
                                              n=2, logprobs=True, top_logprobs=2,
                                              extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content)
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert r.usage.completion_tokens == 10


def test_chat_stream_stop_strings_and_usage(openai_client):
    base = openai_client.chat.completions.create(model="m", messages=MSGS, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True})
    text = base.choices[0].message.content
    cut = next((i for i, ch in enumerate(text) if i > 0 and ch.isalnum()), None)
    assert cut is not None, f"the seeded tiny checkpoint's answer has no alphanumeric character after the first: {text!r}"
    chunks = list(openai_client.chat.completions.create(
        model="m", messages=MSGS, max_tokens=16, temperature=0, stop=[text[cut]], stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[:text.index(text[cut])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_chat_logit_bias_through_the_gateway(openai_client, reference):
    _, tok = reference
    target = tok.encode("Z")[0]
    r = openai_client.chat.completions.create(model="m", messages=MSGS, max_tokens=3, temperature=0,
                                              logit_bias={str(target): 100})
    assert r.choices[0].message.content == "ZZZ"


def test_partial_image_is_the_x0_estimate(stack, reference):
    """The preview is the model's estimate of the clean image, z + (1 - t) v, at its step (JPEG-compressed)."""

    import numpy as np

    import services.model.reference as R
    from services.generation.previews import preview_steps
    from services.contract.image import SamplerParams
    from services.model.sampler import to_uint8
    body = {"prompt": "a kite over a field", "size": "64x64", "num_inference_steps": 8, "seed": 21, "stream": True,
            "partial_images": 1}
    with httpx.stream("POST", stack.base + "/v1/images/generations", json=body, timeout=120) as r:
        events = list(sse.events(r.iter_lines()))
    partial = [e for e in events if e["type"] == "image_generation.partial_image"]
    assert len(partial) == 1
    model, tok = reference
    params = SamplerParams(num_inference_steps=8)
    (step,) = preview_steps(8, 1)
    seen = {}
    pre = R.image_prefixes(model, tok, "t2i", body["prompt"], [], params)
    R.denoise(model, pre, 64, 64, params, seed=21, on_estimate=lambda i, x0: seen.setdefault(i, x0))
    from services.generation.encode import encode_image
    # the reference estimate through the same JPEG encoder (noise-like tiny-model images lose much to JPEG)
    want = np.asarray(_img(encode_image(to_uint8(seen[step])[0].numpy(), "jpeg")).convert("RGB"), np.float64)
    got = np.asarray(_img(partial[0]["b64_json"]).convert("RGB"), np.float64)
    assert partial[0]["step"] == step + 1
    assert np.abs(want - got).mean() < 1.0, np.abs(want - got).mean()
