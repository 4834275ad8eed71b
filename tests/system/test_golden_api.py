"""The official code's outputs on the tiny official-schema checkpoint (tests/golden), reproduced through a real
`u1serve up` stack and the openai SDK on CPU in float32: the served PNG equals the official image converted to
uint8, pixel for pixel. Image-to-image (`/v1/images/edits`, three-branch CFG): the official `it2i_generate`
(tests/golden/cases/edit_cfg3_img2_64.json: how it was made)."""
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
