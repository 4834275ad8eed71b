"""Advantages, PPO-clip, the k3 KL and the built-in rewards (no stack needed)."""
import math

import pytest
import torch

from services.rl import advantages as ADV
from services.rl.flags import TINY_DEFAULTS
from services.rl.losses import kl_k3, ppo_clip
from services.rl.rewards import RewardSet, Samples, parse_reward


def test_flow_grpo_advantages_use_the_prompt_mean_and_the_global_std():
    r = torch.tensor([[1.0, 3.0], [10.0, 14.0]])
    a = ADV.flow_grpo(r, global_std=True)
    g = r.std(unbiased=False)
    assert torch.allclose(a, torch.tensor([[-1.0, 1.0], [-2.0, 2.0]]) / (g + 1e-4))
    per = ADV.flow_grpo(r, global_std=False)
    assert torch.allclose(per, torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]), atol=1e-3)
    assert ADV.flow_grpo(torch.tensor([[0.0, 1e6]]), adv_clip=5.0).abs().max() <= 5.0


def test_dance_grpo_advantages_per_group_unbiased_std():
    r = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    a = ADV.dance_grpo(r)
    assert torch.allclose(a[0], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6)
    assert torch.equal(a[1], torch.zeros(3))                 # a zero-variance group teaches nothing
    assert ADV.active_samples(a).tolist() == [[True, False, True], [False, False, False]]


def test_mix_grpo_normalises_each_reward_in_its_group_then_weights():
    image = torch.tensor([[0.5, 0.5001]])        # tiny spread
    text = torch.tensor([[0.0, 1.0]])             # large spread
    a = ADV.mix_grpo({"image": image, "text": text}, {"image": 1.0, "text": 0.5})
    one = math.sqrt(0.5)                          # (x - mean) / unbiased std of two values
    assert torch.allclose(a, torch.tensor([[-one - 0.5 * one, one + 0.5 * one]]), atol=1e-3)


def test_ppo_clip_at_ratio_one_is_minus_the_advantage_and_clips_beyond_the_range():
    lp = torch.zeros(2, 3, requires_grad=True)
    st = ppo_clip(lp, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), 1e-4)
    assert st.loss.item() == pytest.approx(0.5) and st.clipfrac == 0 and st.ratio_max_err == 0
    st.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0] * 3, [2.0] * 3]) / 6)
    far = ppo_clip(torch.full((1, 1), 0.01), torch.zeros(1, 1), torch.tensor([1.0]), 1e-4)
    assert far.clipfrac == 1.0 and far.loss.item() == pytest.approx(-(1 + 1e-4))


def test_k3_is_zero_at_equal_logprobs_and_positive_otherwise():
    lp = torch.tensor([[0.1, -0.2]], requires_grad=True)
    assert kl_k3(lp, lp.detach()).item() == 0.0
    k = kl_k3(lp, torch.tensor([[0.3, -0.2]]))
    d = 0.2
    assert k.item() == pytest.approx((math.exp(d) - d - 1) / 2, rel=1e-5)
    k.backward()
    assert lp.grad[0, 0] < 0 and lp.grad[0, 1] == 0          # pulled towards the reference


def test_builtin_rewards():
    images = torch.zeros(2, 3, 4, 4)
    images[1] = 1.0
    s = Samples(images, ["p", "p"], ["abc!!", None], [[1, 2, 3], None])
    rs = RewardSet.parse(["brightness", "colour:1,1,1@2", "think-chars:abc", "think-length:6", "think-keyword:bc"])
    scores = rs.scores(s)
    assert scores["brightness"].tolist() == [0.0, 1.0]
    assert scores["colour"].tolist() == [0.0, 1.0]
    assert scores["think-chars"].tolist() == pytest.approx([0.6, 0.0])
    assert scores["think-length"].tolist() == pytest.approx([0.5, 0.0])
    assert scores["think-keyword"].tolist() == pytest.approx([0.4, 0.0])
    assert rs.total(scores).tolist() == pytest.approx([1.5, 3.0])
    with pytest.raises(ValueError):
        parse_reward("sharpness")
    with pytest.raises(ValueError):
        parse_reward("colour:1,0")


def test_tiny_defaults_are_valid_rollouts():
    from services.contract.rl import RolloutRequest
    RolloutRequest(prompts=[{"prompt": p} for p in TINY_DEFAULTS["prompts"]], group_size=TINY_DEFAULTS["group_size"],
                   size=TINY_DEFAULTS["size"], num_inference_steps=TINY_DEFAULTS["num_inference_steps"],
                   t_eps=TINY_DEFAULTS["t_eps"], timestep_shift=TINY_DEFAULTS["timestep_shift"])
