"""Row-wise fp8 (e4m3) quantisation: one scale per row, `q = round(x / s)`, `s = amax(|row|) / 448`.

Used for activations (one scale per token, dynamic) and weights (one scale per output channel).
The Triton kernel reads the row once and writes the fp8 row and its scale (the torch reference is
~6 passes over the row). Both round the same way, bit for bit:
  s = max(amax, 1e-12) / 448              (fp32, correctly rounded division)
  y = clamp(x_fp32 / s, -448, 448)        (correctly rounded division)
  q = round-to-nearest-even of y to the e4m3 grid (3 mantissa bits; subnormals below 2^-6)
The kernel rounds to the grid in fp32 arithmetic before the (then exact) cast, so its result does not
depend on how a backend converts fp32 -> fp8 (the Triton interpreter's cast carries wrongly at a
binade edge; PTX `cvt.rn.satfinite` and torch's cast are RNE like the explicit rounding).
"""
from __future__ import annotations

import torch

from ._backend import lazy_jit, next_pow2, tl, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale (its values quantise to 0 either way)


def quant_fp8_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32); x ~= q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _quant_kernel(X, Q, S, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
    # round to the e4m3 grid: quantum 2^(e-3) for normals, 2^-9 below 2^-6 (fp32 exponent field 121)
    e = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    quantum = ((tl.maximum(e, 121) - 3) << 23).to(tl.float32, bitcast=True)
    r = tl.math.div_rn(y, quantum)          # exact: power-of-two divisor
    r = (r + 12582912.0) - 12582912.0       # 1.5 * 2^23: round-to-nearest-even to an integer
    tl.store(Q + row * stride_q + cols, (r * quantum).to(Q.dtype.element_ty), mask=ok)
    tl.store(S + row, s)


_quant = lazy_jit(_quant_kernel)


def quant_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise fp8 quantisation of a 2-D tensor (Triton on CUDA, the reference elsewhere)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    n = x.shape[1]
    ok = x.stride(1) == 1 and n <= 16384 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not use_triton(x, ok):
        return quant_fp8_rowwise_ref(x)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _quant[(x.shape[0],)](x, q, s, n, x.stride(0), q.stride(0), BLOCK=next_pow2(n),
                              num_warps=4 if n <= 2048 else 8)
    return q, s
