"""fp8 Triton kernels vs their references (run under TRITON_INTERPRET=1): the row quantiser, and the
producers that quantise what they compute (RMSNorm -> fp8, silu*mul -> fp8).

The fused kernels must give the bits of the plain kernel followed by the quantiser (same backend, any
dtype); against the torch references the plain kernels differ by a few ULPs of the input dtype (fp32
exp / rsqrt, summation order), which moves a quantised value by at most one e4m3 step and the row
scale by those ULPs. bf16 is checked only for the bit-equal composition: the interpreter's
fp32 -> bf16 cast truncates (docs/kernels.md), the GPU's rounds.
"""
import pytest
import torch
from kernel_testutil import ULPS, assert_close_ulp

from kernels.fp8_quant import quant_fp8_rowwise, quant_fp8_rowwise_ref
from kernels.norm_act import (rms_norm, rms_norm_fp8, rms_norm_fp8_ref, silu_mul, silu_mul_fp8,
                              silu_mul_fp8_ref)

_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")   # the Triton kernels, interpreted on CPU


def assert_bits_equal(a, b):
    qa, sa = a
    qb, sb = b
    assert torch.equal(sa, sb), f"{int((sa != sb).sum())} row scale(s) differ"
    diff = qa.view(torch.uint8) != qb.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} fp8 value(s) differ, first at {diff.nonzero()[0].tolist()}"


def assert_close_fp8(got, ref, dtype):
    """q within one e4m3 step, scale within the input dtype's kernel ULPs (the row's amax moved)."""
    assert_close_ulp(got[0], ref[0], ulps=1)
    assert_close_ulp(got[1], ref[1], ulps=ULPS[dtype] * 2 ** (23 - _MANTISSA[dtype]) + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantiser_is_the_reference_bit_for_bit(rng, dtype):
    lo, hi = (-5, 3) if dtype == torch.float16 else (-9, 5)   # within the dtype's range
    x = (torch.randn(48, 200) * torch.logspace(lo, hi, 48)[:, None]).to(dtype)
    x[5] = 0
    x[7, :20] = 1e-30 if dtype == torch.float32 else 0
    assert_bits_equal(quant_fp8_rowwise(x), quant_fp8_rowwise_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 130)])
def test_rms_norm_fp8_is_norm_then_quantiser(rng, dtype, shape):
    x = torch.randn(*shape, dtype=dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    got = rms_norm_fp8(x, w, 1e-6)
    assert got[0].shape == (x.numel() // shape[-1], shape[-1]) and got[1].shape == (got[0].shape[0], 1)
    assert_bits_equal(got, quant_fp8_rowwise(rms_norm(x, w, 1e-6).reshape(-1, shape[-1])))
    if dtype != torch.bfloat16:
        assert_close_fp8(got, rms_norm_fp8_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 16), (5, 333), (9, 1024)])
def test_silu_mul_fp8_is_gate_then_quantiser(rng, dtype, rows, n):
    gu = (torch.randn(rows, 2 * n) * 3).to(dtype)             # one gate|up GEMM output: strided halves
    gate, up = gu[:, :n], gu[:, n:]
    got = silu_mul_fp8(gate, up)
    assert_bits_equal(got, quant_fp8_rowwise(silu_mul(gate.contiguous(), up.contiguous())))
    if dtype != torch.bfloat16:
        assert_close_fp8(got, silu_mul_fp8_ref(gate, up), dtype)
