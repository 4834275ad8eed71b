"""The official code's outputs on the tiny official-schema checkpoint (tests/golden), reproduced through a real
`u1serve up` stack and the openai SDK on CPU in float32: the served PNG equals the official image converted to
uint8, pixel for pixel (docs/model.md, "Bits": what it takes). Image-to-image (`/v1/images/edits`, three-branch
CFG): the official `it2i_generate`; an interleaved answer (chat `modalities: ["text", "image"]`) with an input image,
three-branch CFG and a size list: the official `interleave_gen` (tests/golden/cases/*.json: how they were made).
The interleaved answer runs twice, the second time with the prefix cache holding the first one's prompts, under a
cache salt of its own: the edit's img_cond prompt is its tu prompt + `<img>`, computed in one block, and KV another
request computed in other blocks is not the official bits (docs/model.md, "Bits")."""
import base64
import io
import json
import os

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from services.model import sampler as S
from tests.conftest import GOLDEN

from .stackproc import RunningStack

CASES = os.path.join(GOLDEN, "cases")


@pytest.fixture(scope="module")
def golden_client(tmp_path_factory):
    stack = RunningStack(os.path.join(GOLDEN, "tiny-u1"), "colocate",
                         str(tmp_path_factory.mktemp("stack-golden"))).wait_ready()
    yield openai.OpenAI(base_url=stack.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    stack.stop_clean()


def _case(name: str):
    with open(os.path.join(CASES, name + ".json")) as f:
        case = json.load(f)["request"]
    with open(os.path.join(CASES, case["images"][0]), "rb") as f:
        png = f.read()
    return case, png, torch.load(os.path.join(CASES, name + ".pt"), weights_only=True)


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_edit_is_the_official_image(golden_client):
    case, png, gold = _case("edit_cfg3_img2_64")
    w, h = case["image_size"]
    r = golden_client.images.edit(
        model="m", prompt=case["prompt"], image=[("input.png", png, "image/png")], size=f"{w}x{h}",
        extra_body={"num_inference_steps": case["num_steps"], "seed": case["seed"], "cfg_norm": case["cfg_norm"],
                    "guidance_scale": case["cfg_scale"], "image_guidance_scale": case["img_cfg_scale"],
                    "timestep_shift": case["timestep_shift"], "t_eps": case["t_eps"]})
    np.testing.assert_array_equal(_pixels(r.data[0].b64_json), S.to_uint8(gold)[0].numpy())


def test_interleaved_answer_is_the_official_one(golden_client):
    case, png, gold = _case("interleave_edit_cfg3_sizes")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
               {"type": "text", "text": case["prompt"]}]
    image_config = {"size": [f"{w}x{h}" for w, h in case["image_size"]], "num_inference_steps": case["num_steps"],
                    "seed": case["seed"], "guidance_scale": case["cfg_scale"],
                    "image_guidance_scale": case["img_cfg_scale"], "cfg_norm": case["cfg_norm"],
                    "timestep_shift": case["timestep_shift"], "t_eps": case["t_eps"], "max_images": 10}
    for _ in range(2):
        r = golden_client.chat.completions.create(
            model="m", modalities=["text", "image"], max_tokens=case["max_new_tokens"],
            messages=[{"role": "user", "content": content}], logit_bias={"262": case["img_bias"]},
            extra_body={"chat_template_kwargs": {"enable_thinking": case["think_mode"]},
                        "image_config": image_config, "cache_salt": "interleave"})
        msg = r.choices[0].message
        text = "".join(p["text"] if p["type"] == "text" else "<image>" for p in msg.content)
        assert text == gold["text"]
        images = msg.model_extra["images"]
        assert len(images) == len(gold["images"])
        for part, want in zip(images, gold["images"]):
            np.testing.assert_array_equal(_pixels(part["image_url"]["url"].split(",", 1)[1]),
                                          S.to_uint8(want)[0].numpy())
