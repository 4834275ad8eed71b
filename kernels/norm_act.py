"""RMSNorm and the SwiGLU gate (silu(gate) * up): elementwise hot paths of every decoder layer.

Both round exactly where torch does (Qwen3RMSNorm: normalise in fp32, cast to the input dtype, then
multiply by the weight in that dtype; silu in fp32 rounded to the dtype, then the product rounded),
so the Triton kernels give the same bits as the references; one kernel launch instead of ~6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import lazy_jit, next_pow2, tl, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rms_norm_kernel(X, W, Y, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    h = (x * inv).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (h * w).to(Y.dtype.element_ty), mask=ok)


def _silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (s * u).to(Y.dtype.element_ty), mask=ok)


_rms = lazy_jit(_rms_norm_kernel)
_silu = lazy_jit(_silu_mul_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    n = x.shape[-1]
    ok = x.is_contiguous() and weight.dtype == x.dtype and n <= 16384
    if not use_triton(x, ok):
        return rms_norm_ref(x, weight, eps)
    x2 = x.view(-1, n)
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms[(x2.shape[0],)](x2, weight, y, n, x2.stride(0), y.stride(0), eps, BLOCK=next_pow2(n),
                             num_warps=4 if n <= 2048 else 8)
    return y.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    ok = gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape and gate.dtype == up.dtype
    if not use_triton(gate, ok):
        return silu_mul_ref(gate, up)
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = 2048
        _silu[(triton_cdiv(n, block),)](gate, up, y, n, BLOCK=block, num_warps=4)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
