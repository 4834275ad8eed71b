"""Skinny GEMM for decode: y = x @ W^T for a few rows of x (M <= 16), bf16 / fp16, W [N, K] row-major.

A decode step with few rows is bound by reading the weights once. cuBLAS's kernels for these shapes reach
~75-85 % of the H200's HBM bandwidth and add split-K reduce launches (measured: docs/benchmarks/kernels.md,
"skinny GEMM"); this kernel streams W in [BLOCK_N, BLOCK_K] tiles with the loads pipelined (`num_stages`),
each program owning BLOCK_N output columns over the whole K (no split-K, no second launch), the x rows
padded to 16 for one tensor-core dot per tile (M = 1 costs the same as M = 16: the weights are the cost).
fp32 accumulation; the sum runs in a different order than cuBLAS's, so results differ by fp32 rounding
before the final cast.

`skinny_linear(x, w)` takes the kernel on CUDA for 2-D contiguous x with M <= 16 rows, K a multiple of the
tile's K (64), and falls back to `torch.nn.functional.linear` otherwise (and on CPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import lazy_jit, tl, use_triton

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
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """M = 1 without the tensor cores: [BLOCK_N, BLOCK_K] products summed along K (tiles as narrow as 4)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


_skinny = lazy_jit(_skinny_kernel)
_gemv = lazy_jit(_gemv_kernel)


def skinny_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [N, K] weight (from the H200 sweep, see the docstring)."""
    block_n = 32 if n >= 8192 else 16
    block_k = 256 if k % 256 == 0 else (128 if k % 128 == 0 else 64)
    return block_n, block_k, 4, 4


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
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The M = 1 CUDA-core kernel with an explicit config (the sweep's entry point)."""
    n, k = w.shape
    block_n, block_k, warps, stages = cfg
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    _gemv[(triton_cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                      num_warps=warps, num_stages=stages)
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T: the skinny kernel where it applies, else torch's linear."""
    if not use_triton(x, skinny_ok(x, w)):
        return F.linear(x, w)
    n, k = w.shape
    cfg = skinny_config(n, k)
    if k % cfg[1]:
        return F.linear(x, w)
    return skinny_linear_launch(x, w, cfg)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
