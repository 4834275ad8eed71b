"""CUDA only: the fp8 producers on the GPU at the 8B geometry (hidden 4096, intermediate 12288), 1,024 and 4,096
rows (1024² and 2048² single-branch steps), every default launch. Skipped without CUDA (this file is for the GPU
box: `python -m pytest -q tests/kernels/test_fp8_fused_cuda.py`); the same rules run on CPU under the Triton
interpreter in tests/kernels/interpreted/check_fp8.py.

The rules (what "fused == unfused" means, per producer):
- the quantiser equals torch's `quant_fp8_rowwise_ref` bit for bit (scale and every byte, -0 included);
- silu*mul -> fp8 equals the plain silu*mul kernel followed by the quantiser, bit for bit;
- add + RMSNorm -> fp8 equals torch's `x + delta` (the residual) and RMSNorm -> fp8 of it, bit for bit;
- RMSNorm -> fp8 equals one of torch's RMSNorm + the quantiser (measured on the H200, 2026-11-30) and the plain
  Triton RMSNorm + the quantiser bit for bit, and is within the fp8 rounding rule of both: the two norms' row
  sums may differ by rsqrt ULPs, so a scale may differ by one bf16 step and a value by one e4m3 step
  (adjacent codes);
- a tiny fp8 model's forward with fused producers vs unfused (U1SERVE_FP8_FUSED=0) within that rule's effect.
"""
from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import quant_fp8_rowwise, quant_fp8_rowwise_ref
from kernels.norm_act import add_rms_norm_fp8, rms_norm, rms_norm_fp8, rms_norm_ref, silu_mul, silu_mul_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: run on the GPU box")

HIDDEN, INTER, EPS = 4096, 12288, 1e-6
ROWS = (1024, 4096)
VARIANTS = (None, "row", "pieces")     # None: the default launch (auto: by rows)


@pytest.fixture(autouse=True)
def _triton_kernels(monkeypatch):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    monkeypatch.delenv("U1SERVE_FP8_VARIANT", raising=False)
    monkeypatch.delenv("U1SERVE_FP8_ROUND", raising=False)


def _randn(rows, n, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, n, generator=g, device="cuda") * scale
    x *= torch.logspace(-3, 3, rows, device="cuda")[:, None]          # per-row magnitudes
    x = x.to(torch.bfloat16)
    x[0] = 0.0                                                        # an all-zero row
    x[1, ::7] = -0.0
    return x


def assert_bits(got, want):
    (q, s), (rq, rs) = got, want
    torch.cuda.synchronize()
    assert torch.equal(s, rs), f"{int((s != rs).sum())} scale(s) differ"
    bad = q.view(torch.uint8) != rq.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} byte(s) differ, first at {bad.nonzero()[0].tolist()}"


def assert_within_fp8_rounding(got, want):
    """Scales within one bf16 step (the row's amax is a bf16 value: one rounding apart moves it by <= 2^-7
    relative), every value within one e4m3 step (adjacent codes; +-0 alike)."""
    (q, s), (rq, rs) = got, want
    assert ((s - rs).abs() <= rs.abs() * 2.0 ** -7).all()
    def ordinal(c):
        c = c.view(torch.uint8).to(torch.int16)
        return torch.where(c >= 128, -(c - 128), c)
    assert (ordinal(q) - ordinal(rq)).abs().max().item() <= 1


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_quantiser_is_torch(rows, variant):
    x = _randn(rows, HIDDEN, 1)
    assert_bits(quant_fp8_rowwise(x, variant), quant_fp8_rowwise_ref(x))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_fp8_is_silu_mul_then_quantiser(rows, variant):
    gu = _randn(rows, 2 * INTER, 2, 3.0)
    gate, up = gu[:, :INTER], gu[:, INTER:]          # the two halves of one gate|up GEMM output
    want = quant_fp8_rowwise(silu_mul(gate.contiguous(), up.contiguous()))
    assert_bits(silu_mul_fp8(gate, up, variant), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_fp8_is_add_then_rms_norm_fp8(rows, variant):
    x, d = _randn(rows, HIDDEN, 3), _randn(rows, HIDDEN, 4)
    w = (torch.rand(HIDDEN, device="cuda") + 0.5).to(torch.bfloat16)
    s, q, scale = add_rms_norm_fp8(x, d, w, EPS, variant)
    torch.cuda.synchronize()
    assert torch.equal(s.view(torch.int16), (x + d).view(torch.int16))
    assert_bits((q, scale), rms_norm_fp8(x + d, w, EPS, variant))


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_fp8_is_a_norm_then_the_quantiser(rows):
    """Bit for bit one of the two compositions (measured 2026-11-30: torch's), within the rounding rule of both."""
    x = _randn(rows, HIDDEN, 5)
    w = (torch.rand(HIDDEN, device="cuda") + 0.5).to(torch.bfloat16)
    got = rms_norm_fp8(x, w, EPS)
    refs = {"torch RMSNorm + quantiser": quant_fp8_rowwise_ref(rms_norm_ref(x, w, EPS)),
            "Triton RMSNorm + quantiser": quant_fp8_rowwise(rms_norm(x, w, EPS))}
    torch.cuda.synchronize()
    exact = [k for k, r in refs.items() if torch.equal(got[1], r[1])
             and torch.equal(got[0].view(torch.uint8), r[0].view(torch.uint8))]
    assert exact, "RMSNorm -> fp8 equals neither composition bit for bit"
    for ref in refs.values():
        assert_within_fp8_rounding(got, ref)


def test_tiny_fp8_model_fused_vs_unfused():
    from services.model.quant import Fp8Linear, Fp8RMSNorm, GemmPolicy, check_fp8_device, quantize_model
    from services.model.tiny import build_random_model, tiny_config
    from tests.model.fused_add_norm_forwards import inputs
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability >= 8.9")
    check_fp8_device(torch.device("cuda"), torch.bfloat16)
    model = build_random_model(tiny_config("u1"), "gen", torch.bfloat16, "cuda")
    quantize_model(model, ("gen",), policy=GemmPolicy(0, None, True))
    x, rope, attend = inputs(model)
    x, rope = x.cuda(), model.rope(rope.positions.cuda())
    out = {}
    with torch.inference_mode():
        for fused in (True, False):
            for mod in model.modules():
                if isinstance(mod, (Fp8Linear, Fp8RMSNorm)):
                    mod.policy = GemmPolicy(0, None, fused)
            out[fused] = model.gen_forward(x, rope, attend).float()
    rel = ((out[True] - out[False]).norm() / out[False].norm()).item()
    assert rel < 2e-2, rel
