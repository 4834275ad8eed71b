"""Fused sparse MoE (Qwen3-MoE): routing, token -> expert layout and two grouped GEMMs, with no host sync.

    logits [T, E] -> fp32 softmax -> top-k -> renormalise (norm_topk_prob) -> weights in x's dtype
    y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert j of token t

Expert weights are stacked: `w13` [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and `w2` [E, H, I].

Every step is a device op with shapes known on the host, so a call can be captured in a CUDA graph:
- routing: torch softmax / topk / sum / div (`moe_route`);
- layout (`moe_align`): the T*k (token, slot) pairs sorted by expert and each expert's run padded to a multiple
  of BLOCK_M, in a buffer sized for the worst case (`aligned_len`); per block of BLOCK_M rows its expert, -1 for
  blocks past the last run. The rank of a pair inside its expert's run is a cumulative sum over an [E, T*k] 0/1
  table (no sort, no bincount: both read a device value on the host);
- `_moe_up_kernel`: per (row block, column block of I), the gate and up tiles of the block's expert, then
  silu(gate) * up (each rounded to x's dtype as torch rounds) written to act[pair];
- `_moe_down_kernel`: act @ w2[e]^T, rounded, times the pair's routing weight (rounded, as torch's product);
- combine: the k products of a token summed in fp32, rounded once.

`fused_moe_ref` is the oracle and the CPU path: every expert on every token (a dense batched GEMM: E/k times the
useful work, no data-dependent shapes, no loop), the unchosen ones weighted by 0, so it is exact for the chosen.
The official code loops over the experts present and index_adds in the model dtype; in fp32 both agree to
rounding (tests/kernels/test_moe.py; the official outputs: tests/system/test_a3b.py), in bf16 the fp32 combine
here is the more accurate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import interpreting, lazy_jit, tl, use_triton


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """(weights [T, k] in `dtype`, expert ids [T, k] int64): softmax in fp32, top-k, renormalised."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def _check(x, w13, w2, top_k):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    E, two_i, H = w13.shape
    if two_i % 2 or w2.shape != (E, H, two_i // 2) or x.shape[1] != H:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} must be in [1, {E}]")


def fused_moe_ref(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """x [T, H], router logits [T, E] -> [T, H] (module doc: every expert on every token, weighted)."""
    _check(x, w13, w2, top_k)
    weights, ids = moe_route(logits, top_k, renormalize, x.dtype)
    E, I = w13.shape[0], w13.shape[1] // 2
    dense = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter_(1, ids, weights)   # [T, E]
    gate_up = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))             # [E, T, 2I]
    act = F.silu(gate_up[..., :I]) * gate_up[..., I:]
    y = torch.bmm(act, w2.transpose(1, 2))                                  # [E, T, H]
    y = y * dense.t().unsqueeze(-1)                                         # rounded as torch's product
    return y.float().sum(0).to(x.dtype)


