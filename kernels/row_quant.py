"""The arithmetic the symmetric row-wise quantisers share (fp8 e4m3: kernels/fp8_quant.py, int8:
kernels/int8_gemm.py): the row scale from the row's amax, the chunked amax pass, and RN(a / s) without a
division per value. Each format passes its own fl32(1 / max); the Triton helpers are jitted with (and inlined
into) every kernel that calls them (`ROW_QUANT_HELPERS`), so the kernels compile to the code they had when
each spelled this out itself.

  s = max(amax, AMAX_FLOOR) * fl32(1 / max)   a product, not a division by max: torch on CUDA computes
                                             `tensor / 448.0` as a multiply by the fp32 reciprocal, so this is
                                             the scale CPU and CUDA agree on
  RN(a / s) = q2, with r = RN(1 / s):         q0 = RN(a r); q1 = RN(q0 + RN(a - s q0) r); q2 likewise from q1,
                                             both residuals FMAs (Markstein; the argument is in
                                             kernels/fp8_quant.py's module doc)
"""
from __future__ import annotations

import torch

from ._backend import tl

AMAX_FLOOR = 9.999999960041972e-13    # fl32(1e-12): an all-zero row gets a tiny scale (its values are 0)


def row_scale_ref(amax: torch.Tensor, inv_max: float) -> torch.Tensor:
    """The row scale from the row's amax: max(amax, floor) * inv_max in fp32."""
    return amax.float().clamp_min(AMAX_FLOOR) * inv_max


def _row_scale_fn(amax, INV_MAX: tl.constexpr):
    """(s, r): the scale `row_scale_ref` computes (INV_MAX: the format's fl32(1 / max)) and r = RN(1 / s), the
    reciprocal `_div_rn` takes (one IEEE division per row)."""
    s = tl.maximum(amax, 9.999999960041972e-13) * INV_MAX
    return s, tl.math.div_rn(tl.full([], 1.0, tl.float32), s)


def _row_load_fn(P, offs, n_cols, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """fp32 values at P + offs (0 past n_cols unless EVEN: no mask)."""
    if EVEN:
        return tl.load(P + offs, eviction_policy=EVICT).to(tl.float32)
    return tl.load(P + offs, mask=offs < n_cols, other=0.0, eviction_policy=EVICT).to(tl.float32)


def _chunked_row_scale_fn(X, cols, n_cols, CHUNK: tl.constexpr, EVEN: tl.constexpr, INV_MAX: tl.constexpr):
    """Pass 1 of a two-pass quantiser: `_row_scale` of the row at X, read in chunks of CHUNK columns (cols =
    arange(CHUNK)) and kept in L2 (evict_last) for pass 2's re-read."""
    m = tl.zeros([CHUNK], tl.float32)
    for c in range(0, n_cols, CHUNK):
        m = tl.maximum(m, tl.abs(_row_load(X, c + cols, n_cols, EVEN, "evict_last")))
    return _row_scale(tl.max(m, axis=0), INV_MAX)


def _div_rn_fn(a, s, r):
    """RN(a / s) for r = RN(1 / s) (module doc): q0 = RN(a r) is within 1.5 ulp of a / s, the first FMA
    correction makes it faithful, the second (exact residual, Markstein) correctly rounded."""
    v = a * r
    v = tl.fma(tl.fma(-v, s, a), r, v)
    return tl.fma(tl.fma(-v, s, a), r, v)


# Jitted with each kernel that uses them (`lazy_jit(helpers=...)` binds these names in the modules involved).
ROW_QUANT_HELPERS = {"_row_scale": _row_scale_fn, "_row_load": _row_load_fn,
                     "_chunked_row_scale": _chunked_row_scale_fn, "_div_rn": _div_rn_fn}
