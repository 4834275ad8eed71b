"""CUDA only (skipped without a GPU; the lead runs it on an H200): a real `u1serve up --device cuda` stack on the tiny
checkpoint in bf16 (the stack's default dtype on CUDA); rollout log-probs equal `/v1/rl/score`'s under the same weights, for every SDE kind and with
CFG, and a replayed rollout is bit-exact.

Tolerance: 1e-3 absolute on the per-element-mean log-probs (docs/rl.md), though identical numbers are expected:
the score job runs the same forward (the same G rows, the same kernels) on the stored states, which are the bf16
states widened to fp32 and narrowed back exactly, and the log-prob is computed in fp32 from them. What bf16 could
move is one ULP of the velocity (2^-8 relative) in a few elements if a kernel picked another algorithm or
reduction split for the score's batch; such an element moves its term by ~xi * dt * dv / sigma ~ 1e-2 at most, and
the mean over 3 * 64 * 64 elements divides that by 12288, so anything above 1e-3 is a real mismatch (a different
conditioning, step or noise), not bf16 rounding."""
import httpx
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BODY = {"prompts": [{"prompt": "a red cat"}, {"prompt": "a blue dog"}], "group_size": 4, "size": "64x64",
        "num_inference_steps": 6, "guidance_scale": 3.0, "timestep_shift": 3.0, "seed": 21}
TOL = 1e-3


@pytest.fixture(scope="module")
def cuda_stack(tiny_checkpoint, tmp_path_factory):
    from tests.system.stackproc import RunningStack
    s = RunningStack(tiny_checkpoint("u1"), "colocate", str(tmp_path_factory.mktemp("rl-cuda")),
                     extra=["--device", "cuda", "--und-gpus", "0", "--enable-rl"])
    s.wait_ready()
    yield s
    s.stop_clean()


def post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(base + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def rows(logprobs: list) -> np.ndarray:
    return np.array([[np.nan if x is None else x for x in row] for row in logprobs], dtype=np.float64)


@pytest.mark.parametrize("sde", [{"kind": "flow", "noise_level": 0.7},
                                 {"kind": "flow", "noise_level": 0.7, "window": {"start": 1, "size": 2}},
                                 {"kind": "dance", "noise_level": 0.3},
                                 {"kind": "cps", "noise_level": 0.8}])
def test_bf16_rollout_logprobs_equal_score(cuda_stack, sde):
    body = {**BODY, "sde": sde}
    out = post(cuda_stack.base, "/v1/rl/rollout", body)
    lp = rows([s["logprobs"] for s in out["samples"]])
    assert np.isfinite(lp[:, out["sde_steps"]]).all()
    sc = post(cuda_stack.base, "/v1/rl/score", {**body, "trajectory_id": out["trajectory_id"]})
    got = rows(sc["logprobs"])
    diff = np.nanmax(np.abs(got - lp))
    print(f"{sde}: max |rollout - score| = {diff:.3g}")
    assert np.array_equal(np.isnan(got), np.isnan(lp)) and diff <= TOL, diff
    again = post(cuda_stack.base, "/v1/rl/rollout", body)                 # same seeds, same weights
    assert [s["logprobs"] for s in again["samples"]] == [s["logprobs"] for s in out["samples"]]
