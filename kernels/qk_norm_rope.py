"""Fused split Q/K RMSNorm + 3-D RoPE (t/h/w), in place (model_spec.md section 3.1).

Per head of size D: dims [0, D/2) are the t-part, [D/2, D) the hw-part. Each part is
RMS-normalised with its own weight (Qwen3RMSNorm: fp32 normalise, cast to the input dtype,
then multiply by the weight in that dtype). Then HF rotate_half RoPE: the t-part with rotary
dim D/2 (base theta_t, position t); the hw-part's first half (h) and second half (w) each
with rotary dim D/4 (base theta_hw, positions h and w).
"""
from __future__ import annotations

import torch

from ._backend import lazy_jit, next_pow2, tl, use_triton


def inv_freq(theta: float, rot_dim: int, device) -> torch.Tensor:
    """HF default rope: 1 / theta^(arange(0, d, 2) / d), fp32."""
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device=device).float() / rot_dim))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_ref(x, pos, theta, rot_dim):
    """x [T, H, rot_dim]; pos [T] int. cos/sin in fp32, applied in x's dtype (HF)."""
    freqs = pos.float()[:, None] * inv_freq(theta, rot_dim, x.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    return x * cos + _rotate_half(x) * sin


def _rms_ref(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _one_ref(x, w_t, w_hw, positions, theta_t, theta_hw, eps):
    D = x.shape[-1]
    half, quarter = D // 2, D // 4
    xt = _rms_ref(x[..., :half], w_t, eps)
    xhw = _rms_ref(x[..., half:], w_hw, eps)
    xt = _rope_ref(xt, positions[0], theta_t, half)
    xh = _rope_ref(xhw[..., :quarter], positions[1], theta_hw, quarter)
    xw = _rope_ref(xhw[..., quarter:], positions[2], theta_hw, quarter)
    return torch.cat((xt, xh, xw), dim=-1)


def _check(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions):
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError("q must be [T, Hq, D] and k [T, Hkv, D]")
    D = q.shape[2]
    if D % 8:
        raise ValueError("head_dim must be a multiple of 8")
    for w in (q_w_t, q_w_hw, k_w_t, k_w_hw):
        if w.shape != (D // 2,):
            raise ValueError("norm weights must be [D/2]")
    if positions.shape != (3, q.shape[0]):
        raise ValueError("positions must be [3, T] (t, h, w)")


def qk_norm_rope_ref_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps):
    """Reference, in place; returns (q, k)."""
    _check(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions)
    q.copy_(_one_ref(q, q_w_t, q_w_hw, positions, theta_t, theta_hw, eps))
    k.copy_(_one_ref(k, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps))
    return q, k


def _norm_rope_kernel(
    Q, K, QWt, QWhw, KWt, KWhw, Pos, InvT, InvHW, T, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pos,
    HQ: tl.constexpr, HKV: tl.constexpr, ROWS_Q: tl.constexpr, ROWS_K: tl.constexpr,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # one program: BLOCK_T tokens, all heads of q then k. A head is viewed as two rows of
    # HALF elements (row 2h = t-part, row 2h+1 = hw-part), each with its own weight and rope.
    pid = tl.program_id(0)
    cols = tl.arange(0, HALF)
    QT: tl.constexpr = HALF // 2       # t-part: rotate_half pairs i <-> i + HALF/2
    QH: tl.constexpr = HALF // 4       # h and w sub-vectors: pairs i <-> i + HALF/4
    t_partner = (cols + QT) % HALF
    t_sign = tl.where(cols < QT, -1.0, 1.0)
    t_inv = tl.load(InvT + cols % QT)
    sub = cols // (2 * QH)             # 0 = h, 1 = w
    cc = cols % (2 * QH)
    hw_partner = sub * (2 * QH) + (cc + QH) % (2 * QH)
    hw_sign = tl.where(cc < QH, -1.0, 1.0)
    hw_inv = tl.load(InvHW + cc % QH)
    for which in tl.static_range(2):
        if which == 0:
            X = Q
            stride_t = stride_qt
            stride_h = stride_qh
            rows = tl.arange(0, ROWS_Q)
            row_ok = rows < 2 * HQ
            Wt = QWt
            Whw = QWhw
        else:
            X = K
            stride_t = stride_kt
            stride_h = stride_kh
            rows = tl.arange(0, ROWS_K)
            row_ok = rows < 2 * HKV
            Wt = KWt
            Whw = KWhw
        is_hw = (rows % 2) == 1
        row_off = (rows // 2) * stride_h + (rows % 2) * HALF
        partner = tl.where(is_hw[:, None], hw_partner[None, :], t_partner[None, :])
        sign = tl.where(is_hw[:, None], hw_sign[None, :], t_sign[None, :])
        w = tl.where(is_hw[:, None], tl.load(Whw + cols)[None, :], tl.load(Wt + cols)[None, :]).to(tl.float32)
        w_p = tl.where(is_hw[:, None], tl.load(Whw + hw_partner)[None, :],
                       tl.load(Wt + t_partner)[None, :]).to(tl.float32)
        mask = row_ok[:, None]
        for i in tl.static_range(BLOCK_T):
            t = pid * BLOCK_T + i
            if t < T:
                base = X + t.to(tl.int64) * stride_t
                x = tl.load(base + row_off[:, None] + cols[None, :], mask=mask, other=0.0)
                xp = tl.load(base + row_off[:, None] + partner, mask=mask, other=0.0)
                xf = x.to(tl.float32)
                r = tl.math.rsqrt(tl.sum(xf * xf, 1) / HALF + eps)
                # Qwen3RMSNorm: normalise in fp32, cast to x's dtype, then scale by the weight
                xn = ((xf * r[:, None]).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
                xpn = ((xp.to(tl.float32) * r[:, None]).to(x.dtype).to(tl.float32) * w_p)
                xpn = xpn.to(x.dtype).to(tl.float32)
                pt = tl.load(Pos + t).to(tl.float32)
                ph = tl.load(Pos + stride_pos + t).to(tl.float32)
                pw = tl.load(Pos + 2 * stride_pos + t).to(tl.float32)
                # angles depend on the column and the part only: trig on 2 x HALF values, not per head
                ang_t = pt * t_inv
                ang_hw = tl.where(sub == 0, ph, pw) * hw_inv
                # HF casts cos/sin to x's dtype and rounds each product in it
                cos_t = tl.cos(ang_t).to(x.dtype).to(tl.float32)
                sin_t = tl.sin(ang_t).to(x.dtype).to(tl.float32)
                cos_hw = tl.cos(ang_hw).to(x.dtype).to(tl.float32)
                sin_hw = tl.sin(ang_hw).to(x.dtype).to(tl.float32)
                c = tl.where(is_hw[:, None], cos_hw[None, :], cos_t[None, :])
                s = tl.where(is_hw[:, None], sin_hw[None, :], sin_t[None, :])
                a = (xn * c).to(x.dtype).to(tl.float32)
                b = (xpn * sign * s).to(x.dtype).to(tl.float32)
                tl.store(base + row_off[:, None] + cols[None, :], (a + b).to(x.dtype), mask=mask)


_norm_rope = lazy_jit(_norm_rope_kernel)
_INV_CACHE: dict = {}


def _inv_cached(theta, rot_dim, device):
    key = (float(theta), rot_dim, str(device))
    t = _INV_CACHE.get(key)
    if t is None:
        t = _INV_CACHE[key] = inv_freq(theta, rot_dim, device)
    return t


def qk_norm_rope_triton_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps,
                         block_t=None, num_warps=4):
    _check(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions)
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q/k last dim must be contiguous")
    T, Hq, D = q.shape
    if T == 0:
        return q, k
    half = D // 2
    inv_t = _inv_cached(theta_t, half, q.device)
    inv_hw = _inv_cached(theta_hw, half // 2, q.device)
    positions = positions if positions.stride(1) == 1 else positions.contiguous()
    BT = block_t or (1 if q.is_cuda else 2)  # 1 token per program was fastest on H200
    grid = ((T + BT - 1) // BT,)
    _norm_rope[grid](
        q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, inv_t, inv_hw, T, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0),
        HQ=Hq, HKV=k.shape[1], ROWS_Q=next_pow2(2 * Hq), ROWS_K=next_pow2(2 * k.shape[1]), HALF=half,
        BLOCK_T=BT,
        num_warps=num_warps,
    )
    return q, k


def qk_norm_rope_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps):
    """Dispatch (in place on q and k; returns (q, k))."""
    D = q.shape[-1]
    ok = D >= 16 and (D & (D - 1)) == 0 and q.dtype == k.dtype
    if use_triton(q, ok):
        return qk_norm_rope_triton_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps)
    return qk_norm_rope_ref_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps)
