"""The reference edit (image-to-image) equals the official it2i_generate bit for bit in fp32 on the tiny
official-schema checkpoint: one input image, three-branch CFG (cond, img_cond, uncond). How the golden was made,
and why its harness sets `<img>`'s id: tests/golden/cases/edit_cfg3_img2_64.json."""
import json
import os

import torch

from services.model import images as IM
from services.model import reference as R
from services.model import sampler as S
from services.model.loader import load_model
from services.model.tokenizer import NeoTokenizer
from tests.conftest import GOLDEN

CKPT = os.path.join(GOLDEN, "tiny-u1")
CASE = os.path.join(GOLDEN, "cases", "edit_cfg3_img2_64")


def test_edit_three_branch_cfg_bit_exact():
    with open(CASE + ".json") as f:
        case = json.load(f)["request"]
    model, tok = load_model(CKPT, "both", torch.float32), NeoTokenizer.from_dir(CKPT)
    with open(os.path.join(GOLDEN, "cases", case["images"][0]), "rb") as f:
        image = IM.load_image(f.read())
    params = S.SamplerParams(mode="edit", num_inference_steps=case["num_steps"], guidance_scale=case["cfg_scale"],
                             image_guidance_scale=case["img_cfg_scale"], cfg_norm=case["cfg_norm"],
                             timestep_shift=case["timestep_shift"], t_eps=case["t_eps"])
    x, _ = R.edit(model, tok, case["prompt"], [image], *case["image_size"], params, seed=case["seed"])
    gold = torch.load(CASE + ".pt", weights_only=True)
    assert torch.equal(x, gold), (x - gold).abs().max().item()
