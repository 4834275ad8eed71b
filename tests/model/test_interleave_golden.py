"""The reference interleave loop equals the official interleave_gen bit for bit in fp32 on the tiny official-schema
checkpoint, for the case issue 26 found off by a uint8 level: an input image and three-branch CFG (cond, tu, iu),
here also with a per-image size list (two sizes, three images: the last size repeats). How the golden was made:
tests/golden/cases/interleave_edit_cfg3_sizes.json."""
import json
import os

import pytest
import torch

from services.model import images as IM
from services.model import reference as R
from services.model import sampler as S
from services.model.loader import load_model
from services.model.tokenizer import NeoTokenizer
from tests.conftest import GOLDEN

CKPT = os.path.join(GOLDEN, "tiny-u1")
CASE = os.path.join(GOLDEN, "cases", "interleave_edit_cfg3_sizes")


@pytest.fixture(scope="module")
def case():
    with open(CASE + ".json") as f:
        return json.load(f)["request"]


def _answer(case):
    model, tok = load_model(CKPT, "both", torch.float32), NeoTokenizer.from_dir(CKPT)
    with open(os.path.join(GOLDEN, "cases", case["images"][0]), "rb") as f:
        image = IM.load_image(f.read())
    msgs = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": case["prompt"]}]}]
    params = S.SamplerParams(mode="edit", num_inference_steps=case["num_steps"], guidance_scale=case["cfg_scale"],
                             image_guidance_scale=case["img_cfg_scale"], cfg_norm=case["cfg_norm"],
                             timestep_shift=case["timestep_shift"], t_eps=case["t_eps"])
    sizes = [tuple(s) for s in case["image_size"]]
    ans = R.interleave(model, tok, msgs, params, *sizes[0], seed=case["seed"], think=case["think_mode"],
                       max_new_tokens=case["max_new_tokens"], logit_bias={tok.img_start_id: case["img_bias"]},
                       sizes=sizes)
    text = "<image>".join(tok.decode(s, skip_special_tokens=True) for s in ans.segments)
    return text, ans.images


def test_input_image_three_branch_cfg_and_size_list_bit_exact(case):
    gold = torch.load(CASE + ".pt", weights_only=True)
    text, images = _answer(case)
    assert text == gold["text"]
    assert [tuple(x.shape) for x in images] == [(1, 3, 64, 64), (1, 3, 64, 96), (1, 3, 64, 96)]
    for k, (x, g) in enumerate(zip(images, gold["images"])):
        assert torch.equal(x, g), (k, (x - g).abs().max().item())
