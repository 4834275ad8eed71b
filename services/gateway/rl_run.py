"""RL rollouts and scores run on the stack (docs/rl.md). A rollout runs one image job per prompt (or per sample
when the prompt samples its own think text, rl_jobs.py) through the same orchestrator as /v1/images: one
understanding prefix, then a generation RL job of its G samples over those prefix pages (one batch). Every job of
a request goes to one generation replica, which keeps the trajectory in its store (trajectories.py remembers
which). A rollout that fails or whose client goes away is undone as an image job is (engines stopped, pages
released) and its trajectory deleted. Each function answers the response body, or None when the client went
away."""
from __future__ import annotations

import asyncio
import base64
import binascii
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request

from services.contract.rl import RolloutRequest, ScoreRequest, ThinkOptions
from services.kit.errors import APIError, bad_request, unavailable
from services.kit.web import until_disconnect

from .rl_jobs import ROLLOUT_PATH, SCORE_PATH, RLJob, check, input_images, own_salt, plan
from .state import GatewayState


@dataclass
class JobOutcome:
    """What one RL job gave: its rl_result event, its images by index, its sampled think text, its prefix time."""
    result: Optional[dict] = None
    images: dict[int, str] = field(default_factory=dict)
    think: Optional[dict] = None
    prefix_s: float = 0.0


async def _run_job(state: GatewayState, job: RLJob, pins: dict, after: Optional[asyncio.Event],
                   prefixed: asyncio.Event) -> JobOutcome:
    """Run one job. Its prefix starts once `after` is set (None: at once); `prefixed` is set when its prefix is
    done (or the job ended)."""
    out = JobOutcome()
    if after is not None:
        await after.wait()
    t0 = time.monotonic()
    run = state.orchestrator.run(job, state.deadline(), pins=dict(pins))
    try:
        async for ev in run:
            kind = ev.get("type")
            if kind == "think_done":
                prefixed.set()
                out.prefix_s = time.monotonic() - t0
                pre = ev.get("prefix") or {}
                if pre.get("think_token_ids") is not None:
                    out.think = {"text": ev.get("think_text") or "", "token_ids": pre["think_token_ids"],
                                 "logprobs": pre.get("think_logprobs") or []}
            elif kind == "image":
                out.images[int(ev.get("index", 0))] = ev.get("b64")
            elif kind == "rl_result":
                out.result = ev
    finally:
        prefixed.set()
        await run.aclose()
    if out.result is None:
        raise unavailable("generation ended the RL job without its result", code="upstream_protocol_error")
    return out


