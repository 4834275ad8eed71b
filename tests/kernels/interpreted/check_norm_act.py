"""RMSNorm and silu*mul Triton kernels vs their references (run under TRITON_INTERPRET=1)."""
import pytest
import torch
from kernel_testutil import assert_close_ulp

from kernels.norm_act import rms_norm, rms_norm_ref, silu_mul, silu_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 130)])
def test_rms_norm(rng, dtype, shape, monkeypatch):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")  # the Triton kernel, interpreted on CPU
    x = torch.randn(*shape, dtype=dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    assert_close_ulp(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (5, 333), (4097,)])
def test_silu_mul(rng, dtype, shape, monkeypatch):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    g, u = torch.randn(*shape, dtype=dtype), torch.randn(*shape, dtype=dtype)
    assert_close_ulp(silu_mul(g, u), silu_mul_ref(g, u))
