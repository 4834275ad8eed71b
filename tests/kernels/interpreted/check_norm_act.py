"""RMSNorm (with and without the residual add) and silu*mul Triton kernels vs their references (run under
TRITON_INTERPRET=1)."""
import pytest
import torch
from tests.kernels.kernel_testutil import assert_close_ulp, assert_same_bits, residual_pair

from kernels.norm_act import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref


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


@pytest.mark.parametrize("rows", [1, 3])
def test_silu_mul_of_one_gate_up_output(rng, rows, monkeypatch):
    """The two column halves of one fused gate|up result (row stride 2n): the same bits as contiguous copies."""
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    gu = torch.randn(rows, 2 * 2100, dtype=torch.float16)
    g, u = gu.split(2100, dim=1)
    assert_same_bits(silu_mul(g, u), silu_mul(g.contiguous(), u.contiguous()))
    assert_close_ulp(silu_mul(g, u), silu_mul_ref(g, u))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (7, 96), (3, 5, 130), (4, 333)])
def test_add_rms_norm_is_torch_add_then_rms_norm(rng, dtype, shape, monkeypatch):
    """The residual is torch's `x + delta` bit for bit (bf16 too: rounded to nearest even in the kernel, not by
    the interpreter's truncating cast), the norm the plain kernel's on it."""
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    x, d = residual_pair(shape, dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    s, y = add_rms_norm(x, d, w, 1e-6)
    assert_same_bits(s, x + d)
    assert_same_bits(y, rms_norm(x + d, w, 1e-6))
    ref_s, ref_y = add_rms_norm_ref(x, d, w, 1e-6)
    assert_same_bits(s, ref_s)
    if dtype != torch.bfloat16:      # vs torch's norm: a few ULPs (test_rms_norm); bf16: the interpreter's cast
        n = shape[-1]
        finite = y.numel() // n - (y.numel() > n)    # not the overflow row
        assert_close_ulp(y.reshape(-1, n)[:finite], ref_y.reshape(-1, n)[:finite])


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_add_rms_norm_takes_strided_operands(rng, monkeypatch):
    """x and delta as column halves of wider tensors (not contiguous): the same bits as on contiguous copies."""
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")
    x, d = residual_pair((6, 2 * 96), torch.bfloat16)
    w = (torch.rand(96) + 0.5).to(torch.bfloat16)
    s, y = add_rms_norm(x[:, :96], d[:, 96:], w, 1e-6)
    want_s, want_y = add_rms_norm(x[:, :96].contiguous(), d[:, 96:].contiguous(), w, 1e-6)
    assert_same_bits(s, want_s)
    assert_same_bits(y, want_y)
    assert_same_bits(s, x[:, :96] + d[:, 96:])
