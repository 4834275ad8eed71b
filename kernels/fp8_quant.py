"""Row-wise fp8 (e4m3) quantisation: one scale per row, `q = round(x / s)`, `s = amax(|row|) / 448`.

Used for activations (one scale per token, dynamic) and weights (one scale per output channel).
The Triton kernels read the row once and write the fp8 row and its scale (the torch reference is
~6 passes over the row). Both compute, bit for bit:
  s = max(amax, 1e-12) * INV_FP8_MAX      (fp32 product; INV_FP8_MAX = fl32(1/448))
  y = clamp(x_fp32 / s, -448, 448)        (correctly rounded division)
  q = round-to-nearest-even of y to the e4m3 grid (3 mantissa bits; subnormals below 2^-6), signed
      zero kept (a negative value that rounds to 0 is -0, as torch's cast gives)
(rows holding inf / NaN are unspecified). The scale is a product with the fp32 reciprocal, not a
division by 448, because that is what torch computes on CUDA for `tensor / 448.0` (a CPU-scalar divisor
becomes a multiply by its reciprocal), while on CPU it divides: the first GPU run found every row's
scale 1 ulp apart in ~half the rows (2026-11-30). The product is the same everywhere.

How the kernels get those bits without a division per value (`tl.math.div_rn` is a long PTX sequence
with a slow-path call; two per value made the producers compute-bound, 2026-12):
- x / s: r = RN(1/s) once per row (div_rn), then for a = |x|: q0 = RN(a r); q1 = RN(q0 + RN(a - s q0) r);
  q2 = RN(q1 + (a - s q1) r) with both residuals FMAs. q0 is within 1.5 ulp of a / s (r carries a relative
  error < 2^-24, the product rounds once more); q1 is then faithful (the residual's own rounding error is
  2^-24 of a 1.5-ulp quantity, so q0 + e r is within ~2^-22 ulp of a / s before rounding). For a faithful
  q1 and r = RN(1/s), Markstein's theorem (Markstein 1990; Muller et al., Handbook of Floating-Point
  Arithmetic, "Newton-Raphson-based division with an FMA") gives a - s q1 exactly representable and q2 =
  RN(a / s). No over/underflow where it matters: |a / s| <= 448 (1 + 2^-23), s >= 2^-49, and quotients
  below 2^-11 (residuals may underflow) round to 0 in e4m3 either way. The sign is x's sign bit put back
  last (OR of the bit), so -0 and negatives that round to 0 give -0 (`-r` compiled as `0 - r` lost it).
  tests/kernels/interpreted/check_fp8.py checks rows where RN(a r) alone rounds differently.
- the e4m3 rounding: on the GPU the cast does it (PTX `cvt.rn.satfinite.e4m3x2.f32`: RNE, +-448
  saturation = the clamp); where the cast is not trusted (the Triton interpreter's carries wrongly at a
  binade edge and mangles fp32 subnormals; U1SERVE_FP8_ROUND=explicit) the value is rounded to the grid in
  fp32 first: times the exact reciprocal of its power-of-two quantum, +- 1.5 * 2^23, times the quantum.

Launch variants (`fp8_launch`; `U1SERVE_FP8_VARIANT`, or the `variant` argument of the producers; every
variant gives the same bits): `legacy` (the first kernel: the row padded to a power of two in registers,
two div_rn per value; for timing comparisons), `row` (the same layout, no division), `pieces` (the row in
registers as <= 4 unmasked power-of-two pieces, e.g. 12288 = 3 x 4096: no padded lanes; the default from
2,048 rows), `auto` (default: `row` below 2,048 rows where the row needs several pieces, else `pieces`:
on the H200 silu*mul -> fp8 at [1024, 12288] took 64.3 us with `pieces`, 29.2 with `row`; at 2,048 rows
42.6 vs 49.7; docs/benchmarks/kernels.md),
`twopass` (column chunks: pass 1 the amax, pass 2 re-reads, mostly from L2, and stores: small programs,
many per SM). A spec may add the block (`twopass-1024`, `pieces-2048`) and the warps (`-w8`).

The helpers (`_fp8_scale`, `_fp8_value`, `_fp8_put`, `_fp8_store_pieces`, and kernels/row_quant.py's, which
the int8 quantiser shares) are shared with the producers that quantise what they compute (RMSNorm, silu*mul:
kernels/norm_act.py).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ._backend import interpreting, lazy_jit, next_pow2, tl, use_triton
from .row_quant import ROW_QUANT_HELPERS, row_scale_ref

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = 0.0022321429569274187   # fl32(1 / 448), exactly representable in fp32


def fp8_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """The row scale from the row's amax (fp32): max(amax, floor) * fl32(1/448)."""
    return row_scale_ref(amax, INV_FP8_MAX)


