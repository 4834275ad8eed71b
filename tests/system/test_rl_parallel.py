"""RL on a multi-rank generation engine (CFG-parallel 2 x sequence parallel 2: four ranks, both modes at once, one
stack to start; CPU, gloo) against the single-rank stack: the same seeds give the same rollout log-probs (1e-5, fp32 CPU), scoring reproduces them, and a live weight
update reaches every rank (the rollouts of both stacks agree again under the new weights, which they would not if
a rank kept the old ones: with CFG-parallel rank 1 computes the unconditional branch, with SP half the tokens)."""
import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.model import weights_io as W
from services.model.loader import load_model
from services.rl.client import RLClient

BODY = {"prompts": [{"prompt": "a red cat"}, {"prompt": "a blue dog"}], "group_size": 2, "size": "64x64",
        "num_inference_steps": 4, "guidance_scale": 2.0, "timestep_shift": 3.0, "seed": 9,
        "sde": {"kind": "flow", "noise_level": 0.7, "window": {"start": 1, "size": 2}}}
GEN_KEY = "language_model.model.layers.0.mlp_mot_gen.down_proj.weight"


@pytest.fixture(scope="module", params=[["--gen-cfg-parallel", "2", "--gen-sp", "2"]], ids=["cfgp2-sp2"])
def par_stack(request, tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import RunningStack
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("rl-par")),
                     extra=[*request.param, "--enable-rl", "--allowed-local-dirs", "/tmp"])
    s.wait_ready()
    yield s
    s.stop_clean()


def rollout(base: str, **kw) -> dict:
    r = httpx.post(base + "/v1/rl/rollout", json={**BODY, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(out: dict) -> np.ndarray:
    return np.array([[np.nan if x is None else x for x in s["logprobs"]] for s in out["samples"]], dtype=np.float64)


def push(base: str, path: str, version: str) -> None:
    r = httpx.post(base + "/v1/rl/weights", json={"path": path, "version": version}, timeout=120)
    assert r.status_code == 200 and r.json()["weights_version"] == version, r.text


def score(base: str, tid: str) -> np.ndarray:
    r = httpx.post(base + "/v1/rl/score", json={**BODY, "trajectory_id": tid}, timeout=300)
    assert r.status_code == 200, r.text
    return logprobs({"samples": [{"logprobs": row} for row in r.json()["logprobs"]]})


def test_multi_rank_rollout_score_and_update_match_one_rank(stack, par_stack, tiny_checkpoint, tmp_path):
    one, par = rollout(stack.base), rollout(par_stack.base)
    np.testing.assert_allclose(logprobs(par), logprobs(one), atol=1e-5, rtol=0)
    assert par["sde_steps"] == one["sde_steps"] == [1, 2]
    with RLClient(stack.base) as a, RLClient(par_stack.base) as b:     # the states themselves agree
        torch.testing.assert_close(b.trajectory(par["trajectory_id"]).latents,
                                   a.trajectory(one["trajectory_id"]).latents, atol=1e-5, rtol=0)
    np.testing.assert_allclose(score(par_stack.base, par["trajectory_id"]), logprobs(par), atol=1e-5, rtol=0)
    # a live update on both stacks, then both back to the checkpoint (the single-rank stack is shared)
    base = W.checkpoint_state(load_model(tiny_checkpoint("u1"), "gen"))[GEN_KEY]
    new = base + 0.3 * torch.randn(base.shape, generator=torch.Generator().manual_seed(3))
    save_file({GEN_KEY: new.contiguous()}, str(tmp_path / "new.safetensors"))
    (tmp_path / "old").mkdir()
    save_file({GEN_KEY: base.contiguous()}, str(tmp_path / "old" / "old.safetensors"))
    (tmp_path / "new").mkdir()
    (tmp_path / "new.safetensors").rename(tmp_path / "new" / "new.safetensors")
    try:
        for s in (stack, par_stack):
            push(s.base, str(tmp_path / "new"), "par-1")
        # a sampled transition's own log-prob does not depend on the weights (it is that of the drawn noise), so
        # the update shows in the scores of the earlier trajectories under the new weights
        s1, s2 = score(stack.base, one["trajectory_id"]), score(par_stack.base, par["trajectory_id"])
        assert np.nanmax(np.abs(s1 - logprobs(one))) > 1e-3                  # the update changed the numbers
        np.testing.assert_allclose(s2, s1, atol=1e-5, rtol=0)
        assert rollout(par_stack.base)["weights_version"] == "par-1"
    finally:
        for s in (stack, par_stack):
            push(s.base, str(tmp_path / "old"), "0")
