"""fp8 Triton kernels vs their references (run under TRITON_INTERPRET=1): the row quantiser, and the
producers that quantise what they compute (RMSNorm -> fp8, with the residual add in front too, silu*mul -> fp8).

The fused kernels must give the bits of the plain kernel followed by the quantiser (same backend, any
dtype); against the torch references the plain kernels differ by a few ULPs of the input dtype (fp32
exp / rsqrt, summation order), which moves a quantised value by at most one e4m3 step and the row
scale by those ULPs. bf16 is checked only for the bit-equal composition: the interpreter's
fp32 -> bf16 cast truncates (docs/kernels.md), the GPU's rounds.
"""
import pytest
import torch
from tests.kernels.kernel_testutil import ULPS, assert_close_ulp, assert_same_bits, residual_pair

from kernels.fp8_quant import INV_FP8_MAX, quant_fp8_rowwise, quant_fp8_rowwise_ref
from kernels.norm_act import (add_rms_norm_fp8, add_rms_norm_fp8_ref, rms_norm, rms_norm_fp8, rms_norm_fp8_ref,
                              silu_mul, silu_mul_fp8, silu_mul_fp8_ref)

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


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (7, 96), (3, 5, 130), (4, 333)])
@pytest.mark.parametrize("variant", [None, "legacy"])
def test_add_rms_norm_fp8_is_torch_add_then_rms_norm_fp8(rng, dtype, shape, variant):
    """The residual is torch's `x + delta` bit for bit, (q, scale) those of rms_norm_fp8 on it (rows of the
    residual on e4m3 ties: tests/kernels/interpreted/check_norm_act.py has the add's own ties)."""
    x, d = residual_pair(shape, dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    w[::3] *= -1
    s, q, scale = add_rms_norm_fp8(x, d, w, 1e-6, variant)
    assert_same_bits(s, x + d)
    assert_bits_equal((q, scale), rms_norm_fp8(x + d, w, 1e-6, variant))
    assert_same_bits(s, add_rms_norm_fp8_ref(x, d, w, 1e-6)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 16), (5, 333), (9, 1024)])
def test_silu_mul_fp8_is_gate_then_quantiser(rng, dtype, rows, n):
    gu = (torch.randn(rows, 2 * n) * 3).to(dtype)             # one gate|up GEMM output: strided halves
    gate, up = gu[:, :n], gu[:, n:]
    got = silu_mul_fp8(gate, up)
    assert_bits_equal(got, quant_fp8_rowwise(silu_mul(gate.contiguous(), up.contiguous())))
    if dtype != torch.bfloat16:
        assert_close_fp8(got, silu_mul_fp8_ref(gate, up), dtype)


# ---- every launch variant (kernels/fp8_quant.py fp8_launch) on the values where rounding is delicate ----------
# pieces-128 / twopass-64 at n = 333: several pieces / chunks with a ragged (masked) tail
VARIANTS = ["legacy", "row", "pieces", "pieces-128", "twopass", "twopass-64"]
WIDE_VARIANTS = ["legacy", "row", "pieces", "twopass", "twopass-1024"]     # n = 12288: 3 pieces, 6 / 12 chunks
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _e4m3_grid_values(j: int, dtype) -> torch.Tensor:
    """448 * 2^j first (the row amax: scale exactly 2^j, so x / s is exact), then every e4m3 value, every
    midpoint between neighbours (ties: even wins; the subnormal range, binade edges such as 15.5 * 2^(e-3)
    and 464 -> 448 saturation among them) and the dtype's neighbours of each midpoint, times 2^j."""
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()      # 0 .. 448
    mids = (e4[:-1] + e4[1:]) / 2
    v = (torch.cat([e4, mids]) * 2.0 ** j).to(dtype)
    m = (mids[1:] * 2.0 ** j).to(dtype)                                                # nonzero midpoints
    up = (m.view(_INT[dtype]) + 1).view(dtype)
    down = (m.view(_INT[dtype]) - 1).view(dtype)
    return torch.cat([torch.tensor([448.0 * 2.0 ** j], dtype=dtype), v, up, down])


def _near_tie_values(f: float, dtype) -> torch.Tensor:
    """A row amax 448 f (a scale s that is not a power of two) first, then values x near s * (e4m3 midpoints)
    for which RN(x * RN(1/s)) and RN(x / s) round to different e4m3 values: a quotient that is only faithful
    (not correctly rounded) changes the result there."""
    amax = torch.tensor(448.0 * f, dtype=dtype)
    s = amax.float() * INV_FP8_MAX
    r = (1 / s.double()).float()
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    base = (((e4[:-1] + e4[1:]) / 2)[1:] * s.double()).to(dtype).view(_INT[dtype])
    x = torch.cat([(base + k).view(dtype) for k in range(-4, 5)])
    def e4m3(q):
        return q.float().clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    naive, exact = e4m3(x.double() * r.double()), e4m3(x.double() / s.double())
    return torch.cat([amax.reshape(1), x[naive != exact], x[naive == exact]])


