"""Symmetric int8 row-wise quantisation and the int8 x int8 -> int32 GEMM with row/column scales (W8A8).

Quantisation, one scale per row (a token of an activation, an output channel of a weight):
  s = max(amax(|row|), 1e-12) * fl32(1/127)     (a product, so CPU and CUDA give the same scale: a CUDA
                                                 `tensor / 127.0` is a multiply by the reciprocal)
  q = clamp(round_half_even(x_fp32 / s), -127, 127)   (symmetric: -128 is never used)
The Triton row quantiser (CUDA) reads each row twice in column chunks (amax, then quantise from L2) and writes
int8 + scale: the reference's bits (x / s correctly rounded without a division per value: RN(a r) with
r = RN(1 / s) and two FMA corrections, the Markstein argument of kernels/fp8_quant.py; then round half to even
by adding and subtracting 1.5 * 2^23).
GEMM: y = (q_x @ q_w^T) * s_x * s_w with the integer product exact in int32 (|q| <= 127, so K < 133,000
cannot overflow), then one fp32 epilogue (int32 -> fp32, times s_x, times s_w) and one rounding to the
output dtype. On CUDA the integer product is `torch._int_mm` (cuBLASLt int8 tensor cores); everywhere
else it is an int32 matmul. The integer result is exact on both, and the epilogue is the same elementwise
fp32 code, so the CPU path gives the CUDA path's bits (tests compare them exactly).

`torch._int_mm`'s contract on CUDA: A [M, K] row-major, B [K, N] (our weight [N, K] transposed, the TN
layout cuBLASLt's int8 kernels want), M > 16, K and N multiples of 8. The layer policy only quantises
weights whose dims are multiples of 16; short M (decode, a few tokens) is padded with zero rows to 32
here (a copy of a few rows: cheaper than a second kernel, and the padded rows are dropped). No Triton
GEMM is needed for that reason; the epilogue is a separate elementwise pass (a fused epilogue is the next
step if the GEMM's output traffic shows in a profile).
"""
from __future__ import annotations

import torch

from ._backend import lazy_jit, tl, use_triton
from .row_quant import ROW_QUANT_HELPERS, row_scale_ref

INT8_MAX = 127
INV_INT8_MAX = 0.007874015718698502   # fl32(1 / 127)
_INT_MM_MIN_ROWS = 17                 # torch._int_mm on CUDA wants M > 16
_PAD_ROWS = 32
PRODUCT_BLOCK_ROWS = 2048             # rows of one int32 product (int8_mm): bounds its buffer, large enough to keep
#                                       the tensor cores busy (an H100's 132 SMs see 2,048 x N as many tiles)


def int8_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    return row_scale_ref(amax, INV_INT8_MAX)