def quant_fp8_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32); x ~= q * scale."""
    xf = x.float()
    scale = fp8_scale_ref(xf.abs().amax(dim=-1, keepdim=True))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


# ---- launch variants (module doc) ---------------------------------------------------------------------
FP8_VARIANTS = ("legacy", "row", "pieces", "twopass")
VARIANT_ENV = "U1SERVE_FP8_VARIANT"      # a variant spec (`fp8_launch`); unset or "auto": the default
ROUND_ENV = "U1SERVE_FP8_ROUND"          # "hw" (default): the GPU's RNE satfinite cast; "explicit": round here
TWOPASS_CHUNK = 2048
PIECE = 4096
AUTO_PIECES_MIN_ROWS = 2048              # auto: fewer rows of several pieces run `row` (module doc)


@dataclass(frozen=True)
class Fp8Launch:
    """How a row-wise fp8 producer runs over rows of n columns: `block` columns per piece (`pieces` of
    them held in registers at once; 1 for `row` / `legacy`) or per chunk (`twopass`), `even`: n is a
    multiple of the block (no masks), `warps`, and the arithmetic: `div_rn` (legacy: two IEEE divisions
    per value) and `hw_cvt` (the cast rounds; else fp32 rounding to the grid first)."""
    variant: str
    block: int
    pieces: int
    even: bool
    warps: int
    div_rn: bool
    hw_cvt: bool

    @property
    def twopass(self) -> bool:
        return self.variant == "twopass"

    def spec(self) -> str:
        return f"{self.variant}-{self.block}-w{self.warps}"


def fp8_launch(n: int, variant: str | None = None, rows: int | None = None) -> Fp8Launch:
    """The launch for `rows` rows (None: many) of n columns from a spec `name[-block][-wWARPS]` (name in
    FP8_VARIANTS; block: chunk / piece width, a power of two), else $U1SERVE_FP8_VARIANT, else auto: `row`
    below AUTO_PIECES_MIN_ROWS rows of more than one piece, else `pieces` (the row in registers as <= 4
    pieces of up to 4096 columns). Cached: it runs before every fp8 launch."""
    spec = (variant or os.environ.get(VARIANT_ENV, "") or "auto").strip().lower()
    few = rows is not None and rows < AUTO_PIECES_MIN_ROWS and n > PIECE
    return _launch(n, spec, interpreting(), os.environ.get(ROUND_ENV, "hw").strip().lower(), few)


@functools.lru_cache(maxsize=256)
def _launch(n: int, spec: str, interpreted: bool, rounding: str, few_rows: bool = False) -> Fp8Launch:
    name, *opts = (("row" if few_rows else "pieces") if spec == "auto" else spec).split("-")
    block = warps = None
    for o in opts:
        if o.isdigit() and int(o) >= 16 and next_pow2(int(o)) == int(o):
            block = int(o)
        elif o[:1] == "w" and o[1:].isdigit() and int(o[1:]) in (1, 2, 4, 8, 16, 32):
            warps = int(o[1:])
        else:
            name = ""
    if name not in FP8_VARIANTS or (block and name in ("legacy", "row")):
        raise ValueError(f"fp8 variant must be auto or name[-block][-wWARPS] with name in {FP8_VARIANTS} "
                         f"(block only for pieces / twopass), got {spec!r}")
    if name == "twopass":
        block = min(block or TWOPASS_CHUNK, next_pow2(n))
        pieces = 1
    elif name == "pieces":
        block = min(block or PIECE, next_pow2(n))
        pieces = -(-n // block)
        if pieces > 4:
            raise ValueError(f"fp8 variant {spec!r}: at most 4 pieces per row, {n} columns need {pieces}")
    else:
        block, pieces = next_pow2(n), 1
    if warps is None:   # ~16 fp32 values per thread (pieces: up to 32)
        per_thread = 32 if pieces > 2 else 16
        warps = row_warps(n) if name == "legacy" else min(8 if name == "twopass" else 32,
                                                          max(4, _floor_pow2(block * pieces // (32 * per_thread))))
    legacy = name == "legacy"
    hw = not legacy and not interpreted and rounding != "explicit"
    return Fp8Launch(name, block, pieces, n % block == 0, warps, legacy, hw)


def _floor_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def row_warps(n: int) -> int:
    """Warps of the legacy one-row-per-program launch over n columns."""
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


# ---- the quantising arithmetic (Triton helpers, jitted with each kernel that calls them) ----------------
def _fp8_scale_fn(amax):
    """(the row scale, its reciprocal) from the row amax (fp32): the scale `fp8_scale_ref` computes."""
    return _row_scale(amax, 0.0022321429569274187)   # INV_FP8_MAX


def _fp8_value_fn(y, s, r, DIV_RN: tl.constexpr, HW_CVT: tl.constexpr):
    """y / s ready for the cast to e4m3, r = RN(1 / s). HW_CVT: the signed RN(y / s), which the cast
    rounds to nearest even and saturates to +-448 (PTX `cvt.rn.satfinite`); else clamped to +-448 and
    rounded to the e4m3 grid here (exact fp32: the cast is then exact on any backend). The sign is y's
    sign bit, so -0 and negatives that round to 0 give -0, as torch's cast does."""
    a = tl.abs(y)
    if DIV_RN:
        v = tl.math.div_rn(a, s)
    else:
        v = _div_rn(a, s, r)    # RN(a / s) without a division (module doc)
    if not HW_CVT:
        v = tl.minimum(v, 448.0)
        # quantum 2^(e-3) for normals, 2^-9 below 2^-6 (fp32 exponent field 121); its reciprocal is exact
        k = tl.maximum(v.to(tl.int32, bitcast=True) >> 23, 121) - 3
        quantum = (k << 23).to(tl.float32, bitcast=True)
        if DIV_RN:
            t = tl.math.div_rn(v, quantum)
        else:
            t = v * ((254 - k) << 23).to(tl.float32, bitcast=True)
        t = (t + 12582912.0) - 12582912.0       # 1.5 * 2^23: round-to-nearest-even to an integer (t <= 14)
        v = t * quantum
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def _fp8_put_fn(Q, offs, n_cols, y, s, r, EVEN: tl.constexpr, DIV_RN: tl.constexpr, HW_CVT: tl.constexpr):
    q = _fp8_value(y, s, r, DIV_RN, HW_CVT).to(Q.dtype.element_ty)
    if EVEN:
        tl.store(Q + offs, q)
    else:
        tl.store(Q + offs, q, mask=offs < n_cols)


