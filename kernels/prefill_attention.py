"""Hybrid-mask prefill attention over the token-level paged KV pool.

Mask rule (model_spec.md section 4): query row i (absolute position p_i) sees
key j iff j <= p_i, or image_end_i > 0 and j < image_end_i. `image_end=None`
means a text-only batch: plain causal attention.
"""
from __future__ import annotations

import math

import torch

from ._backend import HAS_TRITON, kernel_mode, lazy_jit, tl, triton_cdiv, use_triton

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


def _kv_tile_fn(K, V, rt, Kdesc, Vdesc, start_n, base, kv_h, seq_len,
                stride_ks, stride_kh, stride_vs, stride_vh, offs_n, offs_d,
                MODE: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One key block: (K^T [D, BLOCK_N], V [BLOCK_N, D]). MODE 0: gather each row through the
    page table; 1: the sequence's slots are one run starting at `base` (plain block load);
    2: same, through TMA tensor descriptors. MASKED: keys >= seq_len read as zeros."""
    k_idx = start_n + offs_n
    k_ok = k_idx < seq_len
    if MODE == 2:
        k = Kdesc.load([base + start_n, kv_h * HEAD_DIM])
        v = Vdesc.load([base + start_n, kv_h * HEAD_DIM])
        if MASKED:  # rows past the sequence belong to other requests (or are garbage)
            k = tl.where(k_ok[:, None], k, 0.0)
            v = tl.where(k_ok[:, None], v, 0.0)
        kt = tl.trans(k)
    else:
        if MODE == 1:
            slots = (base + k_idx).to(tl.int64)
        elif MASKED:
            slots = tl.load(rt + k_idx, mask=k_ok, other=0).to(tl.int64)
        else:
            slots = tl.load(rt + k_idx).to(tl.int64)
        if MASKED:
            kt = tl.load(K + slots[None, :] * stride_ks + kv_h * stride_kh + offs_d[:, None],
                         mask=k_ok[None, :], other=0.0)
            v = tl.load(V + slots[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :],
                        mask=k_ok[:, None], other=0.0)
        else:
            kt = tl.load(K + slots[None, :] * stride_ks + kv_h * stride_kh + offs_d[:, None])
            v = tl.load(V + slots[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :])
    return kt, v


def _softmax_step_fn(q, kt, v, m_i, l_i, acc, qk_scale, allowed, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update with one key block (base-2 exponent, log2(e) folded into qk_scale)."""
    if IEEE:
        qk = tl.dot(q, kt, input_precision="ieee")
    else:
        qk = tl.dot(q, kt)
    if MASKED:
        # finite fill: a row fully masked in this tile is wiped by alpha=0 later
        qk = tl.where(allowed, qk * qk_scale, -1.0e9)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


def _attend_fn(acc, l_i, m_i, q, q_pos, img, K, V, rt, Kdesc, Vdesc, base, kv_h, seq_len, full_end, end,
               stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, offs_n, offs_d,
               MODE: tl.constexpr, HAS_IMAGE: tl.constexpr, IEEE: tl.constexpr, WS: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # keys before the block's first row are visible to every row: no mask math at all
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WS):
        kt, v = _kv_tile(K, V, rt, Kdesc, Vdesc, start_n, base, kv_h, seq_len,
                         stride_ks, stride_kh, stride_vs, stride_vh, offs_n, offs_d, MODE, False, HEAD_DIM)
        m_i, l_i, acc = _softmax_step(q, kt, v, m_i, l_i, acc, qk_scale, m_i, False, IEEE)
    # diagonal band (+ image spans): per-element mask
    for start_n in range(full_end, end, BLOCK_N):
        kt, v = _kv_tile(K, V, rt, Kdesc, Vdesc, start_n, base, kv_h, seq_len,
                         stride_ks, stride_kh, stride_vs, stride_vh, offs_n, offs_d, MODE, True, HEAD_DIM)
        k_idx = start_n + offs_n
        allowed = k_idx[None, :] <= q_pos[:, None]
        if HAS_IMAGE:
            allowed = allowed | (k_idx[None, :] < img[:, None])
        allowed = allowed & (k_idx < seq_len)[None, :]
        m_i, l_i, acc = _softmax_step(q, kt, v, m_i, l_i, acc, qk_scale, allowed, True, IEEE)
    return acc, l_i, m_i


def _prefill_kernel(
    Q, K, V, Out, ReqToToken, BStart, BSeqLen, CuQ, ImgEnd, KvBase, Kdesc, Vdesc,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_rb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_IMAGE: tl.constexpr, IEEE: tl.constexpr, KV_MODE: tl.constexpr, WS: tl.constexpr,
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

    full_end = (pos0 + m0) // BLOCK_N * BLOCK_N
    end = tl.minimum(pos0 + m0 + BLOCK_M, seq_len)
    img = q_pos  # unused when text-only
    if HAS_IMAGE:
        img = tl.load(ImgEnd + q_start + offs_m, mask=row_ok, other=0)
        end = tl.maximum(end, tl.minimum(tl.max(img, 0), seq_len))
    if KV_MODE == 0:
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, img, K, V, rt, Kdesc, Vdesc, 0, kv_h, seq_len,
                                full_end, end, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                offs_n, offs_d, 0, HAS_IMAGE, IEEE, WS, BLOCK_N, HEAD_DIM)
    else:
        base = tl.load(KvBase + pid_b)  # first slot when the sequence's slots are one run, else -1
        if base >= 0:
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, img, K, V, rt, Kdesc, Vdesc, base, kv_h, seq_len,
                                    full_end, end, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                    offs_n, offs_d, KV_MODE, HAS_IMAGE, IEEE, WS, BLOCK_N, HEAD_DIM)
        else:
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, img, K, V, rt, Kdesc, Vdesc, 0, kv_h, seq_len,
                                    full_end, end, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
                                    offs_n, offs_d, 0, HAS_IMAGE, IEEE, WS, BLOCK_N, HEAD_DIM)

    acc = acc / l_i[:, None]
    tl.store(Out + rows64[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


def _kv_base_kernel(ReqToToken, BSeqLen, KvBase, stride_rb, BLOCK: tl.constexpr):
    """KvBase[b] = req_to_token[b, 0] if req_to_token[b, :seq_len] is base + 0, 1, 2, ... else -1."""
    b = tl.program_id(0)
    L = tl.load(BSeqLen + b)
    rt = ReqToToken + b.to(tl.int64) * stride_rb
    base = tl.load(rt)
    offs = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(0, L, BLOCK):
        idx = s + offs
        ok = idx < L
        sl = tl.load(rt + idx, mask=ok, other=0)
        bad += ((sl != base + idx) & ok).to(tl.int32)
    tl.store(KvBase + b, tl.where(tl.sum(bad, 0) == 0, base, -1))


_prefill = lazy_jit(_prefill_kernel, helpers={"_kv_tile": _kv_tile_fn, "_softmax_step": _softmax_step_fn,
                                              "_attend": _attend_fn})
_kv_base = lazy_jit(_kv_base_kernel)


def kv_base(req_to_token, b_seq_len):
    """[B] int32 on the device: first pool slot of each sequence whose slots are contiguous, else -1.
    One tiny launch, no host sync."""
    B = b_seq_len.shape[0]
    out = torch.empty(B, dtype=torch.int32, device=b_seq_len.device)
    if B:
        _kv_base[(B,)](req_to_token, b_seq_len, out, req_to_token.stride(0), BLOCK=1024 if out.is_cuda else 64)
    return out


# (BLOCK_M, BLOCK_N, num_warps, num_stages, kv_mode, warp_specialize)
# kv_mode: 0 gather every key row through req_to_token; 1 contiguous sequences as plain block
# loads (per-sequence check, gather otherwise); 2 contiguous sequences through TMA descriptors.
def default_prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages[, kv_mode, warp_specialize]), tuned on H200
    (docs/benchmarks/kernels.md)."""
    if device.type != "cuda":
        return 16, 16, 4, 1, 1, False  # interpreter: small tiles keep CPU tests fast and cross block edges
    if dtype == torch.float32:
        return 64, 32, 4, 2, 1, False
    if head_dim <= 64:
        return 128, 64, 4, 3, 1, False  # kv_mode 1 checked on H200 (D16, D64); tiles not re-tuned
    if head_dim > 128:
        return 64, 32, 4, 2, 1, False  # D256: keeps shared memory small; not measured
    return PREFILL_D128_CONFIG


# best of 9 configs on two seed rows, H200 2026-11-29 (docs/benchmarks/kernels.md)
PREFILL_D128_CONFIG = (128, 128, 8, 3, 2, False)


def _tma_ok(k_pool, v_pool, D, BN):
    S, Hkv, _ = k_pool.shape
    for t in (k_pool, v_pool):
        if t.stride(1) != D or t.stride(2) != 1 or (t.stride(0) * t.element_size()) % 16 \
                or t.data_ptr() % 16 or not t.is_cuda:
            return False
    return D * k_pool.element_size() >= 16


def prefill_attention_triton(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                             image_end, scale, max_seqlen_q=None, config=None, out=None, kv_base_=None):
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
    cfg = tuple(config or default_prefill_config(D, q.dtype, q.device))
    BM, BN, nw, ns = cfg[:4]
    mode = cfg[4] if len(cfg) > 4 else 0
    ws = bool(cfg[5]) if len(cfg) > 5 else False
    kdesc, vdesc = k_pool, v_pool  # dummies unless TMA
    if mode == 2:
        if _tma_ok(k_pool, v_pool, D, BN):
            from triton.tools.tensor_descriptor import TensorDescriptor
            S, Hkv, _ = k_pool.shape
            kdesc = TensorDescriptor(k_pool, [S, Hkv * D], [k_pool.stride(0), 1], [BN, D])
            vdesc = TensorDescriptor(v_pool, [S, Hkv * D], [v_pool.stride(0), 1], [BN, D])
        else:
            mode = 1
    base = cu_seqlens_q  # dummy pointer in gather-only mode
    if mode:
        base = kv_base_ if kv_base_ is not None else kv_base(req_to_token, b_seq_len)
    grid = (Hq, triton_cdiv(max_seqlen_q, BM), B)
    img = image_end if image_end is not None else cu_seqlens_q  # dummy pointer when text-only
    _prefill[grid](
        q, k_pool, v_pool, out, req_to_token, b_start, b_seq_len, cu_seqlens_q, img, base, kdesc, vdesc,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=Hq // k_pool.shape[1], HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN,
        HAS_IMAGE=image_end is not None, IEEE=q.dtype == torch.float32, KV_MODE=mode, WS=ws,
        num_warps=nw, num_stages=ns,
    )
    return out


def _kv_base_torch(req_to_token, b_seq_len):
    B, W = req_to_token.shape[0], req_to_token.shape[1]
    ar = torch.arange(W, device=req_to_token.device)
    r = req_to_token[:len(b_seq_len)].long()
    ok = ((r == r[:, :1] + ar) | (ar[None, :] >= b_seq_len[:, None].long())).all(1)
    return torch.where(ok, r[:, 0], -1).int()


def host_meta(req_to_token, b_start, b_seq_len, cu_seqlens_q):
    """(starts, lens, cu, kv_bases) as host lists: one device->host sync."""
    B = b_seq_len.shape[0]
    kvb = kv_base(req_to_token, b_seq_len) if (b_seq_len.is_cuda and HAS_TRITON) else \
        _kv_base_torch(req_to_token, b_seq_len)
    meta = torch.cat([b_start.int(), b_seq_len.int(), cu_seqlens_q.int(), kvb.int()]).tolist()
    return meta[:B], meta[B:2 * B], meta[2 * B:3 * B + 1], meta[3 * B + 1:]


def prefill_attention_text_sdpa(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q, scale,
                                out=None, meta=None):
    """Text-only batch through torch SDPA causal (cuDNN / flash), one call per sequence on views of the
    pool, or None when the batch does not qualify: every sequence must have no cached prefix and its
    pool slots must be one contiguous run. Reads the metadata on the host (one sync) unless `meta`
    (from `host_meta`) is given."""
    B = b_seq_len.shape[0]
    if q.dtype not in (torch.float16, torch.bfloat16) or B == 0:
        return None
    starts, lens, cu, bases = meta or host_meta(req_to_token, b_start, b_seq_len, cu_seqlens_q)
    if any(starts) or min(bases) < 0 or any(lens[b] != cu[b + 1] - cu[b] for b in range(B)):
        return None
    import torch.nn.functional as F
    if out is None:
        out = torch.empty_like(q)
    gqa = q.shape[1] != k_pool.shape[1]
    for b in range(B):
        L = lens[b]
        if L == 0:
            continue
        qb = q[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k_pool[bases[b]:bases[b] + L].transpose(0, 1).unsqueeze(0)
        vb = v_pool[bases[b]:bases[b] + L].transpose(0, 1).unsqueeze(0)
        with _sdpa_priority():
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        out[cu[b]:cu[b + 1]].copy_(o[0].transpose(0, 1))
    return out


def _sdpa_priority():
    """Prefer cuDNN, then flash (measured fastest on H200), where torch lets us order backends."""
    import contextlib
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        return sdpa_kernel(order, set_priority=True)
    except Exception:  # older torch: its own choice
        return contextlib.nullcontext()


# Text-only batches with contiguous KV and no cached prefix go to SDPA when the caller lets the
# dispatch read metadata on the host (max_seqlen_q not given) and the longest sequence has at least
# TEXT_ONLY_SDPA_MIN_LEN tokens. H200 (docs/benchmarks/kernels.md): the SDPA path, sync included,
# lost to the Triton kernel at max_seq_len 4096 (1.46x / 1.06x / 1.01x) and won from 8192 (0.92-0.94x)
# to 65536 (0.83x).
TEXT_ONLY_SDPA = True
TEXT_ONLY_SDPA_MIN_LEN = 6144


def prefill_attention(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                      image_end, scale=None, max_seqlen_q=None):
    """Dispatch: Triton on CUDA, torch reference on CPU (U1SERVE_KERNELS overrides).

    `max_seqlen_q` (optional) avoids a device->host sync for the grid size. Without it, a text-only
    batch (image_end=None) whose sequences have no cached prefix and contiguous pool slots runs
    torch SDPA causal instead (see docs/kernels.md).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    ok = q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if (TEXT_ONLY_SDPA and image_end is None and max_seqlen_q is None and q.is_cuda
            and kernel_mode() == "auto" and b_seq_len.shape[0] > 0):
        meta = host_meta(req_to_token, b_start, b_seq_len, cu_seqlens_q)  # the one sync we'd pay anyway
        cu = meta[2]
        max_seqlen_q = max(cu[b + 1] - cu[b] for b in range(len(cu) - 1))
        if max_seqlen_q >= TEXT_ONLY_SDPA_MIN_LEN:
            out = prefill_attention_text_sdpa(q, k_pool, v_pool, req_to_token, b_start, b_seq_len,
                                              cu_seqlens_q, scale, meta=meta)
            if out is not None:
                return out
    if use_triton(q, ok):
        return prefill_attention_triton(q, k_pool, v_pool, req_to_token, b_start, b_seq_len,
                                        cu_seqlens_q, image_end, scale, max_seqlen_q=max_seqlen_q)
    return prefill_attention_ref(q, k_pool, v_pool, req_to_token, b_start, b_seq_len, cu_seqlens_q,
                                 image_end, scale)
