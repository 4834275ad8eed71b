"""RMSNorm and the SwiGLU gate (silu(gate) * up): elementwise hot paths of every decoder layer.

Both round exactly where torch does (Qwen3RMSNorm: normalise in fp32, cast to the input dtype, then
multiply by the weight in that dtype; silu in fp32 rounded to the dtype, then the product rounded);
one kernel launch instead of ~6. silu*mul gives torch's bits; RMSNorm's sum of squares is reduced in the
order the launch layout gives, so on the GPU the plain kernel can differ from torch by a few ULPs of the
rsqrt (measured on the H200, docs/benchmarks/kernels.md).

The `_fp8` variants feed an fp8 GEMM (services/model/quant.py): the same row, rounded to the input
dtype as above, then quantised row-wise in the same kernel (kernels/fp8_quant.py: one scale per row),
so the activation is never written in bf16 and read back. Measured on the H200: silu*mul -> fp8 gives the
bits of the plain kernel followed by `quant_fp8_rowwise`; RMSNorm -> fp8 gives the torch reference's bits
(torch RMSNorm + quantiser), not those of the plain Triton RMSNorm + quantiser (the reduction above).
silu*mul -> fp8 runs in every launch variant of kernels/fp8_quant.py (`auto` by default: from 2,048
rows `pieces`, the 12288-wide row as 3 x 4096 in registers; below, `row`); RMSNorm -> fp8 keeps the plain kernel's one-row layout and warps (its sum
of squares, whose order follows the layout, must stay the same bits), so only its arithmetic follows the
variant (`legacy` divides).

`add_rms_norm` / `add_rms_norm_fp8` fuse the residual add in front of the norm (a decoder layer's
`x = x + o; norm(x)`): the same kernel (ADD) reads x and the delta, writes the new residual and
normalises it (and quantises) in one pass. The residual is torch's `x + delta` bit for bit (fp32 sum
rounded once to x's dtype; for bf16 rounded to nearest even by integer arithmetic on the fp32 bits,
because the Triton interpreter's bf16 cast truncates), and the normalised row is that of the plain kernel run on
it (the plain kernel's code, block and warps; the fp8 variant: `rms_norm_fp8`'s), so the fused and
unfused layer give the same bits (bench/bench_generation.py --part addnorm checks that on the GPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import lazy_jit, next_pow2, tl, triton_cdiv, use_triton
from .fp8_quant import FP8_ROW_HELPERS, empty_fp8_rows, fp8_launch, quant_fp8_rowwise_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, then row-wise fp8: (q [rows, n] e4m3, scale [rows, 1] fp32)."""
    return quant_fp8_rowwise_ref(rms_norm_ref(x, weight, eps).reshape(-1, x.shape[-1]))


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm of it)."""
    s = x + delta
    return s, rms_norm_ref(s, weight, eps)


def add_rms_norm_fp8_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, then its RMSNorm quantised row-wise: q [rows, n] e4m3, scale [rows, 1] fp32)."""
    s = x + delta
    return (s, *rms_norm_fp8_ref(s, weight, eps))


