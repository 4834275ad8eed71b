"""The skinny GEMM kernels (tensor-core and one-row CUDA-core) vs torch's linear, under TRITON_INTERPRET=1."""
import pytest
import torch
import torch.nn.functional as F

from kernels.skinny_gemm import gemv_launch, skinny_linear_launch


def _close(got, x, w, tol):
    want = F.linear(x.float(), w.float())
    assert (got.float() - want).abs().max().item() <= tol * (want.abs().max().item() + 1e-6)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_tensor_core_kernel_interpreted(m):
    x = torch.randn(m, 256).half()          # the interpreter's 16-bit dot is exact for fp16 (bf16: broken there)
    w = torch.randn(40, 256).half()
    _close(skinny_linear_launch(x, w, (16, 128, 4, 3)), x, w, 2e-3)


def test_gemv_kernel_interpreted(monkeypatch):
    x = torch.randn(1, 1024).bfloat16()
    w = torch.randn(37, 1024).bfloat16()
    _close(gemv_launch(x, w, (4, 512, 4, 2)), x, w, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_gemv_is_silu_mul_then_gemv(dtype, monkeypatch):
    """silu(gate) * up computed at the down GEMM's load: the bits of the silu_mul kernel, then the plain gemv."""
    from kernels.norm_act import silu_mul
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    gate_up = torch.randn(1, 2 * 1024).to(dtype)
    w = (torch.randn(37, 1024) * 0.05).to(dtype)
    want = gemv_launch(silu_mul(*gate_up.split(1024, dim=1)), w, (4, 512, 4, 2))
    assert torch.equal(gemv_launch(gate_up, w, (4, 512, 4, 2), gated=True), want)