# ----------------------------------------------------------------------------- layout
def aligned_len(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout: every pair, plus at most block_m - 1 padding per expert in use (at most
    min(E, pairs) are), rounded up to a whole block."""
    n = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-n // block_m) * block_m


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids [T, k] -> (sorted_pairs [L] int32: pair index t*k + j in expert order, each expert's run padded
    to a multiple of block_m with the sentinel T*k; block_expert [L / block_m] int32, -1 past the last run).
    L = aligned_len(T*k, E, block_m). Device ops only."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    # [E, N], scanned along its contiguous last dim: torch scans an outer dim with one thread per column,
    # sequentially over N (~3 ms at N = 16k pairs on an H200, the A3B denoise step's MoE cost), an inner dim
    # with a block-wide parallel scan per row
    hit = (torch.arange(num_experts, device=dev).unsqueeze(1) == flat.unsqueeze(0)).to(torch.int32)   # [E, N]
    cum = hit.cumsum(1, dtype=torch.int32)
    counts = cum[:, -1] if n else torch.zeros(num_experts, dtype=torch.int32, device=dev)
    rank = cum.gather(0, flat.unsqueeze(0)).squeeze(0) - 1                                  # within its expert
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0, dtype=torch.int32)
    dest = (run_end - padded).gather(0, flat) + rank
    L = aligned_len(n, num_experts, block_m)
    sorted_pairs = torch.full((L,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest.long(), torch.arange(n, dtype=torch.int32, device=dev))
    starts = torch.arange(0, L, block_m, dtype=torch.int32, device=dev)
    block_expert = torch.searchsorted(run_end, starts, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


# ----------------------------------------------------------------------------- Triton
def _dot(a, b, IEEE: tl.constexpr):
    """IEEE: fp32 operands (exact fp32 products, no tf32), and every dtype under the interpreter, whose 16-bit
    tl.dot returns garbage (triton 3.9, numpy 2.4); a 16-bit product is exact in fp32, so the math is the same."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


def _tile(PAIRS, BLOCK_EXPERT, n_pairs, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: the expert of its row block (-1: none), the rows' pairs and which are real (not
    padding), its output columns and which exist. Programs run row block by row block, columns fastest."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_cols, BLOCK_N)
    pid_m = pid // n_blocks
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    pairs = tl.load(PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n = (pid % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, pairs, pairs < n_pairs, offs_n, offs_n < n_cols


def _expert_gemm(A, a_rows, stride_a, W, offs_n, stride_wn, K, valid, n_ok, W_ROW_OFFSET,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIR: tl.constexpr,
                 IEEE: tl.constexpr):
    """The tile's fp32 products over K: A's rows a_rows (masked by valid) times the expert's weight rows offs_n
    (W [N, K], K contiguous); PAIR: also times rows offs_n + W_ROW_OFFSET into the second accumulator, from the
    same A tiles (the up projection's gate and up halves; else the second accumulator stays zero)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(A + a_rows[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(W + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        if PAIR:
            w2 = tl.load(W + (offs_n[None, :] + W_ROW_OFFSET) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        acc += _dot(a, w, IEEE)
        if PAIR:
            acc2 += _dot(a, w2, IEEE)
    return acc, acc2


def _moe_up_kernel(X, W13, ACT, PAIRS, BLOCK_EXPERT, n_pairs, top_k, H, I,
                   stride_xm, stride_we, stride_wn, stride_am,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    e, pairs, valid, offs_n, n_ok = _tile(PAIRS, BLOCK_EXPERT, n_pairs, I, BLOCK_M, BLOCK_N)
    if e < 0:
        return
    tok = (pairs // top_k).to(tl.int64)
    acc_g, acc_u = _expert_gemm(X, tok, stride_xm, W13 + e * stride_we, offs_n, stride_wn, H, valid, n_ok, I,
                                BLOCK_M, BLOCK_N, BLOCK_K, True, IEEE)
    dt = ACT.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt)
    act = (silu.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)
    tl.store(ACT + pairs.to(tl.int64)[:, None] * stride_am + offs_n[None, :], act,
             mask=valid[:, None] & n_ok[None, :])


def _moe_down_kernel(ACT, W2, OUT, PAIRS, BLOCK_EXPERT, WEIGHTS, n_pairs, H, I,
                     stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    e, pairs, valid, offs_n, n_ok = _tile(PAIRS, BLOCK_EXPERT, n_pairs, H, BLOCK_M, BLOCK_N)
    if e < 0:
        return
    rows = pairs.to(tl.int64)
    acc, _ = _expert_gemm(ACT, rows, stride_am, W2 + e * stride_we, offs_n, stride_wn, I, valid, n_ok, 0,
                          BLOCK_M, BLOCK_N, BLOCK_K, False, IEEE)
    dt = OUT.dtype.element_ty
    rw = tl.load(WEIGHTS + rows, mask=valid, other=0.0).to(tl.float32)
    y = (acc.to(dt).to(tl.float32) * rw[:, None]).to(dt)
    tl.store(OUT + rows[:, None] * stride_om + offs_n[None, :], y, mask=valid[:, None] & n_ok[None, :])


_HELPERS = {"_dot": _dot, "_tile": _tile, "_expert_gemm": _expert_gemm}
_up = lazy_jit(_moe_up_kernel, helpers=_HELPERS)
_down = lazy_jit(_moe_down_kernel, helpers=_HELPERS)


def moe_config(pairs: int, num_experts: int) -> dict:
    """Tile sizes by pairs per expert: 16-row blocks for decode (narrower columns when there are few pairs, so more
    programs stream the experts' weights), larger for prefill / denoise. Not tuned on the GPU yet."""
    per_expert = pairs / max(1, min(num_experts, pairs))
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32 if pairs <= 64 else 64, "BLOCK_K": 64, "num_warps": 4}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}


def _supported(x, w13, w2) -> bool:
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w13.dtype == x.dtype
            and w2.dtype == x.dtype and x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous())


def fused_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """x [T, H], router logits [T, E], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] (module doc)."""
    _check(x, w13, w2, top_k)
    if not use_triton(x, _supported(x, w13, w2)):
        return fused_moe_ref(x, logits, w13, w2, top_k, renormalize)
    T, H = x.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    n = T * top_k
    if n == 0:
        return torch.empty_like(x)
    weights, ids = moe_route(logits, top_k, renormalize, x.dtype)
    cfg = moe_config(n, E)
    bm, bn, bk, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    stages = cfg.get("num_stages", 3)
    pairs, block_expert = moe_align(ids, E, bm)
    m_blocks = block_expert.numel()
    ieee = x.dtype == torch.float32 or interpreting()
    act = torch.empty(n, I, dtype=x.dtype, device=x.device)
    _up[(m_blocks * -(-I // bn),)](x, w13, act, pairs, block_expert, n, top_k, H, I,
                                   x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, num_warps=warps,
                                   num_stages=stages)
    out = torch.empty(n, H, dtype=x.dtype, device=x.device)
    _down[(m_blocks * -(-H // bn),)](act, w2, out, pairs, block_expert, weights.reshape(-1), n, H, I,
                                     act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
                                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, num_warps=warps,
                                     num_stages=stages)
    return out.view(T, top_k, H).float().sum(1).to(x.dtype)