def silu_mul_fp8_ref(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of [rows, n] operands, then row-wise fp8: (q [rows, n], scale [rows, 1])."""
    return quant_fp8_rowwise_ref(silu_mul_ref(gate, up))


def _rne_bf16_fn(v):
    """fp32 v rounded to the nearest bf16 (ties to even), as an fp32 value: what torch's cast gives, in
    integer arithmetic, so that the cast after it is exact on any backend (the interpreter's truncates)."""
    b = v.to(tl.uint32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))   # NaN stays NaN


def _rms_norm_kernel(X, D, R, W, Y, S, n_cols, stride_x, stride_d, stride_r, stride_y, eps, BLOCK: tl.constexpr,
                     ADD: tl.constexpr, QUANT: tl.constexpr, DIV_RN: tl.constexpr, HW_CVT: tl.constexpr):
    """One row. ADD: the row is X + D (fp32 sum rounded once to X's dtype, as torch rounds), stored to R,
    then normalised. QUANT: Y is the fp8 row and S its scale, else Y is the row in X's dtype (S unused)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(D + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
        if X.dtype.element_ty == tl.bfloat16:
            x = _rne_bf16(x)
        r = x.to(X.dtype.element_ty)
        tl.store(R + row * stride_r + cols, r, mask=ok)
        x = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    h = (x * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    y = (h * w).to(X.dtype.element_ty)
    if QUANT:
        yf = y.to(tl.float32)
        _fp8_store_pieces(Y + row * stride_y, S + row, cols, n_cols, yf, yf, yf, yf, BLOCK, 1, False, DIV_RN, HW_CVT)
    else:
        tl.store(Y + row * stride_y + cols, y, mask=ok)


def _silu_mul_value_fn(g, u, dt):
    """silu(g) * u from fp32 operands, rounded like torch: silu to dt, then the product to dt (fp32 out)."""
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt).to(tl.float32)


def _silu_mul_kernel(G, U, Y, n, stride_g, stride_u, BLOCK: tl.constexpr):
    # program (block of n columns, row): a contiguous input is one row of all its elements
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * n + offs, _silu_mul_value(g, u, Y.dtype.element_ty).to(Y.dtype.element_ty), mask=ok)


def _silu_mul_fp8_kernel(G, U, Q, S, n_cols, stride_g, stride_u, stride_q, BLOCK: tl.constexpr, NP: tl.constexpr,
                         EVEN: tl.constexpr, DIV_RN: tl.constexpr, HW_CVT: tl.constexpr):
    """One row of gate / up (any row strides: views of one gate|up GEMM output) -> its fp8 row + scale; the
    row's silu*mul values stay in registers as NP pieces of BLOCK columns."""
    row = tl.program_id(0).to(tl.int64)
    G += row * stride_g
    U += row * stride_u
    dt = G.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    y0 = _silu_mul_value(_row_load(G, cols, n_cols, EVEN, ""), _row_load(U, cols, n_cols, EVEN, ""), dt)
    y1 = y0
    y2 = y0
    y3 = y0
    if NP > 1:
        c1 = BLOCK + cols
        y1 = _silu_mul_value(_row_load(G, c1, n_cols, EVEN, ""), _row_load(U, c1, n_cols, EVEN, ""), dt)
    if NP > 2:
        c2 = 2 * BLOCK + cols
        y2 = _silu_mul_value(_row_load(G, c2, n_cols, EVEN, ""), _row_load(U, c2, n_cols, EVEN, ""), dt)
    if NP > 3:
        c3 = 3 * BLOCK + cols
        y3 = _silu_mul_value(_row_load(G, c3, n_cols, EVEN, ""), _row_load(U, c3, n_cols, EVEN, ""), dt)
    _fp8_store_pieces(Q + row * stride_q, S + row, cols, n_cols, y0, y1, y2, y3, BLOCK, NP, EVEN, DIV_RN, HW_CVT)


def _silu_mul_fp8_twopass_kernel(G, U, Q, S, n_cols, stride_g, stride_u, stride_q, CHUNK: tl.constexpr,
                                 EVEN: tl.constexpr, HW_CVT: tl.constexpr):
    """`_silu_mul_fp8_kernel` in column chunks: pass 1 the amax of the rounded silu*mul values, pass 2
    recomputes them from a second read (mostly L2 hits) and stores."""
    row = tl.program_id(0).to(tl.int64)
    G += row * stride_g
    U += row * stride_u
    Q += row * stride_q
    dt = G.dtype.element_ty
    cols = tl.arange(0, CHUNK)
    m = tl.zeros([CHUNK], tl.float32)
    for c in range(0, n_cols, CHUNK):
        g = _row_load(G, c + cols, n_cols, EVEN, "evict_last")
        m = tl.maximum(m, tl.abs(_silu_mul_value(g, _row_load(U, c + cols, n_cols, EVEN, "evict_last"), dt)))
    s, r = _fp8_scale(tl.max(m, axis=0))
    for c in range(0, n_cols, CHUNK):
        g = _row_load(G, c + cols, n_cols, EVEN, "evict_first")
        y = _silu_mul_value(g, _row_load(U, c + cols, n_cols, EVEN, "evict_first"), dt)
        _fp8_put(Q, c + cols, n_cols, y, s, r, EVEN, False, HW_CVT)
    tl.store(S + row, s)


_rms = lazy_jit(_rms_norm_kernel, helpers={"_rne_bf16": _rne_bf16_fn, **FP8_ROW_HELPERS})
_silu = lazy_jit(_silu_mul_kernel, helpers={"_silu_mul_value": _silu_mul_value_fn})
_silu_fp8 = lazy_jit(_silu_mul_fp8_kernel, helpers={"_silu_mul_value": _silu_mul_value_fn, **FP8_ROW_HELPERS})
_silu_fp8_twopass = lazy_jit(_silu_mul_fp8_twopass_kernel,
                             helpers={"_silu_mul_value": _silu_mul_value_fn, **FP8_ROW_HELPERS})


def _rms_ok(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    """Shapes and dtypes the kernel takes; with `delta` any strides (made contiguous first, as `x + delta` is)."""
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        return False
    return (delta is not None or x.is_contiguous()) and weight.dtype == x.dtype and x.shape[-1] <= 16384


def _rms_warps(n: int) -> int:
    """Warps of every RMSNorm launch: the same for the plain, the fp8 and the ADD kernels, so that the
    row sum (whose order follows the layout) and hence the normalised row are the same bits."""
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


def _rms_launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, y: torch.Tensor,
                scale: torch.Tensor | None, variant: str | None = None) -> torch.Tensor | None:
    """`_rms_norm_kernel` over the rows of x (contiguous) into y ([rows, n]: x's dtype, or fp8 with its
    `scale`); with `delta` (x's shape) also the residual x + delta, which it returns."""
    n = x.shape[-1]
    x2 = x.view(-1, n)
    d2 = x2 if delta is None else delta.view(-1, n)
    r = x2 if delta is None else torch.empty_like(x2)
    launch = fp8_launch(n, variant) if scale is not None else None
    if x2.shape[0]:
        _rms[(x2.shape[0],)](x2, d2, r, weight, y, y if scale is None else scale, n, x2.stride(0), d2.stride(0),
                             r.stride(0), y.stride(0), eps, BLOCK=next_pow2(n), ADD=delta is not None,
                             QUANT=launch is not None, DIV_RN=launch is not None and launch.div_rn,
                             HW_CVT=launch is not None and launch.hw_cvt, num_warps=_rms_warps(n))
    return None if delta is None else r.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    if not use_triton(x, _rms_ok(x, weight)):
        return rms_norm_ref(x, weight, eps)
    y = torch.empty_like(x)
    _rms_launch(x, None, weight, eps, y.view(-1, x.shape[-1]), None)
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm of it) in one pass: the sum is torch's `x + delta` bit for bit and the norm
    `rms_norm`'s of that sum. x, delta: the same shape and dtype."""
    if not use_triton(x, _rms_ok(x, weight, delta)):
        s = x + delta            # the unfused ops: the same results wherever the fused kernel does not run
        return s, rms_norm(s, weight, eps)
    x, delta = x.contiguous(), delta.contiguous()
    y = torch.empty_like(x)
    return _rms_launch(x, delta, weight, eps, y.view(-1, x.shape[-1]), None), y