def _fp8_store_pieces_fn(Q, S, cols, n_cols, y0, y1, y2, y3, BLOCK: tl.constexpr, NP: tl.constexpr,
                         EVEN: tl.constexpr, DIV_RN: tl.constexpr, HW_CVT: tl.constexpr):
    """Quantises one row held as NP <= 4 pieces y0.. (fp32, 0 past n_cols) of BLOCK columns: writes the
    fp8 row at Q + cols (+ BLOCK per piece) and its scale at S."""
    m = tl.abs(y0)
    if NP > 1:
        m = tl.maximum(m, tl.abs(y1))
    if NP > 2:
        m = tl.maximum(m, tl.abs(y2))
    if NP > 3:
        m = tl.maximum(m, tl.abs(y3))
    s, r = _fp8_scale(tl.max(m, axis=0))
    _fp8_put(Q, cols, n_cols, y0, s, r, EVEN, DIV_RN, HW_CVT)
    if NP > 1:
        _fp8_put(Q, BLOCK + cols, n_cols, y1, s, r, EVEN, DIV_RN, HW_CVT)
    if NP > 2:
        _fp8_put(Q, 2 * BLOCK + cols, n_cols, y2, s, r, EVEN, DIV_RN, HW_CVT)
    if NP > 3:
        _fp8_put(Q, 3 * BLOCK + cols, n_cols, y3, s, r, EVEN, DIV_RN, HW_CVT)
    tl.store(S, s)


