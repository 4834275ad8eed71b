"""Row-wise fp8 (e4m3) quantisation: one scale per row, `q = round(x / s)`, `s = amax(|row|) / 448`.

Used for activations (one scale per token, dynamic) and weights (one scale per output channel).
The Triton kernel reads the row once and writes the fp8 row and its scale (the torch reference is
~6 passes over the row). Both compute, bit for bit:
  s = max(amax, 1e-12) * INV_FP8_MAX      (fp32 product; INV_FP8_MAX = fl32(1/448))
  y = clamp(x_fp32 / s, -448, 448)        (correctly rounded division)
  q = round-to-nearest-even of y to the e4m3 grid (3 mantissa bits; subnormals below 2^-6), signed
      zero kept (a negative value that rounds to 0 is -0, as torch's cast gives)
The scale is a product with the fp32 reciprocal, not a division by 448, because that is what torch
computes on CUDA for `tensor / 448.0` (a CPU-scalar divisor becomes a multiply by its reciprocal), while
on CPU it divides: the first GPU run found every row's scale 1 ulp apart in ~half the rows (2026-11-30).
The product is the same everywhere. The kernel rounds to the grid in fp32 arithmetic before the (then
exact) cast, so its result does not depend on how a backend converts fp32 -> fp8 (the Triton
interpreter's cast carries wrongly at a binade edge; PTX `cvt.rn.satfinite` and torch's cast are RNE
like the explicit rounding).

`store_fp8_row` is the quantising tail as a Triton helper: producers that already hold a row in
registers (RMSNorm, silu*mul: kernels/norm_act.py) quantise it without writing it out first.
"""
from __future__ import annotations

import torch

from ._backend import lazy_jit, next_pow2, tl, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 0.0022321429569274187   # fl32(1 / 448), exactly representable in fp32
AMAX_FLOOR = 9.999999960041972e-13    # fl32(1e-12): an all-zero row gets a tiny scale (its values are 0)


def fp8_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """The row scale from the row's amax (fp32): max(amax, floor) * fl32(1/448)."""
    return amax.float().clamp_min(AMAX_FLOOR) * INV_FP8_MAX


def quant_fp8_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32); x ~= q * scale."""
    xf = x.float()
    scale = fp8_scale_ref(xf.abs().amax(dim=-1, keepdim=True))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _store_fp8_row_fn(y, ok, Q, S):
    """y: one row as fp32 (masked lanes 0), ok: the lane mask, Q: pointers of its fp8 outputs, S: the
    pointer of its scale. Writes q and s as `quant_fp8_rowwise_ref` computes them."""
    amax = tl.max(tl.abs(y), axis=0)
    s = tl.maximum(amax, 9.999999960041972e-13) * 0.0022321429569274187
    v = tl.minimum(tl.maximum(tl.math.div_rn(y, s), -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    # round |v| to the e4m3 grid: quantum 2^(e-3) for normals, 2^-9 below 2^-6 (fp32 exponent field 121)
    e = (bits >> 23) & 0xFF
    quantum = ((tl.maximum(e, 121) - 3) << 23).to(tl.float32, bitcast=True)
    r = tl.math.div_rn(a, quantum)          # exact: power-of-two divisor
    r = ((r + 12582912.0) - 12582912.0) * quantum   # 1.5 * 2^23: round-to-nearest-even to an integer
    r = tl.where(bits < 0, -r, r)           # the sign bit back: -0.0 and negatives that round to 0 give -0
    tl.store(Q, r.to(Q.dtype.element_ty), mask=ok)
    tl.store(S, s)


def _quant_kernel(X, Q, S, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    _store_fp8_row(x, ok, Q + row * stride_q + cols, S + row)


FP8_ROW_HELPERS = {"_store_fp8_row": _store_fp8_row_fn}   # for kernels that quantise what they produce
_quant = lazy_jit(_quant_kernel, helpers=FP8_ROW_HELPERS)


def row_warps(n: int) -> int:
    """Warps of a one-row-per-program kernel over n columns (keeps the row in registers)."""
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


def empty_fp8_rows(m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((m, n), dtype=FP8_DTYPE, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def quant_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise fp8 quantisation of a 2-D tensor (Triton on CUDA, the reference elsewhere)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    n = x.shape[1]
    ok = x.stride(1) == 1 and n <= 16384 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not use_triton(x, ok):
        return quant_fp8_rowwise_ref(x)
    q, s = empty_fp8_rows(x.shape[0], n, x.device)
    if x.shape[0]:
        _quant[(x.shape[0],)](x, q, s, n, x.stride(0), q.stride(0), BLOCK=next_pow2(n), num_warps=row_warps(n))
    return q, s
