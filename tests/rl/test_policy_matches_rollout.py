"""The trainer's differentiable copy recomputes the stack's rollout log-probs (ratio 1 before the first update,
rl_spec §7 N3): same prefixes, same guided velocity, same flow_sde transition, on CPU fp32 to 1e-5."""
import pytest
import torch

from services.rl.client import RLClient
from services.rl.policy import Policy
from services.rl.trainer import sampling_of

CASES = {
    # CFG on (two prefixes per prompt), every step but the last
    "flow-cfg": {"guidance_scale": 4.0, "sde": {"kind": "flow", "noise_level": 0.7}},
    "dance": {"guidance_scale": 1.0, "sde": {"kind": "dance", "noise_level": 0.3}, "same_initial_noise": True},
    "mix-window": {"guidance_scale": 3.0, "cfg_norm": "global", "sde": {"kind": "flow", "noise_level": 0.9,
                                                                        "window": {"start": 1, "size": 2}}},
}


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return Policy(tiny_checkpoint("u1"), "gen")


@pytest.fixture(scope="module")
def synced(rl_stack, policy):
    """The stack serving exactly the copy's weights (an earlier test may have trained it)."""
    import tempfile
    with RLClient(rl_stack.base) as c, tempfile.TemporaryDirectory() as d:
        policy.write_weights(d, everything=True)
        c.push_weights(d)
    return rl_stack


@pytest.mark.parametrize("case", sorted(CASES))
def test_copy_recomputes_rollout_logprobs(synced, policy, case):
    body = {"prompts": [{"prompt": "a red fox"}, {"prompt": "a blue boat"}], "group_size": 2, "size": "64x32",
            "num_inference_steps": 5, "timestep_shift": 3.0, "seed": 7, "return_images": False, **CASES[case]}
    with RLClient(synced.base) as c:
        resp = c.rollout(body)
        traj = c.trajectory(resp["trajectory_id"])
        c.delete_trajectory(resp["trajectory_id"])
    sampling = sampling_of(body)
    steps = resp["sde_steps"]
    assert traj.latents.shape == (4, 6, 3, 32, 64)
    pre = [policy.prefixes(p["prompt"], sampling) for p in body["prompts"]]
    with torch.no_grad():
        lp = policy.step_logprobs([pre[i // 2] for i in range(4)], traj.latents, traj.timesteps, steps,
                                  resp["noise_scale"], sampling)
    served = torch.tensor([[s["logprobs"][k] for k in steps] for s in resp["samples"]])
    assert torch.isfinite(served).all()
    assert (lp - served).abs().max() < 1e-5, (lp, served)
    assert torch.equal(traj.logprobs[:, steps], served)        # the blob and the JSON agree


def test_copy_gradients_reach_only_the_trained_branch(synced, policy):
    body = {"prompts": [{"prompt": "a red fox"}], "group_size": 2, "size": "32x32", "num_inference_steps": 3,
            "guidance_scale": 1.0, "seed": 3, "return_images": False}
    with RLClient(synced.base) as c:
        resp = c.rollout(body)
        traj = c.trajectory(resp["trajectory_id"])
    sampling = sampling_of(body)
    pre = policy.prefixes("a red fox", sampling)
    lp = policy.step_logprobs([pre, pre], traj.latents, traj.timesteps, resp["sde_steps"], resp["noise_scale"],
                              sampling)
    lp.sum().backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    assert grads and all("_mot_gen" in n or n.startswith("fm_modules.") for n in grads)
    assert any(g.abs().sum() > 0 for g in grads.values())
    policy.model.zero_grad(set_to_none=True)


def test_copy_recomputes_think_and_image_logprobs(synced, tiny_checkpoint):
    """MixGRPO's joint action: the sampled think tokens' log-probs (temperature-processed) and the image
    transitions conditioned on them, both recomputed by the copy (und branch trainable)."""
    policy = Policy(tiny_checkpoint("u1"), "both")
    think = {"enabled": True, "temperature": 1.3, "top_p": 1.0, "max_tokens": 6}
    body = {"prompts": [{"prompt": "a red fox"}], "group_size": 2, "size": "32x32", "num_inference_steps": 4,
            "guidance_scale": 2.0, "seed": 11, "return_images": False, "think": think,
            "sde": {"kind": "flow", "noise_level": 0.8, "window": {"start": 0, "size": 2}}}
    with RLClient(synced.base) as c:
        resp = c.rollout(body)
        traj = c.trajectory(resp["trajectory_id"])
        c.delete_trajectory(resp["trajectory_id"])
    sampling = sampling_of(body)
    ids = [s["think"]["token_ids"] for s in resp["samples"]]
    pres = policy.think_prefixes("a red fox", sampling, ids, think["temperature"], think["top_p"])
    for s, pre in zip(resp["samples"], pres):
        assert s["think"]["token_ids"] and len(s["think"]["token_ids"]) == len(s["think"]["logprobs"])
        served = torch.tensor(s["think"]["logprobs"])
        assert (pre["cond"].think_logprobs.detach() - served).abs().max() < 1e-5
    steps = resp["sde_steps"]
    assert steps == [0, 1]
    lp = policy.step_logprobs(pres, traj.latents, traj.timesteps, steps, resp["noise_scale"], sampling)
    served = torch.tensor([[s["logprobs"][k] for k in steps] for s in resp["samples"]])
    assert (lp.detach() - served).abs().max() < 1e-5
    lp.sum().backward()          # the image log-prob reaches the und branch through the think prefix
    und = [p.grad for n, p in policy.model.named_parameters() if n.startswith("language_model.model.layers.0.self_attn.k_proj.")]
    assert und[0] is not None and und[0].abs().sum() > 0
