"""Batched multi-LoRA: one low-rank pass for a batch whose rows use different adapters (or none).

    y[i] += (x[i] @ A[s_i]^T) @ B[s_i]^T     for every row i with slot s_i >= 0 (s_i = -1: the base weight only)

A [S, R, K] and B [S, N, R] hold every resident adapter of one linear layer, stacked by slot (an adapter of
rank r < R is zero-padded; its scale is folded into B when it is loaded), slots [T] int32 names each row's.
Two launches (SGMV-style shrink then expand): shrink writes h = x A^T [T, R] in fp32, expand adds h B^T into
y in place. Each program takes a block of rows (and, expanding, of columns) and runs one low-rank product per
slot its rows use, skipping the others after a comparison, so the work is the rows' own and no host sync or
sort is needed: rows of one request are contiguous in the engines' packed batches, so a block is usually one
slot (the grid does not grow with the number of resident adapters).

The torch reference (CPU, and `U1SERVE_KERNELS=ref`) runs one GEMM pair per slot present, over its rows; the
engines give it the (slot, rows) groups once per forward (host lists, no sync per layer).
"""
from __future__ import annotations

import torch

from ._backend import lazy_jit, next_pow2, tl, triton_cdiv, use_triton

MIN_RANK = 16   # tl.dot needs >= 16 on every side: ranks are padded up to this (zeros add nothing)


def padded_rank(rank: int) -> int:
    """The stacked rank a slot table for adapters up to `rank` uses (a power of two, at least MIN_RANK)."""
    return max(MIN_RANK, next_pow2(rank))


def slot_groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, row indices) of every slot >= 0 in `slots` (a host tensor): what lora_apply_ref needs."""
    s = slots.cpu()
    return [(int(v), (s == v).nonzero().flatten()) for v in torch.unique(s).tolist() if v >= 0]


def lora_apply_ref_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """In place on y [T, N]: per (slot, rows) group, y[rows] += (x[rows] A[slot]^T) B[slot]^T in fp32."""
    for s, rows in groups:
        rows = rows.to(y.device)
        h = x.index_select(0, rows).float() @ a[s].float().t()
        y.index_add_(0, rows, (h @ b[s].float().t()).to(y.dtype))
    return y


def _shrink_kernel(X, A, H, SLOTS, T, K, S, stride_x, stride_as, stride_ar, R: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    sl = tl.load(SLOTS + rows, mask=rows < T, other=-1)
    rr = tl.arange(0, R)
    for s in range(0, S):                 # the slots this block's rows use (mostly one): the others are skipped
        hit = sl == s
        if tl.sum(hit.to(tl.int32), axis=0) > 0:
            acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                xb = tl.load(X + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                             mask=hit[:, None] & (kk[None, :] < K), other=0.0)
                ab = tl.load(A + s * stride_as + rr[None, :] * stride_ar + kk[:, None], mask=kk[:, None] < K,
                             other=0.0)
                acc += tl.dot(xb, ab, input_precision=PRECISION)
            tl.store(H + rows[:, None].to(tl.int64) * R + rr[None, :], acc, mask=hit[:, None])


def _expand_kernel(H, B, Y, SLOTS, T, N, S, stride_y, stride_bs, stride_bn, R: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    sl = tl.load(SLOTS + rows, mask=rows < T, other=-1)
    rr = tl.arange(0, R)
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    for s in range(0, S):
        hit = sl == s
        if tl.sum(hit.to(tl.int32), axis=0) > 0:
            hb = tl.load(H + rows[:, None].to(tl.int64) * R + rr[None, :], mask=hit[:, None], other=0.0)
            bb = tl.load(B + s * stride_bs + nn[None, :] * stride_bn + rr[:, None], mask=nn[None, :] < N,
                         other=0.0)
            d = tl.dot(hb.to(bb.dtype), bb, input_precision=PRECISION)
            m = hit[:, None] & (nn[None, :] < N)
            ptr = Y + rows[:, None].to(tl.int64) * stride_y + nn[None, :]
            yv = tl.load(ptr, mask=m, other=0.0)
            tl.store(ptr, (yv.to(tl.float32) + d).to(yv.dtype), mask=m)


_shrink = lazy_jit(_shrink_kernel)
_expand = lazy_jit(_expand_kernel)


def lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                groups: list[tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    """y [T, N] += per row its adapter's low-rank product (module doc), in place; returns y.
    x [T, K]; a [S, R, K], b [S, N, R] contiguous; slots [T] int32 on y's device (-1 = none);
    `groups`: slot_groups(slots) for the torch path (computed here when None)."""
    T = x.shape[0]
    if T == 0:
        return y
    R = a.shape[1]
    ok = (R >= MIN_RANK and R == next_pow2(R) and x.stride(-1) == 1 and y.stride(-1) == 1
          and a.is_contiguous() and b.is_contiguous())
    if not use_triton(y, ok):
        return lora_apply_ref_(y, x, a, b, groups if groups is not None else slot_groups(slots))
    S, K, N = a.shape[0], a.shape[2], b.shape[1]
    h = torch.empty((T, R), device=x.device, dtype=torch.float32)
    bm = 16 if T <= 16 else 64
    # fp32 weights: full-precision dots (as torch's fp32 matmul by default), not tf32's 10-bit inputs
    prec = "ieee" if a.dtype == torch.float32 else "tf32"
    _shrink[(triton_cdiv(T, bm),)](x, a, h, slots, T, K, S, x.stride(0), a.stride(0), a.stride(1), R=R,
                                    BLOCK_M=bm, BLOCK_K=64, PRECISION=prec)
    bn = 128
    _expand[(triton_cdiv(T, bm), triton_cdiv(N, bn))](h, b, y, slots, T, N, S, y.stride(0), b.stride(0),
                                                       b.stride(1), R=R, BLOCK_M=bm, BLOCK_N=bn, PRECISION=prec)
    return y
