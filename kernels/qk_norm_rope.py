"""Fused split Q/K RMSNorm + 3-D RoPE (t/h/w), in place (model_spec.md section 3.1).

Per head of size D: dims [0, D/2) are the t-part, [D/2, D) the hw-part. Each part is
RMS-normalised with its own weight (Qwen3RMSNorm: fp32 normalise, cast to the input dtype,
then multiply by the weight in that dtype). Then HF rotate_half RoPE: the t-part with rotary
dim D/2 (base theta_t, position t); the hw-part's first half (h) and second half (w) each
with rotary dim D/4 (base theta_hw, positions h and w).

The cos / sin of every token and column depend on the positions only, so `rope_table` computes them
once per forward ([T, 2, D], cast to the input dtype as HF does, rotate_half's sign folded into sin)
and every layer's call reads that table: computing them per layer and head group cost the kernel as
much as its loads and stores.
"""
from __future__ import annotations

import torch

from ._backend import lazy_jit, next_pow2, tl, use_triton


_COLUMNS: dict = {}


def inv_freq(theta: float, rot_dim: int, device) -> torch.Tensor:
    """HF default rope: 1 / theta^(arange(0, d, 2) / d), fp32."""
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device=device).float() / rot_dim))


def _rms_ref(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _columns(head_dim: int, theta_t: float, theta_hw: float, device):
    """Per column of a head: which position (0 t, 1 h, 2 w), its inverse frequency, the sign rotate_half
    gives its partner, and the partner column."""
    key = (head_dim, float(theta_t), float(theta_hw), str(device))
    cols = _COLUMNS.get(key)
    if cols is None:
        half, quarter = head_dim // 2, head_dim // 4
        c = torch.arange(head_dim, device=device)
        hw = c >= half
        sel = torch.where(hw, torch.where(c % half < quarter, 1, 2), 0)
        inv_t, inv_hw = inv_freq(theta_t, half, device), inv_freq(theta_hw, quarter, device)
        inv = torch.where(hw, inv_hw[c % (quarter // 2)], inv_t[c % quarter])
        first = torch.where(hw, c % quarter < quarter // 2, c < quarter)   # rotate_half: -partner
        sign = torch.where(first, -1.0, 1.0)
        partner = torch.where(hw, c ^ (quarter // 2), c ^ quarter)
        cols = _COLUMNS[key] = (sel, inv, sign, partner)
    return cols


def rope_table(positions: torch.Tensor, head_dim: int, theta_t: float, theta_hw: float,
               dtype: torch.dtype) -> torch.Tensor:
    """[T, 2, D]: cos and rotate_half-signed sin of every token and column, computed as HF does (fp32 angle
    pos * inv_freq, cos / sin in fp32, cast to dtype). Positions [3, T] (t, h, w)."""
    sel, inv, sign, _ = _columns(head_dim, theta_t, theta_hw, positions.device)
    ang = positions.index_select(0, sel).t().float() * inv
    return torch.stack((ang.cos().to(dtype), (ang.sin() * sign).to(dtype)), dim=1)


def _one_ref(x, w_t, w_hw, table, partner, eps):
    half = x.shape[-1] // 2
    xn = torch.cat((_rms_ref(x[..., :half], w_t, eps), _rms_ref(x[..., half:], w_hw, eps)), dim=-1)
    # HF rounds each product in x's dtype: x * cos + rotate_half(x) * sin
    return xn * table[:, None, 0] + xn[..., partner] * table[:, None, 1]


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


def _table(q, positions, theta_t, theta_hw, table):
    if table is None:
        return rope_table(positions, q.shape[2], theta_t, theta_hw, q.dtype)
    if table.shape != (q.shape[0], 2, q.shape[2]) or table.dtype != q.dtype or table.stride()[1:] != (q.shape[2], 1):
        raise ValueError("table must be rope_table(...) of these positions: [T, 2, D] in q's dtype")
    return table


def qk_norm_rope_ref_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps, table=None):
    """Reference, in place; returns (q, k). Under autograd (a trainer's differentiable forward) it returns new
    tensors instead, with the same bits: writing the result into its own input would break the backward."""
    _check(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions)
    table = _table(q, positions, theta_t, theta_hw, table)
    partner = _columns(q.shape[2], theta_t, theta_hw, q.device)[3]
    q2 = _one_ref(q, q_w_t, q_w_hw, table, partner, eps)
    k2 = _one_ref(k, k_w_t, k_w_hw, table, partner, eps)
    if torch.is_grad_enabled() and (q2.requires_grad or k2.requires_grad):
        return q2, k2
    q.copy_(q2)
    k.copy_(k2)
    return q, k


def _norm_rope_kernel(
    Q, K, QWt, QWhw, KWt, KWhw, Tab, T, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_tab,
    HQ, HKV, Q_GROUPS, G: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program: BLOCK_T tokens x G heads of q (program_id(1) < Q_GROUPS) or of k, loaded in one go as a
    # [BLOCK_T, G, 8, E] tile (E = D/8) and stored once: one load-compute-store per program keeps many bytes in
    # flight (a loop over heads in place cannot overlap its loads with the stores before them). A head's row
    # is 8 blocks of E columns: blocks 0-3 are the t-part (rotate_half partner: block ^ 2), 4-5 the h- and 6-7
    # the w-quarter (partner: block ^ 1), so a partner is a whole block and its load stays contiguous (vector
    # loads, no gather). cos / sin come from the forward's table (rope_table), shared by the G heads.
    pid_t = tl.program_id(0)
    gid = tl.program_id(1)
    E: tl.constexpr = HALF // 4
    dt = Q.dtype.element_ty
    jb = tl.arange(0, 8)
    e = tl.arange(0, E)
    hw_b = jb >= 4                                            # block of the hw-part
    cols = jb[:, None] * E + e[None, :]                       # [8, E] column within the head
    pcols = (jb ^ tl.where(hw_b, 1, 2))[:, None] * E + e[None, :]
    wcols = (jb % 4)[:, None] * E + e[None, :]                # column within the part (norm weights)
    wpcols = ((jb ^ tl.where(hw_b, 1, 2)) % 4)[:, None] * E + e[None, :]
    hw = hw_b[:, None]
    if gid < Q_GROUPS:
        X = Q
        Wt = QWt
        Whw = QWhw
        stride_t = stride_qt
        stride_h = stride_qh
        H = HQ
        h0 = gid * G
    else:
        X = K
        Wt = KWt
        Whw = KWhw
        stride_t = stride_kt
        stride_h = stride_kh
        H = HKV
        h0 = (gid - Q_GROUPS) * G
    # Qwen3RMSNorm: normalise in fp32, cast to x's dtype, then scale by the weight (rounded in x's dtype)
    w = tl.where(hw, tl.load(Whw + wcols), tl.load(Wt + wcols)).to(tl.float32)[None, None, :, :]
    wp = tl.where(hw, tl.load(Whw + wpcols), tl.load(Wt + wpcols)).to(tl.float32)[None, None, :, :]
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    trow = (Tab + tok.to(tl.int64) * stride_tab)[:, None, None] + cols[None, :, :]
    tmask3 = tmask[:, None, None]
    cs = tl.load(trow, mask=tmask3, other=0.0).to(tl.float32)[:, None, :, :]
    sn = tl.load(trow + 2 * HALF, mask=tmask3, other=0.0).to(tl.float32)[:, None, :, :]
    h = h0 + tl.arange(0, G)
    rows = tok.to(tl.int64)[:, None] * stride_t + h[None, :] * stride_h          # [BLOCK_T, G]
    mask = (tmask[:, None] & (h < H)[None, :])[:, :, None, None]
    x = tl.load(X + rows[:, :, None, None] + cols[None, None, :, :], mask=mask, other=0.0)
    xp = tl.load(X + rows[:, :, None, None] + pcols[None, None, :, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    sq = tl.sum(xf * xf, 3)                                                    # [BLOCK_T, G, 8]
    s_t = tl.sum(tl.where(hw_b[None, None, :], 0.0, sq), 2)
    s_hw = tl.sum(tl.where(hw_b[None, None, :], sq, 0.0), 2)
    r = tl.where(hw[None, None, :, :], tl.math.rsqrt(s_hw / HALF + eps)[:, :, None, None],
                 tl.math.rsqrt(s_t / HALF + eps)[:, :, None, None])
    xn = ((xf * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
    xpn = ((xp.to(tl.float32) * r).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    # HF rounds each product in x's dtype: x * cos + rotate_half(x) * sin (sign in the table's sin)
    a = (xn * cs).to(dt).to(tl.float32)
    b = (xpn * sn).to(dt).to(tl.float32)
    tl.store(X + rows[:, :, None, None] + cols[None, None, :, :], (a + b).to(dt), mask=mask)


_norm_rope = lazy_jit(_norm_rope_kernel)
# launch defaults: tokens and heads per program, warps (bench/bench_kernels.py --sweep)
BLOCK_T, HEADS_PER_PROGRAM, NUM_WARPS = 1, 4, 1


def qk_norm_rope_triton_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps, table=None,
                         block_t=None, num_warps=None, heads_per_program=None):
    _check(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions)
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q/k last dim must be contiguous")
    T, Hq, D = q.shape
    if T == 0:
        return q, k
    table = _table(q, positions, theta_t, theta_hw, table)
    Hkv = k.shape[1]
    G = heads_per_program or min(HEADS_PER_PROGRAM, next_pow2(max(Hq, Hkv)))
    BT = block_t or BLOCK_T
    q_groups = -(-Hq // G)
    grid = (-(-T // BT), q_groups + -(-Hkv // G))
    _norm_rope[grid](
        q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, table, T, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0),
        Hq, Hkv, q_groups, G=G, HALF=D // 2, BLOCK_T=BT,
        num_warps=num_warps or NUM_WARPS,
    )
    return q, k


def qk_norm_rope_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps, table=None):
    """Dispatch (in place on q and k; returns (q, k)). `table`: rope_table of these positions (one per
    forward, shared by the layers); built here when None."""
    D = q.shape[-1]
    ok = D >= 16 and (D & (D - 1)) == 0 and q.dtype == k.dtype
    if use_triton(q, ok):
        return qk_norm_rope_triton_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps, table)
    return qk_norm_rope_ref_(q, k, q_w_t, q_w_hw, k_w_t, k_w_hw, positions, theta_t, theta_hw, eps, table)
