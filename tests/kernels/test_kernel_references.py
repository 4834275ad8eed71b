"""References of decode/denoise attention, norm+rope and KV copy vs independent float64 math (no Triton)."""
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.qk_norm_rope import qk_norm_rope_ref_

from tests.kernels.kernel_testutil import rel_err


def _sdpa64(q, k, v, scale):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> float64 non-causal attention."""
    G = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(G, 1).transpose(0, 1)
    v = v.double().repeat_interleave(G, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, scale=scale).transpose(0, 1)


def test_decode_reference_vs_float64(rng):
    lens = [1, 19, 64]
    S, hq, hkv, d = 100, 8, 2, 16
    kp, vp = torch.randn(S, hkv, d), torch.randn(S, hkv, d)
    r2t = torch.stack([torch.randperm(S)[:70] for _ in lens]).int()
    q = torch.randn(len(lens), hq, d)
    out = kernels.decode_attention(q, kp, vp, r2t, torch.tensor(lens, dtype=torch.int32))
    for b, L in enumerate(lens):
        slots = r2t[b, :L].long()
        exp = _sdpa64(q[b:b + 1], kp[slots], vp[slots], 1 / math.sqrt(d))[0]
        assert rel_err(out[b], exp) < 1e-5


def test_denoise_reference_and_sdpa_vs_float64(rng):
    hq, hkv, d = 8, 1, 16
    cq = torch.tensor([0, 12, 20], dtype=torch.int32)
    ck = torch.tensor([0, 21, 50], dtype=torch.int32)
    q, k, v = torch.randn(20, hq, d), torch.randn(50, hkv, d), torch.randn(50, hkv, d)
    outs = [kernels.denoise_attention(q, k, v, cq, ck, scale=0.3),
            kernels.denoise_attention.__globals__["denoise_attention_sdpa"](q, k, v, cq, ck, scale=0.3)]
    for b in range(2):
        exp = _sdpa64(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], 0.3)
        for out in outs:
            assert rel_err(out[cq[b]:cq[b + 1]], exp) < 1e-5


def _spec_norm_rope(x, w_t, w_hw, pos, theta_t, theta_hw, eps):
    """model_spec 3.1 written independently: per-part RMSNorm, then each rotary sub-vector as a
    complex rotation (x_i + i x_{i+d/2}) * e^{i pos inv_freq_i} (rotate_half pairing)."""
    T, H, D = x.shape
    xd = x.double()
    out = torch.empty_like(xd)
    parts = [(0, D // 2, w_t), (D // 2, D, w_hw)]
    for a, e, w in parts:
        seg = xd[..., a:e]
        out[..., a:e] = seg / torch.sqrt(seg.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    for a, e, theta, p in [(0, D // 2, theta_t, pos[0]), (D // 2, 3 * D // 4, theta_hw, pos[1]),
                           (3 * D // 4, D, theta_hw, pos[2])]:
        d = e - a
        inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))          # fp32 as in HF
        ang = (p.float()[:, None] * inv[None, :]).double()                  # [T, d/2]
        z = torch.complex(out[..., a:a + d // 2], out[..., a + d // 2:e]) * torch.polar(
            torch.ones_like(ang), ang)[:, None, :]
        out[..., a:a + d // 2], out[..., a + d // 2:e] = z.real, z.imag
    return out


@pytest.mark.parametrize("d", [128, 16])
def test_norm_rope_reference_follows_model_spec(rng, d):
    T, hq, hkv = 9, 4, 2
    q, k = torch.randn(T, hq, d), torch.randn(T, hkv, d)
    ws = [torch.rand(d // 2) + 0.5 for _ in range(4)]
    pos = torch.stack([torch.randint(0, 3000, (T,)), torch.randint(0, 40, (T,)), torch.randint(0, 40, (T,))])
    pos[1:, :3] = 0
    exp_q = _spec_norm_rope(q, ws[0], ws[1], pos, 5e6, 1e4, 1e-6)
    exp_k = _spec_norm_rope(k, ws[2], ws[3], pos, 5e6, 1e4, 1e-6)
    qk_norm_rope_ref_(q, k, *ws, pos, 5e6, 1e4, 1e-6)
    assert rel_err(q, exp_q) < 1e-5 and rel_err(k, exp_k) < 1e-5
    # text tokens (h = w = 0): the hw-part is only normalised
    hw = q[:3, :, d // 2:].double()
    assert rel_err(hw, exp_q[:3, :, d // 2:]) < 1e-5


def test_norm_rope_weight_applied_after_cast_bf16(rng):
    """Qwen3RMSNorm order: normalise in fp32, cast to bf16, then multiply by the bf16 weight."""
    x = torch.randn(3, 1, 16).bfloat16()
    w = (torch.rand(8) + 0.5).bfloat16()
    k = torch.randn(3, 1, 16).bfloat16()
    pos = torch.zeros(3, 3, dtype=torch.long)  # no rotation
    qk_norm_rope_ref_(xq := x.clone(), k, w, w, w, w, pos, 5e6, 1e4, 1e-6)
    xf = x[..., :8].float()
    exp = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(xq[..., :8], exp)


def test_kv_copy_reference_roundtrip(rng):
    L, S, hkv, d, pt, T = 2, 20, 2, 16, 4, 10
    kv = torch.randn(L, 2, S, hkv, d).bfloat16()
    slots = torch.randperm(S)[:T].int()
    page_ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    pages = torch.zeros(5, L, 2, pt, hkv, d).bfloat16()
    kernels.kv_export(kv, slots, pages, page_ids)
    assert torch.equal(pages[0, :, :, 1], kv[:, :, int(slots[5])])  # token 5 -> page_ids[1], row 1
    dst = torch.zeros(L, 2, T + 3, hkv, d).bfloat16()
    kernels.kv_import(pages, page_ids, T, dst)
    assert torch.equal(dst[:, :, :T], kv[:, :, slots.long()])
    with pytest.raises(ValueError):
        kernels.kv_import(pages, page_ids, T + 4, dst)


def test_host_memory_helpers_without_cuda():
    t = torch.zeros(16)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by bench/bench_kernels.py")
    assert kernels.register_host_memory(t) is False
    assert kernels.unregister_host_memory(t) is False
