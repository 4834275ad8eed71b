"""RL jobs in the generation engine, in process on the tiny checkpoint (generation/reference.py, rollout.py):

- the RL jobs of a step share one forward (image jobs another), and each rollout's log-probs, trajectory and
  final state are bit for bit those of the same rollout stepped alone, whether the groups start together or
  one joins the others' forward late; a score job sharing the forward with a rollout reproduces the stored
  trajectory's log-probs exactly;
- no step of a rollout reads anything back from the device (no `.item()`, `.tolist()`, `.cpu()`, ...): the
  recorded states go to the host trajectory buffer by copies that do not wait, and the job waits once, when
  its result is taken.

CPU by default; the same test runs on a CUDA device where one is present (bf16, CUDA graphs on as served; the
batched GEMMs are then per job, the shapes each job has alone)."""
from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.contract.rl import RolloutJobRequest, ScoreJobRequest
from services.generation.engine import Engine
from services.generation.reference import EngineSet
from tests.generation.genhelp import prefixes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SIZE, STEPS = 160, 4          # 25 tokens: on CUDA every group has more rows than the skinny GEMM takes
SDE = {"kind": "flow", "noise_level": 0.8}
GROUPS = {"g1": ("a red cat", [11, 12]), "g2": ("a blue dog", [21, 22, 23]), "g3": ("a red cat", [31])}


@pytest.fixture(scope="module", params=DEVICES)
def setup(request, tiny_dir):
    from services.model.loader import load_model
    from services.model.tokenizer import NeoTokenizer
    tok = NeoTokenizer.from_dir(tiny_dir)
    ref = (load_model(tiny_dir, "both"), tok)
    pre = {p: prefixes(ref, prompt=p, guidance_scale=3.0) for p, _ in GROUPS.values()}
    device = torch.device(request.param)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = load_model(tiny_dir, branch="gen", dtype=dtype, device=device)
    model.eval()
    return model, pre


def engines_of(model) -> EngineSet:
    """The worker's engine set; on CUDA its steps replay CUDA graphs as served (eager on the CPU)."""
    return EngineSet(Engine(model, prefix_source=None, cuda_graphs="auto"))


def _common(prompt_pre) -> dict:
    return {"handles": {b: {} for b in prompt_pre}, "width": SIZE, "height": SIZE, "num_inference_steps": STEPS,
            "guidance_scale": 3.0, "timestep_shift": 3.0, "seed": 0}


def rollout_spec(rid: str, pre: dict) -> RolloutJobRequest:
    prompt, seeds = GROUPS[rid]
    return RolloutJobRequest.model_validate({**_common(pre[prompt]), "request_id": rid, "n": len(seeds),
                                             "rl": {"sde": SDE, "seeds": seeds, "trajectory_id": "t-" + rid}})


def score_spec(rid: str, pre: dict, latents: np.ndarray) -> ScoreJobRequest:
    prompt, seeds = GROUPS[rid]
    return ScoreJobRequest.model_validate({**_common(pre[prompt]), "request_id": "score-" + rid, "n": len(seeds),
                                           "sde": SDE, "trajectory_id": "t-" + rid}).with_latents(latents)


def admit(engines: EngineSet, spec, pre: dict):
    kv = pre[GROUPS[spec.request_id.removeprefix("score-")][0]]
    job = engines.primary.admit_local(spec, {b: kv[b].kv for b in spec.handles},
                                      {b: kv[b].t_offset for b in spec.handles})
    engines.add(job)
    return job


def run(engines: EngineSet, joining: dict | None = None) -> tuple[dict, list[list[int]]]:
    """Step until nothing runs; `joining` {step: [(spec, pre)]} admits jobs before that step. Returns ({request_id:
    (log-probs, trajectory or None, final state)}, the rows of each forward of every step)."""
    out, forwards, k = {}, [], 0
    while engines.running or joining:
        for spec, pre in (joining or {}).pop(k, []):
            admit(engines, spec, pre)
        finished, _ = engines.step()
        forwards.append(list(engines.forwards))
        for job in finished:
            res = job.rl.results(job)
            out[job.request_id] = (res.logprobs, res.pixels, job.x.float().cpu().numpy())
            job.free()
        k += 1
    return out, forwards


def alone(model, pre, rid: str):
    engines = engines_of(model)
    admit(engines, rollout_spec(rid, pre), pre)
    got, forwards = run(engines)
    assert all(len(f) == 1 for f in forwards)
    return got[rid]


def same(a, b) -> None:
    assert a[0] == b[0]                                     # log-probs (Python floats, NaN-free: None on ODE steps)
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_groups_share_one_forward_with_the_bits_they_have_alone(setup):
    model, pre = setup
    want = {rid: alone(model, pre, rid) for rid in GROUPS}
    engines = engines_of(model)
    for rid in GROUPS:
        admit(engines, rollout_spec(rid, pre), pre)
    together, forwards = run(engines)
    tokens = (SIZE // 32) ** 2
    rows = sum(2 * len(seeds) * tokens for _, seeds in GROUPS.values())     # 2 CFG branches
    assert forwards == [[rows]] * STEPS                                        # one forward per step, every group
    for rid in GROUPS:
        same(together[rid], want[rid])
    # a group that joins the others' forward two steps late (a later prefix) has the same bits too
    engines = engines_of(model)
    admit(engines, rollout_spec("g1", pre), pre)
    late, forwards = run(engines, {2: [(rollout_spec("g2", pre), pre), (rollout_spec("g3", pre), pre)]})
    assert [len(f) for f in forwards] == [1] * (STEPS + 2)
    for rid in GROUPS:
        same(late[rid], want[rid])


def test_score_sharing_a_forward_reproduces_the_stored_logprobs(setup):
    model, pre = setup
    want = alone(model, pre, "g2")
    engines = engines_of(model)
    admit(engines, score_spec("g2", pre, want[1]), pre)
    admit(engines, rollout_spec("g1", pre), pre)
    got, forwards = run(engines)
    assert all(len(f) == 1 for f in forwards)
    sde_steps = [k for k, x in enumerate(want[0][0]) if x is not None]
    assert [[row[k] for k in sde_steps] for row in got["score-g2"][0]] == [[row[k] for k in sde_steps]
                                                                           for row in want[0]]


HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host: each a device -> host sync where the tensor is on a
    GPU. On the CPU every tensor is on the host, so there it counts the reads of floating-point tensors (states,
    velocities, log-probs), not of the integer row metadata the CPU attention reads by design (cu_seqlens)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        if func in HOST_READS and isinstance(t, torch.Tensor) and (t.is_cuda or t.is_floating_point()):
            caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                          if "/torch/" not in f.filename and not f.filename.endswith("row_blocks.py"))
            self.calls.append(f"{func.__name__} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


def test_rollout_steps_read_nothing_back_from_the_device(setup):
    model, pre = setup
    engines = engines_of(model)
    jobs = [admit(engines, rollout_spec(rid, pre), pre) for rid in GROUPS]
    reads = HostReads()
    with reads:
        while engines.running:
            engines.step()
    assert reads.calls == []
    with reads:
        for job in jobs:
            traj = job.rl.trajectory
            job.rl.results(job)
            assert traj.waits == (1 if model.device.type == "cuda" else 0)   # the copies' one wait, at the end
    assert {c.split()[0] for c in reads.calls} <= {"tolist", "cpu", "numpy"}