async def _run_all(request: Request, state: GatewayState, jobs: list[RLJob], gen_url: str,
                   one_prefix_at_a_time: bool) -> Optional[list[JobOutcome]]:
    """Every job on one generation replica, denoising concurrently; the first failure cancels the others (each
    undone by the orchestrator). None when the client went away. `one_prefix_at_a_time`: each prefix starts when
    the previous one is done, so no two prefixes of the request share a prefill batch (whose shape would change
    their last bits: replays are then bit-exact)."""
    pins = {"generation": gen_url}
    done = [asyncio.Event() for _ in jobs]

    async def work():
        tasks = [asyncio.ensure_future(_run_job(state, j, pins, done[i - 1] if one_prefix_at_a_time and i else None,
                                                done[i])) for i, j in enumerate(jobs)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    finished, results = await until_disconnect(request, work)
    return results if finished else None


def _one_version(results: list[JobOutcome]) -> str:
    versions = {r.result["weights_version"] for r in results}
    if len(versions) != 1:
        raise APIError(409, f"the weights changed during this request (versions {sorted(versions)}); retry it",
                       code="weights_changed")
    return versions.pop()


async def rollout(request: Request, state: GatewayState, body: RolloutRequest, *, rid: str, owner: str,
                  salt: Optional[str]) -> Optional[dict[str, Any]]:
    """G samples per prompt with the SDE sampler (the RolloutResponse body). `salt`: the caller's cache salt."""
    started, created = time.monotonic(), int(time.time())
    samplers = check(state.config, body, body.return_trajectory)
    images = await input_images(state.images, body)
    seeds = body.seed_grid(body.seed if body.seed is not None else random.randrange(0, 2**31))
    tid = f"traj-{uuid.uuid4().hex}" if body.return_trajectory else None
    G = body.group_size

    def extra(p: int, first: int, n: int) -> tuple[dict, int]:
        i = first - p * G
        return ({"seed": seeds[p][i], "output_format": body.output_format,
                 "rl": {"sde": body.sde.model_dump(exclude_none=True), "seeds": seeds[p][i:i + n],
                        "same_initial_noise": body.same_initial_noise, "trajectory_id": tid, "part": first,
                        "return_images": body.return_images, "owner": owner}}, n if body.return_images else 0)

    opts = body.think or ThinkOptions()

    def think(p: int, sample: int) -> dict:
        if not body.thinks(p):
            return {}
        return {"think": True, "think_temperature": opts.temperature, "think_top_p": opts.top_p,
                "think_seed": seeds[p][sample - p * G], "max_think_tokens": opts.max_tokens}

    jobs = plan(body, samplers, rid, images, own_salt(salt, rid), ROLLOUT_PATH, extra, think)
    gen_url = state.gen.pick().url
    results, version = None, None
    try:
        results = await _run_all(request, state, jobs, gen_url,
                                 not any(body.thinks(p) for p in range(len(body.prompts))))
        version = _one_version(results) if results is not None else None
    finally:
        if tid is not None and (results is None or version is None):   # failed, cancelled, or the client gone
            state.janitor.later(state.trajectories.delete(gen_url, tid, owner))
    if results is None:
        return None
    if tid is not None:
        state.trajectories.remember(tid, gen_url)
    first = results[0].result
    samples = []
    for job, res in zip(jobs, results):
        p = job.first_sample // G
        for k, lp in enumerate(res.result["logprobs"]):
            i = job.first_sample - p * G + k
            samples.append({"prompt_index": p, "sample_index": i, "seed": seeds[p][i],
                            "image": res.images.get(k), "logprobs": lp, "think": res.think})
    prefix_s = [r.prefix_s for r in results]
    return {"id": f"rl-{uuid.uuid4().hex[:24]}", "object": "rl.rollout", "created": created,
            "weights_version": version, "timesteps": first["timesteps"], "noise_scale": first["noise_scale"],
            "sde_steps": first["sde_steps"], "trajectory_id": tid, "samples": samples,
            "prefill": {"prefixes": len(jobs), "shared_by": max(j.n for j in jobs), "seconds": sum(prefix_s)},
            "usage": {"images": len(samples) if body.return_images else 0,
                      "denoise_steps": len(samples) * body.num_inference_steps},
            "timings": {"total_s": time.monotonic() - started, "prefill_max_s": max(prefix_s)}}


async def score(request: Request, state: GatewayState, body: ScoreRequest, *, rid: str, owner: str,
                salt: Optional[str]) -> Optional[dict[str, Any]]:
    """The per-step log-probs of a stored or uploaded trajectory (the ScoreResponse body)."""
    samplers = check(state.config, body)
    if body.think_token_ids is None and any(body.thinks(p) for p in range(len(body.prompts))):
        raise bad_request("scoring samples with think text needs their think_token_ids", param="think_token_ids")
    images = await input_images(state.images, body)
    uploaded = None
    if body.trajectory_b64 is not None:
        try:
            blob = base64.b64decode(body.trajectory_b64, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("trajectory_b64 is not base64", param="trajectory_b64") from None
        gen_url = state.gen.pick().url
        uploaded = tid = f"upload-{uuid.uuid4().hex}"
        await state.trajectories.upload(gen_url, tid, blob, owner)
    else:
        tid = body.trajectory_id
        gen_url = await state.trajectories.holder(tid, owner)

    def extra(p: int, first: int, n: int) -> tuple[dict, int]:
        return {"sde": body.sde.model_dump(exclude_none=True), "trajectory_id": tid, "part": first,
                "weights": body.weights, "owner": owner}, 0

    def think(p: int, sample: int) -> dict:
        ids = body.think_token_ids[sample] if body.think_token_ids is not None else None
        return {} if not ids else {"think": True, "think_token_ids": ids}

    jobs = plan(body, samplers, rid, images, own_salt(salt, rid), SCORE_PATH, extra, think)
    try:
        results = await _run_all(request, state, jobs, gen_url, body.think_token_ids is None)
    finally:
        if uploaded is not None:
            state.janitor.later(state.trajectories.delete(gen_url, uploaded, owner))
    if results is None:
        return None
    logprobs = [row for r in results for row in r.result["logprobs"]]
    return {"object": "rl.score", "weights_version": _one_version(results), "weights": body.weights,
            "logprobs": logprobs}
