"""Skinny GEMM for decode: y = x @ W^T for a few rows of x (M <= 16), bf16 / fp16, W [N, K] row-major.

A decode step with few rows is bound by reading the weights once. cuBLAS's kernels for these shapes reach
~75-85 % of the H200's HBM bandwidth and add split-K reduce launches (measured: docs/benchmarks/kernels.md,
"skinny GEMM"); this kernel streams W in [BLOCK_N, BLOCK_K] tiles with the loads pipelined (`num_stages`),
each program owning BLOCK_N output columns over the whole K (no split-K, no second launch), the x rows
padded to 16 for one tensor-core dot per tile (M = 1 costs the same as M = 16: the weights are the cost).
fp32 accumulation; the sum runs in a different order than cuBLAS's, so results differ by fp32 rounding
before the final cast.

One row can also take `_gemv_kernel` (CUDA cores, tiles as narrow as 4 columns: more programs stream a narrow
weight). `skinny_linear(x, w)` picks by shape (`skinny_config`, from the H200 sweep) and falls back to
`torch.nn.functional.linear` where cuBLAS is as fast, for other shapes, and on CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import lazy_jit, tl, triton_cdiv, use_triton
from .norm_act import _silu_mul_value_fn

MAX_ROWS = 16


def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr = False):
    """M = 1 without the tensor cores: [BLOCK_N, BLOCK_K] products summed along K (tiles as narrow as 4).
    GATED: x is the [1, 2K] gate|up row and the GEMM's input is silu(gate) * up, computed at the load with
    `silu_mul`'s rounding (so the bits of silu_mul then this kernel, without that launch)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _k in range(0, K, BLOCK_K):
        if GATED:
            x = _silu_mul_value(tl.load(x_ptrs).to(tl.float32), tl.load(x_ptrs + K).to(tl.float32),
                                x_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptrs).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


_skinny = lazy_jit(_skinny_kernel)
_gemv = lazy_jit(_gemv_kernel, helpers={"_silu_mul_value": _silu_mul_value_fn})


def skinny_config(m: int, n: int, k: int) -> tuple[str, tuple[int, int, int, int]] | None:
    """(kernel, (BLOCK_N, BLOCK_K, num_warps, num_stages)) for x [m, k] @ w[n, k]^T, or None where cuBLAS is as
    fast. From the H200 sweep (2026-12-02, `python -m bench.bench_decode_kernels --parts skinny`: one graph replay over
    rotated weights, docs/benchmarks/kernels.md): for one row the CUDA-core kernel with 4-column tiles wins on every weight narrower than 8192
    rows (1.1-2x: k/v, o, q, down), the tensor-core kernel on wide ones (gate/up 1.09x, lm_head 1.13x); for
    2-16 rows only the wide weights gain (1.05-1.07x), cuBLAS keeps the rest."""
    if n >= 8192:
        return ("dot", (64, 256, 4, 3)) if n >= 65536 else ("dot", (32, 128, 4, 4))
    if m > 1:
        return None
    if n * k <= (8 << 20):
        return "gemv", (4, 1024, 8, 3)
    return "gemv", (4, 512, 4, 4 if k <= 4096 else 2)


def skinny_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.is_contiguous() and w.is_contiguous()
            and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] == w.shape[1]
            and w.shape[1] % 64 == 0)


def skinny_linear_launch(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int],
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor-core kernel with an explicit config (the sweep's entry point)."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, warps, stages = cfg
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    _skinny[(triton_cdiv(n, block_n),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                        num_warps=warps, num_stages=stages)
    return y


def gemv_launch(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int],
                out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The M = 1 CUDA-core kernel with an explicit config (the sweep's entry point). `gated`: x is [1, 2K]
    gate|up and the input silu(gate) * up (`_gemv_kernel`)."""
    n, k = w.shape
    block_n, block_k, warps, stages = cfg
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    _gemv[(triton_cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
                                      num_warps=warps, num_stages=stages)
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T: the skinny kernels where they beat cuBLAS, else torch's linear."""
    if not use_triton(x, skinny_ok(x, w)):
        return F.linear(x, w)
    choice = skinny_config(x.shape[0], w.shape[0], w.shape[1])
    if choice is None or w.shape[1] % choice[1][1]:
        return F.linear(x, w)
    kind, cfg = choice
    return (gemv_launch if kind == "gemv" else skinny_linear_launch)(x, w, cfg)


def gated_linear(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up @ w^T for one row gate_up [1, 2K] (a fused gate|up output) in one launch, the bits of
    `silu_mul` then `skinny_linear`; None where that is not the one-row kernel (the caller runs the two)."""
    k = w.shape[1] if w.dim() == 2 else 0
    if not (gate_up.dim() == 2 and gate_up.shape[0] == 1 and gate_up.shape[1] == 2 * k and gate_up.is_contiguous()
            and use_triton(gate_up, skinny_ok(gate_up[:, :k], w))):
        return None
    choice = skinny_config(1, w.shape[0], k)
    if choice is None or choice[0] != "gemv" or k % choice[1][1]:
        return None
    return gemv_launch(gate_up, w, choice[1], gated=True)