def _quant_kernel(X, Q, S, n_cols, stride_x, stride_q, BLOCK: tl.constexpr, NP: tl.constexpr,
                  EVEN: tl.constexpr, DIV_RN: tl.constexpr, HW_CVT: tl.constexpr):
    """One row per program, held in registers as NP pieces of BLOCK columns."""
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    cols = tl.arange(0, BLOCK)
    y0 = _row_load(X, cols, n_cols, EVEN, "")
    y1 = y0
    y2 = y0
    y3 = y0
    if NP > 1:
        y1 = _row_load(X, BLOCK + cols, n_cols, EVEN, "")
    if NP > 2:
        y2 = _row_load(X, 2 * BLOCK + cols, n_cols, EVEN, "")
    if NP > 3:
        y3 = _row_load(X, 3 * BLOCK + cols, n_cols, EVEN, "")
    _fp8_store_pieces(Q + row * stride_q, S + row, cols, n_cols, y0, y1, y2, y3, BLOCK, NP, EVEN, DIV_RN, HW_CVT)


def _quant_twopass_kernel(X, Q, S, n_cols, stride_x, stride_q, CHUNK: tl.constexpr, EVEN: tl.constexpr,
                          HW_CVT: tl.constexpr):
    """One row in column chunks: pass 1 the amax, pass 2 re-reads (mostly from L2) and stores."""
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Q += row * stride_q
    cols = tl.arange(0, CHUNK)
    s, r = _chunked_row_scale(X, cols, n_cols, CHUNK, EVEN, 0.0022321429569274187)   # INV_FP8_MAX
    for c in range(0, n_cols, CHUNK):
        _fp8_put(Q, c + cols, n_cols, _row_load(X, c + cols, n_cols, EVEN, "evict_first"), s, r, EVEN, False,
                 HW_CVT)
    tl.store(S + row, s)


# Helpers for the producers here and in kernels/norm_act.py (`lazy_jit` binds their names where they call each
# other).
FP8_ROW_HELPERS = {**ROW_QUANT_HELPERS, "_fp8_scale": _fp8_scale_fn, "_fp8_value": _fp8_value_fn,
                   "_fp8_put": _fp8_put_fn, "_fp8_store_pieces": _fp8_store_pieces_fn}
_quant = lazy_jit(_quant_kernel, helpers=FP8_ROW_HELPERS)
_quant_twopass = lazy_jit(_quant_twopass_kernel, helpers=FP8_ROW_HELPERS)


def empty_fp8_rows(m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((m, n), dtype=FP8_DTYPE, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def quant_fp8_rowwise(x: torch.Tensor, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise fp8 quantisation of a 2-D tensor (Triton on CUDA, the reference elsewhere).
    `variant`: the launch (`fp8_launch`); every variant gives the same bits."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    n = x.shape[1]
    ok = x.stride(1) == 1 and n <= 16384 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not use_triton(x, ok):
        return quant_fp8_rowwise_ref(x)
    launch = fp8_launch(n, variant, x.shape[0])
    q, s = empty_fp8_rows(x.shape[0], n, x.device)
    if x.shape[0]:
        args = (x, q, s, n, x.stride(0), q.stride(0))
        if launch.twopass:
            _quant_twopass[(x.shape[0],)](*args, CHUNK=launch.block, EVEN=launch.even, HW_CVT=launch.hw_cvt,
                                          num_warps=launch.warps)
        else:
            _quant[(x.shape[0],)](*args, BLOCK=launch.block, NP=launch.pieces, EVEN=launch.even,
                                  DIV_RN=launch.div_rn, HW_CVT=launch.hw_cvt, num_warps=launch.warps)
    return q, s
