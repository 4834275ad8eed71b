"""The residual add fused into the RMSNorm after it (modules.add_norm -> kernels.add_rms_norm / add_rms_norm_fp8):
with the switch on (default) and off (U1SERVE_FUSED_ADD_NORM=0: a separate add, then the norm — the computation
before the fusion) every forward gives the same tensors: und and gen, fp32 / bf16 / fp8 layers, MoE, gen_layers
over any [start, stop), no rows, the step cache. On CPU the ops are the torch references, so this checks the
wiring (which add is fused where, the last layer's plain add, the MLP output carried to the next layer); the
Triton kernels' bits: tests/kernels/interpreted (check_norm_act.py, check_fp8.py, check_fused_add_norm_model.py)
and, on the GPU, bench/bench_generation.py --part addnorm."""
from __future__ import annotations

import pytest
import torch

from services.base.knobs import FUSED_ADD_NORM
from services.model.loader import load_model
from services.model.modules import RMSNorm, fused_add_norm
from services.model.quant import Fp8RMSNorm, GemmPolicy, quantize_model
from services.model.tiny import build_random_model, tiny_config

from fused_add_norm_forwards import forwards, inputs


def _on_and_off(model, monkeypatch) -> tuple[dict, dict, int]:
    """forwards() with the switch on and off, and how many fused add + norm calls the 'on' run made."""
    calls = []
    for cls in (RMSNorm, Fp8RMSNorm):   # a spy around the real method (the fp8 one's fallback counted once)
        real = cls.__dict__["add_forward"]
        monkeypatch.setattr(cls, "add_forward", lambda self, x, d, real=real, cls=cls:
                            (type(self) is cls and calls.append(1)) or real(self, x, d))
    monkeypatch.setenv(FUSED_ADD_NORM.name, "1")
    on = forwards(model)
    fused_calls = len(calls)
    monkeypatch.setenv(FUSED_ADD_NORM.name, "0")
    off = forwards(model)
    assert len(calls) == fused_calls, "the switch off must not fuse"
    return on, off, fused_calls


def _assert_equal(on: dict, off: dict):
    assert on.keys() == off.keys()
    for k in on:
        assert on[k].shape == off[k].shape and on[k].dtype == off[k].dtype, k
        assert torch.equal(on[k], off[k]), k


def _three_layer_model(dtype):
    cfg = tiny_config("u1")
    cfg["llm_config"].update(num_hidden_layers=3, layer_types=["full_attention"] * 3, max_window_layers=3)
    return build_random_model(cfg, "both", dtype, seed=3)


@pytest.mark.parametrize("variant,dtype,quant", [("u1", torch.float32, None), ("u1", torch.bfloat16, None),
                                                 ("u1", torch.float32, "fp8"), ("a3b", torch.bfloat16, "fp8"),
                                                 ("u1.5", torch.bfloat16, None)])
def test_switch_on_and_off_give_the_same_tensors(tiny_checkpoint, monkeypatch, variant, dtype, quant):
    model = load_model(tiny_checkpoint(variant), "both", dtype=dtype, quantization=quant)
    on, off, fused_calls = _on_and_off(model, monkeypatch)
    _assert_equal(on, off)
    # every residual add is fused but the last of a gen_layers call: und_forward and gen_forward 2 per layer (the
    # last MLP output into the final norm), gen_layers over k layers 2k - 1 (k = L, 1, L - 1, L - 2, 0; no rows:
    # L), each of the two step-cache steps 1 (layer 0) + 2(L - 1) - 1 (layers 1..)
    L = model.num_layers
    expected = 2 * L + 2 * L + sum(2 * k - 1 for k in (L, 1, L - 1, L - 2, L) if k) + 2 * (2 * L - 2)
    assert fused_calls == expected


def test_middle_layers_and_fp8_rows_below_the_policy(monkeypatch):
    """Three layers (an MLP output carried through a middle layer; gen_layers[1:2] a middle slice alone), and
    fp8 norms whose row count runs in the model dtype (GemmPolicy.min_tokens above the rows)."""
    model = _three_layer_model(torch.bfloat16)
    _assert_equal(*_on_and_off(model, monkeypatch)[:2])
    quantize_model(model, ("gen", "und"), policy=GemmPolicy(min_tokens=10_000))
    assert type(model.language_model.model.layers[1].input_layernorm_mot_gen) is Fp8RMSNorm
    _assert_equal(*_on_and_off(model, monkeypatch)[:2])


def test_split_stack_is_the_whole_stack():
    """gen_layers[0:1] then [1:] (the step cache's split; the MLP output of the cut's last layer added plainly)
    then the final norm: gen_forward's bits (the last MLP output added in the final norm); the step cache's
    first step (every group computes) too."""
    model = _three_layer_model(torch.bfloat16)
    out = forwards(model)
    x, rope, attend = inputs(model)
    pieces = model.gen_layers(model.gen_layers(x, rope, attend, stop=1), rope, attend, start=1)
    assert torch.equal(pieces, out["gen_layers[0:None]"])
    assert torch.equal(model.gen_norm(pieces), out["gen_forward"])
    assert torch.equal(out["step cache 0"], out["gen_forward"])


def test_switch_values(monkeypatch):
    monkeypatch.delenv(FUSED_ADD_NORM.name, raising=False)
    assert fused_add_norm()
    for value, want in (("1", True), ("0", False), (" 0 ", False), ("", True), ("off", False)):
        monkeypatch.setenv(FUSED_ADD_NORM.name, value)
        assert fused_add_norm() is want
    monkeypatch.setenv(FUSED_ADD_NORM.name, "maybe")
    with pytest.raises(ValueError, match="U1SERVE_FUSED_ADD_NORM must be 0 or 1"):
        fused_add_norm()
    assert FUSED_ADD_NORM.name == "U1SERVE_FUSED_ADD_NORM"
