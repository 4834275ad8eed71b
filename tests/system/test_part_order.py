"""Content parts in order through a real `u1serve up` stack and the openai SDK (issue 36), fp32 on CPU, on the
tiny official-schema checkpoint: an input image given as a part between two text parts goes where the official
code puts an `<image>` placeholder at that spot, bit for bit against the reference computed in this process on
this host. The interleaved answer is the official `interleave_gen(prompt="Look: <image>\\nDraw it from above.")`
restated (reference.interleave_gen); the chat answer is greedy decoding of the official template string; the
chat image (an edit) is the reference edit with the image at the same spot (whose prompt equals the official
placeholder string: tests/model/test_part_order.py). Also `return_token_ids` as vLLM's: the stop token that
ended an answer is its last id, streamed or not."""
import base64
import io
import os

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from services.contract.image import SamplerParams
from services.model import constants as C
from services.model import images as IM
from services.model import prompts as P
from services.model import reference as R
from services.model import sampler as S
from services.model.loader import load_model
from services.model.tokenizer import NeoTokenizer
from tests.conftest import GOLDEN

from .stackproc import RunningStack

CKPT = os.path.join(GOLDEN, "tiny-u1")
with open(os.path.join(GOLDEN, "cases", "interleave_edit_cfg3_sizes.input.png"), "rb") as _f:
    PNG = _f.read()
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
OFFICIAL = "Look: <image>\nDraw it from above."        # the official prompt: the image at its placeholder
PARTS = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": URL}},
         {"type": "text", "text": "\nDraw it from above."}]
MSGS = [{"role": "user", "content": PARTS}]
# the random tiny model never predicts <img> (262) or <|im_end|> (258) by itself: with these biases the answer is
# <img> (64x64), a token, <img> (96x64), a token, <|im_end|> (found with reference.interleave_gen)
BIAS = {262: 3.0, 258: 2.2}
SIZES = [(64, 64), (96, 64)]
GUIDANCE = dict(num_inference_steps=2, guidance_scale=3.0, image_guidance_scale=2.0, cfg_norm="none",
                timestep_shift=3.0, t_eps=0.02)
SEED = 9


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    stack = RunningStack(CKPT, "colocate", str(tmp_path_factory.mktemp("stack-part-order"))).wait_ready()
    yield openai.OpenAI(base_url=stack.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    stack.stop_clean()


@pytest.fixture(scope="module")
def ref():
    return load_model(CKPT, "both", torch.float32), NeoTokenizer.from_dir(CKPT)


def _pixels(url_or_b64: str) -> np.ndarray:
    b64 = url_or_b64.split(",", 1)[1] if url_or_b64.startswith("data:") else url_or_b64
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _spans(tok, segments, sizes) -> list[int]:
    """An interleaved answer as return_token_ids spells it: text, each image as <img> <IMG_CONTEXT>... </img>."""
    out = []
    for k, seg in enumerate(segments):
        out += seg
        if k < len(segments) - 1:
            w, h = sizes[min(k, len(sizes) - 1)]
            out += [tok.img_start_id] + [tok.img_context_id] * (w // 32) * (h // 32) + [tok.img_end_id]
    return out


def test_interleaved_answer_with_the_image_mid_text_is_the_official_one(client, ref):
    model, tok = ref
    params = SamplerParams(mode="edit", **GUIDANCE)
    ans = R.interleave_gen(model, tok, OFFICIAL, [IM.load_image(PNG)], params, *SIZES[0], seed=SEED, think=False,
                           max_new_tokens=12, max_images=3, logit_bias=BIAS, sizes=SIZES)
    assert len(ans.images) == 2 and ans.finish_reason == "stop" and ans.stop_token == tok.im_end_id, ans
    cond, _ = P.official_interleave_heads(tok, OFFICIAL, [IM.load_image(PNG)], False, P.interleave_system_message())
    want_ids = _spans(tok, ans.segments, SIZES) + [tok.im_end_id]       # vLLM: the stop token is the last id
    body = dict(model="m", modalities=["text", "image"], max_tokens=12, messages=MSGS,
                logit_bias={str(k): v for k, v in BIAS.items()},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True,
                            "cache_salt": "part-order",
                            "image_config": {"size": [f"{w}x{h}" for w, h in SIZES], "seed": SEED, "max_images": 3,
                                             **GUIDANCE}})
    r = client.chat.completions.create(**body)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "stop"
    assert "".join(p["text"] for p in msg.content if p["type"] == "text") == \
        "".join(tok.decode(s, skip_special_tokens=True) for s in ans.segments)
    images = msg.model_extra["images"]
    assert len(images) == 2
    for k, (part, x) in enumerate(zip(images, ans.images)):
        np.testing.assert_array_equal(_pixels(part["image_url"]["url"]), S.to_uint8(x)[0].numpy(), err_msg=str(k))
    assert r.model_extra["prompt_token_ids"] == cond.input_ids            # the image at the placeholder's spot
    assert choice.model_extra["token_ids"] == want_ids
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    assert chunks[0].model_extra["prompt_token_ids"] == cond.input_ids
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == want_ids


def test_chat_with_the_image_mid_text_is_the_official_prompt(client, ref):
    model, tok = ref
    vqa = IM.preprocess(IM.load_image(PNG), C.VQA_MIN_PIXELS, C.VQA_MAX_PIXELS)
    official = P.expand_images(tok, P.neo1_0([("user", OFFICIAL)]), [vqa])
    want = R.generate_text(model, tok, official, max_new_tokens=8, keep_stop=True)
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == official.input_ids
    assert r.choices[0].model_extra["token_ids"] == want


def test_return_token_ids_end_with_the_stop_token(client, ref):
    """vLLM's return_token_ids: an answer that stopped on a stop token id (or EOS) has it as its last id, in the
    response and in the stream; its text does not show it."""
    model, tok = ref
    want = R.generate_text(model, tok, P.chat_input(tok, [{"role": "user", "content": "Tell me a story"}]),
                           max_new_tokens=8)
    k = next(i for i, t in enumerate(want) if t not in want[:i] and i >= 1)
    body = dict(model="m", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0,
                extra_body={"return_token_ids": True, "stop_token_ids": [want[k]]})
    r = client.chat.completions.create(**body)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["token_ids"] == want[:k + 1]
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == want[:k + 1]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # EOS: a strong bias on <|im_end|> ends the answer at once; the id is there, the text is empty
    eos = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0, logit_bias={str(tok.im_end_id): 100},
                                         extra_body={"return_token_ids": True})
    assert eos.choices[0].finish_reason == "stop" and eos.choices[0].message.content == ""
    assert eos.choices[0].model_extra["token_ids"] == [tok.im_end_id]


def test_chat_image_edit_with_the_image_mid_text(client, ref):
    """modalities ['image'] with the input image between two text parts: the edit's cond prompt has it there
    (PrefixRequest.image_offsets), and the PNG is the reference edit's, pixel for pixel."""
    model, tok = ref
    params = SamplerParams(mode="edit", **GUIDANCE)
    x, _ = R.edit(model, tok, "Look: \nDraw it from above.", [IM.load_image(PNG)], 64, 64, params, seed=SEED,
                  image_offsets=[6])
    r = client.chat.completions.create(model="m", messages=MSGS, modalities=["image"],
                                       extra_body={"image_config": {"size": "64x64", "seed": SEED, **GUIDANCE}})
    images = r.choices[0].message.model_extra["images"]
    np.testing.assert_array_equal(_pixels(images[0]["image_url"]["url"]), S.to_uint8(x)[0].numpy())
