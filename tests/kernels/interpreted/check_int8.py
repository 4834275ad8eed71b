"""The int8 row quantiser's Triton kernel vs its reference (run under TRITON_INTERPRET=1): the same bits, including
values that land exactly on a half step (round half to even) and rows whose RN(x * (1 / s)) rounds differently
from RN(x / s)."""
import pytest
import torch

from kernels.int8_gemm import quant_int8_rowwise, quant_int8_rowwise_ref


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("U1SERVE_KERNELS", "triton")   # the Triton kernel, interpreted on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (5, 96), (3, 2500), (0, 64)])
def test_int8_rows_bit_equal(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[0] or 1)[: shape[0], None]).to(dtype)
    if shape[0] > 1:
        x[1] = 0.0
    q, s = quant_int8_rowwise(x)
    qr, sr = quant_int8_rowwise_ref(x)
    assert torch.equal(s, sr) and torch.equal(q, qr)


def test_half_steps_round_to_even():
    """Values at (k + 1/2) * s for every k: those where the fp32 product is exact are ties (x / s = k + 1/2)."""
    s0 = quant_int8_rowwise_ref(torch.tensor([[127.0]]))[1]
    halves = torch.arange(-127, 127, dtype=torch.float64) + 0.5
    x = torch.cat([torch.tensor([127.0]), (halves * s0.double().item()).float()])[None]
    ties = int(((x.double()[0, 1:] / s0.double().item()) == halves).sum())
    assert ties > 10                    # the case is exercised
    q, s = quant_int8_rowwise(x)
    qr, sr = quant_int8_rowwise_ref(x)
    assert torch.equal(s, sr) and torch.equal(q, qr), (q != qr).nonzero()


def test_strided_rows():
    torch.manual_seed(1)
    wide = torch.randn(6, 200)
    x = wide[:, 50:150]                 # rows with a stride of 200
    q, s = quant_int8_rowwise(x)
    qr, sr = quant_int8_rowwise_ref(x.contiguous())
    assert torch.equal(s, sr) and torch.equal(q, qr)
