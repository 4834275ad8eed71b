"""The tiny model with every op on its Triton kernel (interpreted): the residual add fused into the next RMSNorm
(U1SERVE_FUSED_ADD_NORM on, the default) gives the bits of the separate torch add + norm kernel (off) in every
forward (tests/model/fused_add_norm_forwards.py), bf16 (the add rounded to nearest even) and fp8 layers, MoE.
Q/K norm + RoPE runs its torch reference (the same in both runs; interpreted it would take 3/4 of the time)."""
import pytest
import torch

import kernels
from services.model.loader import load_model
from services.base.knobs import FUSED_ADD_NORM
from tests.model.fused_add_norm_forwards import forwards


@pytest.mark.parametrize("variant,quant", [("u1", None), ("u1", "fp8"), ("a3b", "fp8")])
def test_fused_and_unfused_model_give_the_same_bits(tiny_checkpoint, monkeypatch, variant, quant):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    monkeypatch.setattr(kernels, "qk_norm_rope_", kernels.qk_norm_rope_ref_)
    model = load_model(tiny_checkpoint(variant), "both", dtype=torch.bfloat16, quantization=quant)
    monkeypatch.setenv(FUSED_ADD_NORM.name, "1")
    on = forwards(model)
    monkeypatch.setenv(FUSED_ADD_NORM.name, "0")
    off = forwards(model)
    for k in on:
        assert torch.equal(on[k], off[k]), k
