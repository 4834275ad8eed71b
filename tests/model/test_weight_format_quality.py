"""The quality cost of each weight format on the official golden case (tests/golden: the official code's float32
image of the tiny checkpoint, 64², 4 steps, CFG 4): max abs error and PSNR (range [-1, 1], peak-to-peak 2) of our
image with the converted checkpoint (`u1serve convert`) against the golden image. Measured 2026-12-02 on CPU,
float32 (docs/model.md, weight formats):
    float 130 dB (the golden match) | fp8 31.0 dB, max 0.22 | int8 41.9 dB, max 0.065 | gguf:q8_0 47.0 dB, max 0.034
    | gguf:q4_k 22.5 dB, max 0.67.
The bounds leave ~3 dB of margin (another torch's summation order moves the float path by 1e-6, the quantised
ones by rounding flips)."""
import math
import os

import pytest
import torch

from services.contract.image import SamplerParams
from services.model import reference as R
from services.model.convert import convert_checkpoint
from services.model.loader import load_model
from services.model.tokenizer import NeoTokenizer
from tests.conftest import GOLDEN

CKPT = os.path.join(GOLDEN, "tiny-u1")
CASE = os.path.join(GOLDEN, "cases", "t2i_64_cfg4_none")
MIN_PSNR = {"fp8": 28.0, "int8": 38.0, "gguf:q8_0": 43.0, "gguf:q4_k": 19.0}
MAX_ABS = {"fp8": 0.35, "int8": 0.12, "gguf:q8_0": 0.07, "gguf:q4_k": 1.0}


@pytest.mark.parametrize("fmt", list(MIN_PSNR))
def test_converted_golden_image_quality(fmt, tmp_path):
    if fmt.startswith("gguf"):
        pytest.importorskip("gguf")
    meta = torch.load(CASE + ".kv.pt", weights_only=True)["meta"]
    params = SamplerParams(num_inference_steps=meta["steps"], guidance_scale=meta["cfg"],
                             cfg_norm=meta["cfg_norm"], timestep_shift=meta["shift"], t_eps=meta["t_eps"])
    gold = torch.load(CASE + ".pt", weights_only=True)
    model = load_model(convert_checkpoint(CKPT, str(tmp_path / "c"), fmt), "both", torch.float32)
    x, _ = R.text_to_image(model, NeoTokenizer.from_dir(CKPT), meta["prompt"], 64, 64, params, seed=0)
    err = x - gold
    max_abs, psnr = err.abs().max().item(), 20 * math.log10(2 / err.pow(2).mean().sqrt().item())
    print(f"{fmt}: max abs {max_abs:.4g}, PSNR {psnr:.2f} dB")
    assert psnr >= MIN_PSNR[fmt] and max_abs <= MAX_ABS[fmt], (max_abs, psnr)
