"""Hybrid-mask prefill attention over the token-level paged KV pool.

Mask rule (model_spec.md section 4): query row i (absolute position p_i) sees
key j iff j <= p_i, or image_end_i > 0 and j < image_end_i. `image_end=None`
means a text-only batch: plain causal attention.
"""
from __future__ import annotations

import math

import torch

from ._backend import lazy_jit, tl, use_triton

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def _check(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q, image_end):
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError("q must be [Tq, Hq, D]; k_pool/v_pool [S, Hkv, D] of one shape")
    if q.shape[2] != k_pool.shape[2] or q.shape[1] % k_pool.shape[1]:
        raise ValueError("head_dim mismatch or Hq not a multiple of Hkv")
    B = b_seq_len.shape[0]
    if cu_seqlens_q.shape[0] != B + 1 or b_start.shape[0] != B or req_to_token.shape[0] < B:
        raise ValueError("cu_seqlens_q must be [B+1], b_start/b_seq_len [B], req_to_token [>=B, max_len]")
    if image_end is not None and image_end.shape[0] != q.shape[0]:
        raise ValueError("image_end must be [Tq] (one int per query row)")


def prefill_attention_ref(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                          image_end, scale, **_unused):
    """Plain torch (fp32 math) reference; CPU or CUDA."""
    _check(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q, image_end)
    Tq, Hq, D = q.shape
    G = Hq // k_pool.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    starts = b_start.tolist()
    lens = b_seq_len.tolist()
    for b in range(len(lens)):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        L = lens[b]
        slots = req_to_token[b, :L].long()
        k = k_pool[slots].float().repeat_interleave(G, dim=1)  # [L, Hq, D]
        v = v_pool[slots].float().repeat_interleave(G, dim=1)
        qb = q[q0:q1].float()
        qpos = torch.arange(q1 - q0, device=q.device) + starts[b]
        kpos = torch.arange(L, device=q.device)
        allowed = kpos[None, :] <= qpos[:, None]
        if image_end is not None:
            allowed |= kpos[None, :] < image_end[q0:q1, None].long()
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        s = s.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


def _prefill_kernel(
    Q, K, V, Out, ReqToToken, BStart, BSeqLen, CuQ, ImgEnd,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_rb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_IMAGE: tl.constexpr, IEEE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    # longest (last) query blocks first: they have the most keys to visit
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    pid_b = tl.program_id(2)
    q_start = tl.load(CuQ + pid_b)
    q_len = tl.load(CuQ + pid_b + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    pos0 = tl.load(BStart + pid_b)          # absolute position of query row 0
    seq_len = tl.load(BSeqLen + pid_b)
    kv_h = pid_h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    rows64 = (q_start + offs_m).to(tl.int64)  # packed offsets can pass 2^31 elements
    q = tl.load(Q + rows64[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = pos0 + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    rt = ReqToToken + pid_b.to(tl.int64) * stride_rb

    # keys before the block's first row are visible to every row: no mask
    full_end = (pos0 + m0) // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        slots = tl.load(rt + start_n + offs_n).to(tl.int64)
        kt = tl.load(K + slots[None, :] * stride_ks + kv_h * stride_kh + offs_d[:, None])
        if IEEE:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :])
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # diagonal band (+ image spans): per-element mask
    end = tl.minimum(pos0 + m0 + BLOCK_M, seq_len)
    if HAS_IMAGE:
        img = tl.load(ImgEnd + q_start + offs_m, mask=row_ok, other=0)
        end = tl.maximum(end, tl.minimum(tl.max(img, 0), seq_len))
    for start_n in range(full_end, end, BLOCK_N):
        k_idx = start_n + offs_n
        k_ok = k_idx < seq_len
        slots = tl.load(rt + k_idx, mask=k_ok, other=0).to(tl.int64)
        kt = tl.load(K + slots[None, :] * stride_ks + kv_h * stride_kh + offs_d[:, None],
                     mask=k_ok[None, :], other=0.0)
        if IEEE:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        allowed = k_idx[None, :] <= q_pos[:, None]
        if HAS_IMAGE:
            allowed = allowed | (k_idx[None, :] < img[:, None])
        allowed = allowed & k_ok[None, :]
        # finite fill: a row fully masked in this tile is wiped by alpha=0 later
        qk = tl.where(allowed, qk * qk_scale, -1.0e9)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :],
                    mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / l_i[:, None]
    tl.store(Out + rows64[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


_prefill = lazy_jit(_prefill_kernel)


def default_prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), tuned on H200 (docs/benchmarks/kernels.md)."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # interpreter: small tiles keep CPU tests fast and cross block edges
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 32, 4, 4  # best of 10 configs on two seed rows (docs/benchmarks/kernels.md)


def prefill_attention_triton(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                             image_end, scale, max_seqlen_q=None, config=None, out=None):
    _check(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q, image_end)
    Tq, Hq, D = q.shape
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("last dim of q/k_pool/v_pool must be contiguous")
    B = b_seq_len.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if Tq == 0 or B == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    BM, BN, nw, ns = config or default_prefill_config(D, q.dtype, q.device)
    grid = (Hq, triton_cdiv(max_seqlen_q, BM), B)
    img = image_end if image_end is not None else cu_seqlens_q  # dummy pointer when text-only
    _prefill[grid](
        q, k_pool, v_pool, out, req_to_token, b_start, b_seq_len, cu_seqlens_q, img,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=Hq // k_pool.shape[1], HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN,
        HAS_IMAGE=image_end is not None, IEEE=q.dtype == torch.float32,
        num_warps=nw, num_stages=ns,
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def prefill_attention(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                      image_end, scale=None, max_seqlen_q=None):
    """Dispatch: Triton on CUDA, torch reference on CPU (U1SERVE_KERNELS overrides).

    `max_seqlen_q` (optional) avoids a device->host sync for the grid size.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    ok = q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if use_triton(q, ok):
        return prefill_attention_triton(q, k_pool, v_pool, req_to_token, b_start, b_seq_len,
                                        cu_seqlens_q, image_end, scale, max_seqlen_q=max_seqlen_q)
    return prefill_attention_ref(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                                 image_end, scale)
