"""services/model/flow_sde.py: the SDE transition against its definitions (rl_spec §2-§4)."""
import math

import pytest
import torch

from services.model import flow_sde as F
from services.model.sampler import timesteps


def _state(B=3, H=8, W=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, H, W, generator=g), torch.randn(B, 3, H, W, generator=g)


@pytest.mark.parametrize("kind", ["flow", "dance"])
def test_zero_noise_is_the_euler_step(kind):
    z, v = _state()
    ts = timesteps(10, 3.0)
    for k in range(9):
        mean, std = F.sde_mean_std(kind, z, v, ts[k], ts[k + 1], ts[1], 0.0, 1.7)
        assert torch.equal(mean, F.ode_step(z, v, ts[k], ts[k + 1]))
        assert float(std) == 0.0
        z_next, _ = F.sde_step(kind, z, v, ts[k], ts[k + 1], ts[1], 0.0, 1.7, generator=torch.Generator())
        assert torch.equal(z_next, z + (ts[k + 1] - ts[k]) * v)


def test_cps_zero_noise_is_the_euler_step():
    z, v = _state()
    ts = timesteps(10, 3.0)
    for k in range(10):
        mean, std = F.sde_mean_std("cps", z, v, ts[k], ts[k + 1], ts[1], 0.0, 1.0)
        torch.testing.assert_close(mean, z + (ts[k + 1] - ts[k]) * v, rtol=0, atol=1e-6)
        assert float(std) == 0.0


@pytest.mark.parametrize("kind", ["flow", "dance"])
def test_logprob_matches_torch_normal(kind):
    z, v = _state(B=4)
    ts = timesteps(8, 2.0)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    z_next, lp = F.sde_step(kind, z, v, ts[2], ts[3], ts[1], 0.9, 2.5, generator=gens)
    mean, std = F.sde_mean_std(kind, z, v, ts[2], ts[3], ts[1], 0.9, 2.5)
    ref = torch.distributions.Normal(mean, std).log_prob(z_next).reshape(4, -1).mean(1)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    assert lp.dtype == torch.float32 and lp.shape == (4,)


def test_cps_logprob_has_no_constants():
    z, v = _state()
    ts = timesteps(6, 1.0)
    z_next, lp = F.sde_step("cps", z, v, ts[1], ts[2], ts[1], 0.8, 1.0, generator=torch.Generator())
    mean, _ = F.sde_mean_std("cps", z, v, ts[1], ts[2], ts[1], 0.8, 1.0)
    torch.testing.assert_close(lp, -((z_next - mean) ** 2).reshape(3, -1).mean(1))


def test_flow_matches_flow_grpo_sigma_form():
    """rl_spec §2.1 with sigma = 1 - t, v_FG = -v, s = 1 (the step at t = 0 uses sigma_1 in the guard)."""
    z, v = _state()
    ts = timesteps(10, 3.0)
    a = 0.7
    sig = 1 - ts
    for k in range(9):
        s_k, ds = float(sig[k]), float(sig[k + 1] - sig[k])
        den = float(sig[1]) if s_k == 1.0 else s_k
        g = a * math.sqrt(s_k / (1 - den))
        x, vfg = z.double(), -v.double()
        mu = x * (1 + g * g / (2 * s_k) * ds) + vfg * (1 + g * g * (1 - s_k) / (2 * s_k)) * ds
        std = g * math.sqrt(-ds)
        mean, st = F.sde_mean_std("flow", z, v, ts[k], ts[k + 1], ts[1], a, 1.0)
        torch.testing.assert_close(mean.double(), mu, rtol=1e-5, atol=1e-5)
        assert abs(float(st) - std) < 1e-5


def test_noise_scale_scales_the_std_only():
    z, v = _state()
    ts = timesteps(5, 1.0)
    m1, s1 = F.sde_mean_std("flow", z, v, ts[1], ts[2], ts[1], 0.7, 1.0)
    m3, s3 = F.sde_mean_std("flow", z, v, ts[1], ts[2], ts[1], 0.7, 3.0)
    assert torch.equal(m1, m3) and abs(float(s3) - 3 * float(s1)) < 1e-6


def test_differentiable_in_v():
    z, v = _state()
    v.requires_grad_(True)
    ts = timesteps(5, 1.0)
    z_next = torch.randn_like(z)
    for kind in F.SDE_KINDS:
        mean, std = F.sde_mean_std(kind, z, v, ts[1], ts[2], ts[1], 0.7, 1.0)
        lp = F.transition_logprob(kind, z_next, mean, std)
        (g,) = torch.autograd.grad(lp.sum(), v)
        assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_bf16_inputs_compute_in_fp32():
    z, v = _state()
    ts = timesteps(5, 1.0)
    mean, std = F.sde_mean_std("flow", z.bfloat16(), v.bfloat16(), ts[1], ts[2], ts[1], 0.7, 1.0)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32


def test_per_sample_generators_do_not_depend_on_the_batch():
    a = F.draw_noise((3, 3, 4, 4), "cpu", [torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    b = F.draw_noise((1, 3, 4, 4), "cpu", [torch.Generator().manual_seed(6)])
    assert torch.equal(a[1], b[0])


def test_step_indices():
    assert F.sde_step_indices(10) == list(range(9))
    assert F.sde_step_indices(1) == []
    assert F.sde_step_indices(10, window=(2, 3)) == [2, 3, 4]
    assert F.sde_step_indices(10, window=(7, 4)) == [7, 8]          # clipped before the last step
    assert F.sde_step_indices(10, steps=[4, 1, 4]) == [1, 4]
    for bad in (dict(window=(9, 1)), dict(steps=[10]), dict(window=(0, 1), steps=[1]), dict(window=(0, 0))):
        with pytest.raises(ValueError):
            F.sde_step_indices(10, **bad)
    assert F.sde_mask(5, [1, 3]).tolist() == [0, 1, 0, 1, 0]
