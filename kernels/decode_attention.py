"""Decode attention: one new query token per sequence over the paged KV pool (split-K).

Stage 1: grid (B, Hkv, splits); each program takes all GROUP = Hq/Hkv query heads of one
KV head (K/V read once per group) over one slice of the sequence and writes a partial
output plus its log-sum-exp. Stage 2 merges the slices. The split count depends only on
shapes known on the host (no device sync), so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import math

import torch

from ._backend import lazy_jit, next_pow2, num_sms, tl, use_triton


def _check(q, k_pool, v_pool, req_to_token, b_seq_len):
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError("q must be [B, Hq, D]; k_pool/v_pool [S, Hkv, D] of one shape")
    if q.shape[2] != k_pool.shape[2] or q.shape[1] % k_pool.shape[1]:
        raise ValueError("head_dim mismatch or Hq not a multiple of Hkv")
    if b_seq_len.shape[0] != q.shape[0] or req_to_token.shape[0] < q.shape[0]:
        raise ValueError("b_seq_len must be [B] and req_to_token [>=B, max_len]")


def decode_attention_ref(q, k_pool, v_pool, req_to_token, b_seq_len, scale=None, **_unused):
    _check(q, k_pool, v_pool, req_to_token, b_seq_len)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    B, Hq, D = q.shape
    G = Hq // k_pool.shape[1]
    out = torch.empty_like(q)
    for b, L in enumerate(b_seq_len.tolist()):
        slots = req_to_token[b, :L].long()
        k = k_pool[slots].float().repeat_interleave(G, dim=1)  # [L, Hq, D]
        v = v_pool[slots].float().repeat_interleave(G, dim=1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hk,khd->hd", p, v).to(q.dtype)
    return out


def _decode_stage1(
    Q, K, V, ReqToToken, BSeqLen, PartO, PartLse, qk_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_b = tl.program_id(0)
    kv_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    n_split = tl.num_programs(2)
    seq_len = tl.load(BSeqLen + pid_b)
    chunk = tl.cdiv(tl.cdiv(seq_len, n_split), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < GROUP
    heads = kv_h * GROUP + offs_g
    q = tl.load(Q + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    rt = ReqToToken + pid_b.to(tl.int64) * stride_rb
    for start_n in range(lo, hi, BLOCK_N):
        k_idx = start_n + offs_n
        k_ok = k_idx < hi
        slots = tl.load(rt + k_idx, mask=k_ok, other=0).to(tl.int64)
        kt = tl.load(K + slots[None, :] * stride_ks + kv_h * stride_kh + offs_d[:, None], mask=k_ok[None, :],
                     other=0.0)
        if IEEE:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = tl.where(k_ok[None, :], qk * qk_scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :], mask=k_ok[:, None],
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = hi <= lo
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.maximum(l_i, 1e-30)))
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(PartO + pid_b * stride_pb + heads[:, None] * stride_ph + pid_s * stride_ps + offs_d[None, :], o,
             mask=g_ok[:, None])
    tl.store(PartLse + pid_b * stride_lb + heads * stride_lh + pid_s, lse, mask=g_ok)


def _decode_stage2(
    PartO, PartLse, Out, n_split,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < n_split
    lse = tl.load(PartLse + pid_b * stride_lb + pid_h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - m)
    w = tl.where(s_ok, w, 0.0)
    o = tl.load(PartO + pid_b * stride_pb + pid_h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + pid_b * stride_ob + pid_h * stride_oh + offs_d, res.to(Out.dtype.element_ty))


_stage1 = lazy_jit(_decode_stage1)
_stage2 = lazy_jit(_decode_stage2)


def default_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device,
                       block_n: int = 64) -> int:
    """Enough programs to fill the GPU twice over, no split shorter than one key tile."""
    want = -(-2 * num_sms(device) // max(1, batch * num_kv_heads))
    return max(1, min(want, -(-max_len // block_n), 64))


def decode_attention_triton(q, k_pool, v_pool, req_to_token, b_seq_len, scale=None, num_splits=None,
                            block_n=None, num_warps=4, num_stages=3, out=None):
    _check(q, k_pool, v_pool, req_to_token, b_seq_len)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    B, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    BN = block_n or (16 if not q.is_cuda else 64)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, req_to_token.shape[1], q.device, BN)
    part_o = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    _stage1[(B, Hkv, num_splits)](
        q, k_pool, v_pool, req_to_token, b_seq_len, part_o, part_lse, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=G, BLOCK_G=max(16, next_pow2(G)), HEAD_DIM=D, BLOCK_N=BN, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    _stage2[(B, Hq)](
        part_o, part_lse, out, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=max(2, next_pow2(num_splits)), HEAD_DIM=D, num_warps=4,
    )
    return out


def decode_attention(q, k_pool, v_pool, req_to_token, b_seq_len, scale=None, num_splits=None):
    """Dispatch: Triton on CUDA, torch reference on CPU (U1SERVE_KERNELS overrides)."""
    ok = q.shape[-1] in (16, 32, 64, 128, 256) and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if use_triton(q, ok):
        return decode_attention_triton(q, k_pool, v_pool, req_to_token, b_seq_len, scale, num_splits)
    return decode_attention_ref(q, k_pool, v_pool, req_to_token, b_seq_len, scale)