def _tricky_rows(n: int, dtype, gen) -> torch.Tensor:
    lo, hi = (-3, 2) if dtype == torch.float16 else (-9, 5)                            # within the dtype's range
    x = (torch.randn(12, n, generator=gen) * torch.logspace(lo, hi, 12)[:, None]).to(dtype)
    x[0] = 0.0                                                                         # all-zero row
    x[1, ::3] = -0.0                                                                   # signed zeros and tiny
    x[1, 1::3] = -(2.0 ** -14 if dtype == torch.float16 else 1e-30)                    # negatives: -0 out
    x[1, 5] = 1.0
    for r, j in ((2, 0), (3, -8), (4, 3)):                                             # ties on the e4m3 grid
        g = _e4m3_grid_values(j, dtype)
        g = g.repeat(-(-n // g.numel()))[:n].clone()
        g[0] = 448.0 * 2.0 ** j
        sign = torch.where(torch.arange(n) % 2 == 1, -1.0, 1.0).to(dtype)
        x[r] = g * sign
    for r, f in ((6, 1.2345), (7, 1.7)):                                             # near-ties, s not 2^j
        g = _near_tie_values(f, dtype)
        x[r] = g.repeat(-(-n // g.numel()))[:n]
    x[5, 0] = 100.0                                                                    # one large value: the
    x[5, 1:] = x[5, 1:] * 1e-3                                                         # rest in e4m3 subnormals
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_quantises_tricky_rows_like_torch(rng, dtype, variant):
    gen = torch.Generator().manual_seed(rng)
    x = _tricky_rows(333, dtype, gen)
    assert_bits_equal(quant_fp8_rowwise(x, variant), quant_fp8_rowwise_ref(x))


@pytest.mark.parametrize("variant", WIDE_VARIANTS)
def test_every_variant_at_the_8b_widths(rng, variant):
    """n = 12288 (intermediate: silu*mul, 3 pieces of 4096 / 6 chunks) and 4096 (hidden: RMSNorm)."""
    gen = torch.Generator().manual_seed(rng)
    x = _tricky_rows(12288, torch.bfloat16, gen)[:6]
    assert_bits_equal(quant_fp8_rowwise(x, variant), quant_fp8_rowwise_ref(x))
    gu = (torch.randn(3, 2 * 12288, generator=gen) * 3).to(torch.bfloat16)
    gate, up = gu[:, :12288], gu[:, 12288:]
    want = quant_fp8_rowwise_ref(silu_mul(gate.contiguous(), up.contiguous()))
    assert_bits_equal(silu_mul_fp8(gate, up, variant), want)
    h = _tricky_rows(4096, torch.bfloat16, gen)[:6]
    w = (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16)
    assert_bits_equal(rms_norm_fp8(h, w, 1e-6, variant), quant_fp8_rowwise_ref(rms_norm(h, w, 1e-6)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_of_the_fused_producers(rng, dtype, variant):
    """The fused kernels = plain kernel + quantiser, with silu*mul values on e4m3 ties (silu(64) = 64 exactly,
    so 64 * grid / 64 is the grid), -0 from silu(0) * negative and silu(-0), and RMSNorm with negative weights
    (-0 from zero inputs) over all-zero rows."""
    gen = torch.Generator().manual_seed(rng)
    n = 333
    up = _tricky_rows(n, dtype, gen)
    gate = (torch.randn(12, n, generator=gen) * 3).to(dtype)
    gate[2:5] = 64.0
    up[2:5] = up[2:5] / 64
    gate[1, ::2] = 0.0
    gate[1, 1::4] = -0.0
    gu = torch.cat([gate, up], dim=1)                                                  # strided halves
    g, u = gu[:, :n], gu[:, n:]
    want = quant_fp8_rowwise_ref(silu_mul(g.contiguous(), u.contiguous()))
    assert_bits_equal(silu_mul_fp8(g, u, variant), want)
    x = _tricky_rows(n, dtype, gen)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    w[::3] *= -1
    assert_bits_equal(rms_norm_fp8(x, w, 1e-6, variant), quant_fp8_rowwise_ref(rms_norm(x, w, 1e-6)))
