"""fp8 activations quantised by their producers (services/model/quant.py, GemmPolicy.fused): the wiring on CPU.

The fused producers (RMSNorm -> fp8, add + RMSNorm -> fp8, silu*mul -> fp8) hand their GEMMs an Fp8Activation,
so the standalone quantiser runs only where cuDNN writes the input (o_proj): once per layer instead of once per
distinct input (q and k|v share one, gate|up one, down one, o one: 4 per layer). On CPU the fused ops are the
norm / silu*mul then the quantiser in torch, so fused and unfused give the same bits here; the Triton kernels'
bits: tests/kernels/interpreted/check_fp8.py (interpreter) and tests/kernels/test_fp8_fused_cuda.py (GPU).
"""
from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import AUTO_PIECES_MIN_ROWS, fp8_launch
from services.base.knobs import FP8_FUSED
from services.model.quant import Fp8Linear, Fp8RMSNorm, GemmPolicy
from tests.model.fused_add_norm_forwards import inputs


def _set_fused(model, fused: bool) -> None:
    for mod in model.modules():
        if isinstance(mod, (Fp8Linear, Fp8RMSNorm)):
            mod.policy = GemmPolicy(mod.policy.min_tokens, mod.policy.fast_accum_min_tokens, fused)


def test_producers_quantise_once_and_equal_the_unfused_model(tiny_checkpoint, monkeypatch):
    from services.model.loader import load_model
    model = load_model(tiny_checkpoint("u1"), "gen", quantization="fp8")     # CPU policy: fp8 on every row count
    x, rope, attend = inputs(model)
    shapes = []
    real = Fp8Linear.quantize_rows           # the GEMM layers' own quantiser (their input when not pre-quantised)
    monkeypatch.setattr(Fp8Linear, "quantize_rows", staticmethod(lambda t: shapes.append(tuple(t.shape)) or real(t)))
    with torch.inference_mode():
        fused = model.gen_forward(x, rope, attend)
        n_fused, shapes[:] = list(shapes), []
        _set_fused(model, False)
        unfused = model.gen_forward(x, rope, attend)
    llm = model.cfg.llm
    layers, rows = model.num_layers, x.shape[0]
    q_width = llm.num_attention_heads * llm.head_dim
    assert n_fused == [(rows, q_width)] * layers                          # o_proj's input only
    per_layer = [(rows, llm.hidden_size), (rows, q_width), (rows, llm.hidden_size), (rows, llm.intermediate_size)]
    assert shapes == per_layer * layers                                  # q + k|v share one; o; gate|up; down
    assert torch.equal(fused, unfused)


def test_fused_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv(FP8_FUSED.name, raising=False)
    assert GemmPolicy.for_device("cuda").fused and GemmPolicy.for_device("cpu").fused_producer(1)
    monkeypatch.setenv(FP8_FUSED.name, "0")
    pol = GemmPolicy.for_device("cuda")
    assert not pol.fused and not pol.fused_producer(1 << 20) and pol.fp8(1 << 20)
    monkeypatch.setenv(FP8_FUSED.name, "maybe")
    with pytest.raises(ValueError, match="0 or 1"):
        GemmPolicy.for_device("cuda")


def test_auto_launch_keeps_few_wide_rows_in_one_padded_row(monkeypatch):
    """auto: below 2,048 rows a row of several pieces runs `row` (faster there on the H200), else `pieces`; an
    explicit variant or the environment's wins. Every variant gives the same bits (interpreted checks)."""
    monkeypatch.delenv("U1SERVE_FP8_VARIANT", raising=False)
    assert fp8_launch(12288, rows=1024).variant == "row" and fp8_launch(12288, rows=AUTO_PIECES_MIN_ROWS).variant \
        == "pieces"
    assert fp8_launch(4096, rows=1024).variant == "pieces" and fp8_launch(12288).variant == "pieces"
    assert fp8_launch(12288, "pieces", rows=1024).variant == "pieces"
    monkeypatch.setenv("U1SERVE_FP8_VARIANT", "twopass")
    assert fp8_launch(12288, rows=1024).variant == "twopass"