def quant_int8_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] int8, scale [M, 1] fp32); x ~= q * scale."""
    xf = x.float()
    scale = int8_scale_ref(xf.abs().amax(dim=-1, keepdim=True))
    q = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _quant_int8_kernel(X, Q, S, n_cols, stride_x, stride_q, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Q += row * stride_q
    cols = tl.arange(0, CHUNK)
    s, r = _chunked_row_scale(X, cols, n_cols, CHUNK, False, 0.007874015718698502)   # INV_INT8_MAX
    for c in range(0, n_cols, CHUNK):
        ok = c + cols < n_cols
        y = tl.load(X + c + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        v = _div_rn(tl.abs(y), s, r)                # RN(|y| / s): kernels/row_quant.py
        v = tl.minimum((v + 12582912.0) - 12582912.0, 127.0)   # round half to even, then the clamp
        q = tl.where(y < 0, -v, v)
        tl.store(Q + c + cols, q.to(tl.int8), mask=ok)
    tl.store(S + row, s)


_quant_int8 = lazy_jit(_quant_int8_kernel, helpers=ROW_QUANT_HELPERS)
_CHUNK = 2048


def quant_int8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_int8_rowwise_ref`'s bits; one Triton kernel on CUDA (2-D x with contiguous rows)."""
    ok = x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if not use_triton(x, ok):
        return quant_int8_rowwise_ref(x)
    m, n = x.shape
    q = torch.empty((m, n), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quant_int8[(m,)](x, q, s, n, x.stride(0), q.stride(0), CHUNK=min(_CHUNK, max(16, 1 << (n - 1).bit_length())),
                          num_warps=4)
    return q, s


def int8_mm_ref(q_x: torch.Tensor, q_w: torch.Tensor, scale_x: torch.Tensor, scale_w: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """(q_x @ q_w^T) * scale_x * scale_w: q_x [M, K] / q_w [N, K] int8, scale_x [M, 1], scale_w [1, N] fp32;
    the product in exact int32 arithmetic (on the CPU: CUDA has no int32 matmul), the epilogue on q_x's device."""
    acc = q_x.cpu().int() @ q_w.cpu().int().t()
    return _epilogue(acc.to(q_x.device).to(torch.float32), scale_x, scale_w, out_dtype)


def int8_mm(q_x: torch.Tensor, q_w: torch.Tensor, scale_x: torch.Tensor, scale_w: torch.Tensor,
            out_dtype: torch.dtype, block_rows: int = PRODUCT_BLOCK_ROWS) -> torch.Tensor:
    """`int8_mm_ref`'s result; on CUDA the integer product runs on int8 tensor cores (`torch._int_mm`). Above
    `block_rows` rows the product is made `block_rows` rows at a time into the one output: its int32 buffer is
    then at most block_rows x N x 4 bytes (a 24 GiB stack ran out of memory allocating the 768 MiB gate|up product
    of an n=4 1024² job's 8,192 rows). The same bits: the integer product is exact and the epilogue is per element."""
    m = q_x.shape[0]
    if m <= block_rows:
        return _int8_mm_block(q_x, q_w, scale_x, scale_w, out_dtype)
    out = torch.empty(m, q_w.shape[0], dtype=out_dtype, device=q_x.device)
    for a in range(0, m, block_rows):
        b = min(m, a + block_rows)
        _int8_mm_block(q_x[a:b], q_w, scale_x[a:b], scale_w, out_dtype, out=out[a:b])
    return out


def _int8_mm_block(q_x: torch.Tensor, q_w: torch.Tensor, scale_x: torch.Tensor, scale_w: torch.Tensor,
                   out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """One block's product and epilogue, rounded straight into `out` when given (no block-sized temporary)."""
    if not q_x.is_cuda:
        y = int8_mm_ref(q_x, q_w, scale_x, scale_w, out_dtype)
        return y if out is None else out.copy_(y)
    m = q_x.shape[0]
    a = q_x.contiguous()
    if m < _INT_MM_MIN_ROWS or m % 8:
        a = torch.zeros(max(_PAD_ROWS, (m + 7) // 8 * 8), q_x.shape[1], dtype=torch.int8, device=q_x.device)
        a[:m] = q_x
    acc = torch._int_mm(a, q_w.t())
    return _epilogue(float_in_place(acc[:m]), scale_x, scale_w, out_dtype, out)


def float_in_place(acc: torch.Tensor) -> torch.Tensor:
    """The int32 product as fp32 in its own buffer (each element read and written at one address: a full overlap,
    which torch's copy allows), so the GEMM's output holds 4 bytes an element beside the result, not 8: the gate|up
    product of 8,192 rows is 768 MiB (a 24 GiB fused stack ran out of memory allocating a second one). The same
    values as `.to(torch.float32)`; the start-up check (services/model/quant_int8.py) compares it with the reference."""
    f = acc.view(torch.float32)
    f.copy_(acc)
    return f


def _epilogue(acc: torch.Tensor, scale_x: torch.Tensor, scale_w: torch.Tensor, out_dtype: torch.dtype,
              out: torch.Tensor | None = None):
    """(acc * scale_x) * scale_w on the fp32 product `acc`, in place, rounded once to out_dtype (the output is
    the big tensor of a GEMM: no temporary per product); into `out` when given (copy_ rounds as .to does)."""
    acc.mul_(scale_x).mul_(scale_w)
    return acc.to(out_dtype) if out is None else out.copy_(acc)
