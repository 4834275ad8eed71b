"""Non-causal varlen attention for denoising: image-token queries over [prefix KV ; image KV].

Backends: flash-attn varlen (if importable), torch SDPA per sequence, Triton.
`U1SERVE_DENOISE_BACKEND=auto|flash_attn|sdpa|triton|ref` picks one explicitly.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ._backend import HAS_TRITON, kernel_mode, lazy_jit, tl, use_triton

try:  # optional vendor kernel
    from flash_attn import flash_attn_varlen_func  # type: ignore

    HAS_FLASH_ATTN = True
except Exception:
    flash_attn_varlen_func = None
    HAS_FLASH_ATTN = False

DENOISE_BACKENDS = ("auto", "flash_attn", "sdpa", "triton", "ref")


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError("q must be [Tq, Hq, D]; k/v [Tk, Hkv, D] of one shape")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError("head_dim mismatch or Hq not a multiple of Hkv")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both be [B+1]")


def denoise_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                          scale=None):
    """fp32-math torch reference."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    G = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        qb = q[cq[b]:cq[b + 1]].float()
        kb = k[ck[b]:ck[b + 1]].float().repeat_interleave(G, dim=1)
        vb = v[ck[b]:ck[b + 1]].float().repeat_interleave(G, dim=1)
        p = torch.softmax(torch.einsum("qhd,khd->hqk", qb, kb) * scale, dim=-1)
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", p, vb).to(q.dtype)
    return out


def denoise_attention_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           scale=None):
    """torch SDPA, one call per sequence (GQA through enable_gqa). A single sequence holding every query
    returns SDPA's output as is ([T, H, D]: a view, contiguous where the backend writes q's layout, as
    cuDNN does), saving the copy into a new tensor (a 32 MB memcpy per layer at 2048²)."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    gqa = q.shape[1] != k.shape[1]
    if len(cq) == 2 and cq[0] == 0 and cq[1] == q.shape[0] and q.shape[0]:
        ob = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k[ck[0]:ck[1]].transpose(0, 1).unsqueeze(0),
                                            v[ck[0]:ck[1]].transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=gqa)
        return ob[0].transpose(0, 1)
    out = torch.empty_like(q)
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = v[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        ob = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=gqa)
        out[cq[b]:cq[b + 1]] = ob[0].transpose(0, 1)
    return out


def _denoise_kernel(
    Q, K, V, Out, CuQ, CuK, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_b = tl.program_id(2)
    q_start = tl.load(CuQ + pid_b)
    q_len = tl.load(CuQ + pid_b + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    k_start = tl.load(CuK + pid_b)
    k_len = tl.load(CuK + pid_b + 1) - k_start
    kv_h = pid_h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    rows64 = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows64[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    kbase = K + k_start.to(tl.int64) * stride_kt + kv_h * stride_kh
    vbase = V + k_start.to(tl.int64) * stride_vt + kv_h * stride_vh
    full_end = k_len // BLOCK_N * BLOCK_N
    for start_n in range(0, k_len, BLOCK_N):
        k_idx = start_n + offs_n
        k_ok = k_idx < k_len
        kt = tl.load(kbase + k_idx[None, :] * stride_kt + offs_d[:, None], mask=k_ok[None, :], other=0.0)
        if IEEE:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = qk * qk_scale
        if start_n >= full_end:  # ragged last tile only
            qk = tl.where(k_ok[None, :], qk, -1.0e9)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(vbase + k_idx[:, None] * stride_vt + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(Out + rows64[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


_denoise = lazy_jit(_denoise_kernel)


def default_denoise_config(head_dim, dtype, device):
    if device.type != "cuda":
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    return 128, 64, 8, 3


def denoise_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                             scale=None, config=None, out=None):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    Tq, Hq, D = q.shape
    out = torch.empty_like(q) if out is None else out
    B = cu_seqlens_q.shape[0] - 1
    if Tq == 0 or B == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    BM, BN, nw, ns = config or default_denoise_config(D, q.dtype, q.device)
    grid = (Hq, (max_seqlen_q + BM - 1) // BM, B)
    _denoise[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=Hq // k.shape[1], HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, IEEE=q.dtype == torch.float32,
        num_warps=nw, num_stages=ns,
    )
    return out


def denoise_attention_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None):
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=scale, causal=False)


def _pick_backend(q) -> str:
    forced = os.environ.get("U1SERVE_DENOISE_BACKEND", "auto").strip().lower() or "auto"
    if forced not in DENOISE_BACKENDS:
        raise ValueError(f"U1SERVE_DENOISE_BACKEND must be one of {DENOISE_BACKENDS}")
    mode = kernel_mode()
    if mode == "ref":
        return "ref"
    if mode == "triton":
        use_triton(q)  # raises when triton cannot run here
        return "triton"
    if forced != "auto":
        return forced
    if not q.is_cuda:
        return "ref"
    if HAS_FLASH_ATTN and q.dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    # measured on H200 (docs/benchmarks/kernels.md): SDPA's flash backend wins at 4096+ tokens
    return DEFAULT_CUDA_BACKEND if HAS_TRITON or DEFAULT_CUDA_BACKEND != "triton" else "sdpa"


DEFAULT_CUDA_BACKEND = "sdpa"


def denoise_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      scale=None):
    """Dispatch over flash-attn / SDPA / Triton / reference (see module doc)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = _pick_backend(q)
    if backend == "flash_attn":
        if max_seqlen_q is None or max_seqlen_k is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item())
        return denoise_attention_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       scale)
    if backend == "triton":
        return denoise_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        scale)
    if backend == "sdpa":
        return denoise_attention_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      scale)
    return denoise_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
