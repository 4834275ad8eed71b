"""RoPE, positions and masks, CFG rules, the timestep grid, noise scale, patchify."""
import math

import pytest
import torch

from services.contract.image import SamplerParams
from services.model import sampler as S
from services.model.config import parse_config
from kernels import qk_norm_rope_ref_
from services.model.positions import image_end, prefill_mask, thw_indexes
from services.model.tiny import tiny_config

CTX = 7  # a stand-in <IMG_CONTEXT> id


def _spec_rope(x, pos, base):
    """Spec 3.1, element by element: upstream's doubled-then-strided inv_freq, rotate-half pairs."""
    d = x.shape[-1]
    inv = (1.0 / (base ** (torch.arange(0, 2 * d, 2).float() / (2 * d))))[::2]
    out = torch.empty_like(x)
    for i in range(d):
        j = i % (d // 2)
        ang = pos.float() * inv[j]
        partner = x[..., (i + d // 2) % d] * (-1 if i < d // 2 else 1)
        out[..., i] = x[..., i] * ang.cos()[:, None] + partner * ang.sin()[:, None]
    return out


def test_norm_rope_follows_the_spec():
    D, T = 16, 3
    pos = torch.tensor([[5, 9, 2], [0, 3, 1], [0, 0, 2]])  # token0 is text: h = w = 0
    q, k = torch.randn(T, 4, D, dtype=torch.float64), torch.randn(T, 2, D, dtype=torch.float64)
    w = [torch.rand(D // 2, dtype=torch.float64) + 0.5 for _ in range(4)]

    def spec(x, wt, whw):
        def rms(a, wt_):
            return wt_ * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))
        xt, xhw = rms(x[..., :D // 2], wt), rms(x[..., D // 2:], whw)
        return torch.cat([_spec_rope(xt, pos[0], 5e6), _spec_rope(xhw[..., :D // 4], pos[1], 1e4),
                          _spec_rope(xhw[..., D // 4:], pos[2], 1e4)], -1)

    eq, ek = spec(q, w[0], w[1]), spec(k, w[2], w[3])
    qk_norm_rope_ref_(q, k, *w, pos, 5e6, 1e4, 1e-6)
    torch.testing.assert_close(q, eq, rtol=1e-6, atol=1e-6)  # cos/sin are fp32, as upstream
    torch.testing.assert_close(k, ek, rtol=1e-6, atol=1e-6)
    # a text token's hw part is normalised but not rotated
    x = torch.randn(1, 1, D, dtype=torch.float64)
    y = x.clone()
    qk_norm_rope_ref_(y, y.clone(), *[torch.ones(D // 2, dtype=torch.float64)] * 4,
                      torch.tensor([[0], [0], [0]]), 5e6, 1e4, 1e-6)
    hw = x[..., D // 2:]
    torch.testing.assert_close(y[..., D // 2:], hw * torch.rsqrt(hw.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_positions_and_hybrid_mask_with_two_images():
    # text(3) <img> ctx x4 (grid 4x4 -> 2x2) </img> text(2) <img> ctx x2 (grid 2x4 -> 1x2) </img>
    ids = torch.tensor([1, 2, 3, 8] + [CTX] * 4 + [9, 4, 5, 8] + [CTX] * 2 + [9])
    pos = thw_indexes(ids, CTX, [(4, 4), (2, 4)])
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 5, 6, 7, 8, 9, 9, 10]
    assert pos[1].tolist() == [0] * 4 + [0, 0, 1, 1] + [0] * 4 + [0, 0] + [0]
    assert pos[2].tolist() == [0] * 4 + [0, 1, 0, 1] + [0] * 4 + [0, 1] + [0]
    mask = prefill_mask(pos)
    ie = image_end(ids, CTX)
    n = ids.numel()
    rule = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            rule[i, j] = j <= i or (ie[i] > 0 and j < ie[i])
    assert torch.equal(mask, rule)
    assert mask[4, 7] and not mask[3, 4] and mask[8, 7] and not mask[7, 8]  # image sees its span, not </img>
    with pytest.raises(ValueError):
        thw_indexes(ids, CTX, [(4, 4)])


def test_timestep_grid_8_steps_shift_3():
    expected = [0, 0.0455, 0.1, 0.1667, 0.25, 0.357, 0.5, 0.7, 1.0]
    got = S.timesteps(8, 3.0).tolist()
    assert all(abs(a - b) < 6e-4 for a, b in zip(got, expected)), got
    assert S.timesteps(4, 1.0).tolist() == [0, 0.25, 0.5, 0.75, 1.0]


def test_noise_scale_and_cap():
    cfg = parse_config(tiny_config("u1"))
    assert S.noise_scale(cfg, 64) == 1.0
    assert S.noise_scale(cfg, 1024) == 4.0
    assert S.noise_scale(cfg, 4096) == 8.0
    assert S.noise_scale(cfg, 16384) == 8.0  # cap 8 (U1)
    cfg15 = parse_config(tiny_config("u1.5"))
    assert S.noise_scale(cfg15, 16384) == 16.0
    a = S.initial_noise(2, 64, 32, 3, "cpu", torch.float32, 2.0)
    b = S.initial_noise(2, 64, 32, 3, "cpu", torch.float32, 2.0)
    assert torch.equal(a, b) and a.shape == (2, 3, 64, 32)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(a, 2.0 * torch.randn((2, 3, 64, 32), generator=g))


def test_patchify_layout_and_roundtrip():
    x = torch.randn(2, 3, 64, 96)
    z = S.patchify(x)
    assert z.shape == (2, 6, 3072)
    # token 1 is row 0, col 1; inside it (row, col, channel) order
    assert torch.equal(z[0, 1].view(32, 32, 3), x[0, :, 0:32, 32:64].permute(1, 2, 0))
    assert torch.equal(S.unpatchify(z, 2, 3), x)


def _v(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 3072, generator=g)


def sp(**fields) -> S.Sampling:
    """The model's sampling values of a request (as the engines convert the contract's SamplerParams)."""
    return S.Sampling.of(SamplerParams(**fields))


def test_model_values_mirror_the_contract():
    """The model's own dataclasses carry the contract's field names (converted by name at the engine boundary)."""
    from dataclasses import fields
    from services.contract.image import CacheMode, CacheOptions
    from services.model.step_cache import CACHE_MODES, StepCacheOptions
    assert {f.name for f in fields(S.Sampling)} - {"branches"} <= set(SamplerParams.model_fields)
    assert {f.name for f in fields(StepCacheOptions)} == set(CacheOptions.model_fields)
    assert CACHE_MODES == CacheMode.__args__
    assert StepCacheOptions.of(CacheOptions(mode="teacache", threshold=0.1)).reuses


def test_t2i_cfg_rows():
    vc, vu = _v(1), _v(2)
    p = sp(guidance_scale=4.0)
    torch.testing.assert_close(S.combine({"cond": vc, "uncond": vu}, p, 1, 0.5), vu + 4 * (vc - vu))
    g = S.combine({"cond": vc, "uncond": vu}, sp(cfg_norm="global"), 1, 0.5)
    raw = vu + 4 * (vc - vu)
    f = (vc.flatten(1).norm(dim=1) / (raw.flatten(1).norm(dim=1) + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(g, raw * f.view(2, 1, 1))
    c = S.combine({"cond": vc, "uncond": vu}, sp(cfg_norm="channel"), 1, 0.5)
    fc = (vc.norm(dim=-1, keepdim=True) / (raw.norm(dim=-1, keepdim=True) + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(c, raw * fc)
    zs = sp(cfg_norm="cfg_zero_star")
    assert torch.equal(S.combine({"cond": vc, "uncond": vu}, zs, 0, 0.0), torch.zeros_like(vc))
    alpha = ((vc * vu).flatten(1).sum(1) / ((vu ** 2).flatten(1).sum(1) + 1e-8)).view(2, 1, 1)
    torch.testing.assert_close(S.combine({"cond": vc, "uncond": vu}, zs, 1, 0.5), alpha * vu + 4 * (vc - alpha * vu))
    # interval is inclusive for T2I; guidance_scale 1 -> cond only (and no uncond branch)
    p2 = sp(cfg_interval=(0.2, 0.5))
    assert S.uses_cfg(p2, 0.5) and S.uses_cfg(p2, 0.2) and not S.uses_cfg(p2, 0.6)
    assert torch.equal(S.combine({"cond": vc, "uncond": vu}, p2, 3, 0.6), vc)
    assert sp(guidance_scale=1.0).branches == ("cond",)


def test_edit_cfg_rows():
    vc, vi, vu = _v(1), _v(2), _v(3)
    v = {"cond": vc, "img_cond": vi, "uncond": vu}

    def run(g, gi):
        p = sp(mode="edit", guidance_scale=g, image_guidance_scale=gi)
        need = list(p.branches)
        return need, S.combine({b: v[b] for b in need}, p, 1, 0.5)

    assert run(1, 1) == (["cond"], vc)
    need, out = run(4, 1)
    assert need == ["cond", "img_cond"] and torch.allclose(out, vi + 4 * (vc - vi))
    need, out = run(3, 3)
    assert need == ["cond", "uncond"] and torch.allclose(out, vu + 3 * (vc - vu))
    need, out = run(4, 2)
    assert need == ["cond", "img_cond", "uncond"]
    assert torch.allclose(out, vu + 4 * (vc - vi) + 2 * (vi - vu))
    # editing interval rule: (lo < t < hi) or lo == 0
    p = sp(mode="edit", cfg_interval=(0.2, 0.5))
    assert not S.uses_cfg(p, 0.2) and S.uses_cfg(p, 0.3)
    with pytest.raises(ValueError):
        SamplerParams(mode="edit", cfg_norm="cfg_zero_star")


def test_velocity_clamp():
    z, x = torch.zeros(1, 1, 3), torch.ones(1, 1, 3)
    assert torch.allclose(S.velocity(x, z, torch.tensor(0.5), 0.02), 2 * x)
    assert torch.allclose(S.velocity(x, z, torch.tensor(1.0), 0.02), x / 0.02)
    assert math.isclose(float(S.euler(z, x, torch.tensor(0.25), torch.tensor(0.5))[0, 0, 0]), 0.25)
