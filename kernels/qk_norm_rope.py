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


def _rms_rope_part_fn(base, offs, offs_p, mask, w, w_p, cs, sn_signed, eps, HALF: tl.constexpr):
    """One part (t or hw) of HC heads: tile [HC, 4, QH]. RMSNorm over the part, then rotate_half RoPE;
    the partner quarter (offs_p) is loaded directly, contiguous along the last axis."""
    x = tl.load(base + offs, mask=mask, other=0.0)
    xp = tl.load(base + offs_p, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(tl.sum(xf * xf, 2), 1) / HALF + eps)[:, None, None]
    # Qwen3RMSNorm: normalise in fp32, cast to x's dtype, then scale by the weight (rounded in x's dtype)
    xn = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
    xpn = ((xp.to(tl.float32) * r).to(x.dtype).to(tl.float32) * w_p).to(x.dtype).to(tl.float32)
    # HF rounds each product in x's dtype: rotate_half(x) * sin, with the sign folded into sin
    a = (xn * cs).to(x.dtype).to(tl.float32)
    b = (xpn * sn_signed).to(x.dtype).to(tl.float32)
    tl.store(base + offs, (a + b).to(x.dtype), mask=mask)


def _norm_rope_heads_fn(base, stride_h, cols, cols_pt, cols_phw, hh, w_t, w_tp, w_hw, w_hwp,
                        cos_t, sin_t, cos_hw, sin_hw, eps, H: tl.constexpr, HC: tl.constexpr, HALF: tl.constexpr):
    """All H heads of one token of one tensor, HC heads per step."""
    for h0 in tl.static_range(0, H, HC):
        h = h0 + hh
        mask = (h < H)[:, None, None]
        hoff = (h * stride_h)[:, None, None]
        _rms_rope_part(base, hoff + cols[None, :, :], hoff + cols_pt[None, :, :], mask,
                       w_t, w_tp, cos_t, sin_t, eps, HALF)
        _rms_rope_part(base, hoff + HALF + cols[None, :, :], hoff + HALF + cols_phw[None, :, :], mask,
                       w_hw, w_hwp, cos_hw, sin_hw, eps, HALF)


def _norm_rope_kernel(
    Q, K, QWt, QWhw, KWt, KWhw, Pos, InvT, InvHW, T, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pos,
    HQ: tl.constexpr, HKV: tl.constexpr, HC: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program: BLOCK_T tokens, all heads of q then k, HC heads at a time. Each part (t = dims
    # [0, HALF), hw = [HALF, 2*HALF)) of a head is a tile [4, QH] of quarters: rotate_half partners are
    # whole quarters (t: quarter j <-> j^2; h/w: j <-> j^1), so the partner load stays contiguous
    # (16-byte vectors, no gather). t- and hw-parts are separate tiles, so weights and cos/sin are
    # plain broadcasts over heads (no per-row selects) and the per-thread state stays small.
    pid = tl.program_id(0)
    QH: tl.constexpr = HALF // 4
    j = tl.arange(0, 4)
    c = tl.arange(0, QH)
    cols = j[:, None] * QH + c[None, :]                       # [4, QH] column within the part
    cols_pt = (j ^ 2)[:, None] * QH + c[None, :]
    cols_phw = (j ^ 1)[:, None] * QH + c[None, :]
    sign_t = tl.where(j < 2, -1.0, 1.0)[:, None]
    sign_hw = tl.where((j % 2) == 0, -1.0, 1.0)[:, None]
    inv_t = tl.load(InvT + (j % 2)[:, None] * QH + c[None, :])  # [4, QH]
    inv_hw = tl.load(InvHW + c)[None, :]                        # [1, QH]
    hh = tl.arange(0, HC)
    qw_t = tl.load(QWt + cols).to(tl.float32)[None, :, :]
    qw_tp = tl.load(QWt + cols_pt).to(tl.float32)[None, :, :]
    qw_hw = tl.load(QWhw + cols).to(tl.float32)[None, :, :]
    qw_hwp = tl.load(QWhw + cols_phw).to(tl.float32)[None, :, :]
    kw_t = tl.load(KWt + cols).to(tl.float32)[None, :, :]
    kw_tp = tl.load(KWt + cols_pt).to(tl.float32)[None, :, :]
    kw_hw = tl.load(KWhw + cols).to(tl.float32)[None, :, :]
    kw_hwp = tl.load(KWhw + cols_phw).to(tl.float32)[None, :, :]
    for i in tl.static_range(BLOCK_T):
        t = pid * BLOCK_T + i
        if t < T:
            pt = tl.load(Pos + t).to(tl.float32)
            ph = tl.load(Pos + stride_pos + t).to(tl.float32)
            pw = tl.load(Pos + 2 * stride_pos + t).to(tl.float32)
            # angles depend on the column and the part only: 2 x HALF cos/sin per token, shared by all heads
            ang_t = pt * inv_t
            ang_hw = tl.where(j < 2, ph, pw)[:, None] * inv_hw
            dt = Q.dtype.element_ty
            # HF casts cos/sin to x's dtype before use
            cos_t = tl.cos(ang_t).to(dt).to(tl.float32)[None, :, :]
            sin_t = (tl.sin(ang_t).to(dt).to(tl.float32) * sign_t)[None, :, :]
            cos_hw = tl.cos(ang_hw).to(dt).to(tl.float32)[None, :, :]
            sin_hw = (tl.sin(ang_hw).to(dt).to(tl.float32) * sign_hw)[None, :, :]
            _norm_rope_heads(Q + t.to(tl.int64) * stride_qt, stride_qh, cols, cols_pt, cols_phw, hh,
                             qw_t, qw_tp, qw_hw, qw_hwp, cos_t, sin_t, cos_hw, sin_hw, eps, HQ, HC, HALF)
            _norm_rope_heads(K + t.to(tl.int64) * stride_kt, stride_kh, cols, cols_pt, cols_phw, hh,
                             kw_t, kw_tp, kw_hw, kw_hwp, cos_t, sin_t, cos_hw, sin_hw, eps, HKV, HC, HALF)


_norm_rope = lazy_jit(_norm_rope_kernel, helpers={"_rms_rope_part": _rms_rope_part_fn,
                                                          "_norm_rope_heads": _norm_rope_heads_fn})
_INV_CACHE: dict = {}


def _inv_cached(theta, rot_dim, device):
    key = (float(theta), rot_dim, str(device))
    t = _INV_CACHE.get(key)
    if t is None:
        t = _INV_CACHE[key] = inv_freq(theta, rot_dim, device)
    return t


def qk_norm_rope_triton_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps,
                         block_t=None, num_warps=4, heads_per_step=None):
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
    BT = block_t or (1 if q.is_cuda else 2)
    grid = ((T + BT - 1) // BT,)
    _norm_rope[grid](
        q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, inv_t, inv_hw, T, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0),
        HQ=Hq, HKV=k.shape[1], HC=heads_per_step or min(8, next_pow2(max(Hq, k.shape[1]))), HALF=half,
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