def _fp8_ok(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    return _rms_ok(x, weight, delta) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x, quantised row-wise to fp8 in the same pass:
    (q [rows, n] e4m3, scale [rows, 1] fp32) for rows = every leading index of x.
    `variant` (kernels/fp8_quant.py `fp8_launch`): only `legacy` differs here (it divides); the row
    always stays in registers with the plain kernel's layout (its sum of squares is the same bits)."""
    if not use_triton(x, _fp8_ok(x, weight)):
        return rms_norm_fp8_ref(x, weight, eps)
    n = x.shape[-1]
    q, s = empty_fp8_rows(x.shape[:-1].numel(), n, x.device)
    _rms_launch(x, None, weight, eps, q, s, variant)
    return q, s


def add_rms_norm_fp8(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta, q, scale) in one pass: the sum is torch's `x + delta` bit for bit, (q, scale)
    `rms_norm_fp8` of that sum. `variant` as there."""
    if not use_triton(x, _fp8_ok(x, weight, delta)):
        s = x + delta            # the unfused ops (see add_rms_norm)
        return (s, *rms_norm_fp8(s, weight, eps, variant))
    x, delta = x.contiguous(), delta.contiguous()
    n = x.shape[-1]
    q, s = empty_fp8_rows(x.shape[:-1].numel(), n, x.device)
    return _rms_launch(x, delta, weight, eps, q, s, variant), q, s


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. Contiguous inputs, or [rows, n] ones with any row stride (the two halves of one gate|up
    GEMM output, model/fused_rows.py); the result is contiguous."""
    flat = gate.is_contiguous() and up.is_contiguous()
    rows_ok = (gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1 and gate.shape[0] <= 65535)
    ok = (flat or rows_ok) and gate.shape == up.shape and gate.dtype == up.dtype
    if not use_triton(gate, ok):
        return silu_mul_ref(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, n, sg, su = (1, gate.numel(), 0, 0) if flat else (gate.shape[0], gate.shape[1], gate.stride(0), up.stride(0))
    if rows and n:
        block = 2048
        _silu[(triton_cdiv(n, block), rows)](gate, up, y, n, sg, su, BLOCK=block, num_warps=4)
    return y


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantised row-wise to fp8 in one kernel. gate / up: [rows, n], last dim
    contiguous, any row stride (e.g. the two halves of one gate|up GEMM output). `variant`: the launch
    (kernels/fp8_quant.py `fp8_launch`); every variant gives the same bits."""
    ok = (gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype and gate.stride(1) == 1
          and up.stride(1) == 1 and gate.shape[1] <= 16384
          and gate.dtype in (torch.bfloat16, torch.float16, torch.float32))
    if not use_triton(gate, ok):
        return silu_mul_fp8_ref(gate, up)
    m, n = gate.shape
    launch = fp8_launch(n, variant, m)
    q, s = empty_fp8_rows(m, n, gate.device)
    if m:
        args = (gate, up, q, s, n, gate.stride(0), up.stride(0), q.stride(0))
        if launch.twopass:
            _silu_fp8_twopass[(m,)](*args, CHUNK=launch.block, EVEN=launch.even, HW_CVT=launch.hw_cvt,
                                    num_warps=launch.warps)
        else:
            _silu_fp8[(m,)](*args, BLOCK=launch.block, NP=launch.pieces, EVEN=launch.even, DIV_RN=launch.div_rn,
                            HW_CVT=launch.hw_cvt, num_warps=launch.warps)
    return q, s
