"""Generation's internal RL routes (docs/rl.md): rollout and score jobs, and the trajectory store.

    POST   /internal/rl/rollout              RolloutJobRequest -> SSE: queued, progress..., image... (when asked),
                                             rl_result (log-probs, grid, weights version), [DONE]
    POST   /internal/rl/score                ScoreJobRequest   -> SSE: queued, progress..., rl_result, [DONE]
    GET    /internal/rl/trajectories/{id}    safetensors bytes, streamed, Range honoured (trajectory_store.py);
                                             .../info: its size
    POST   /internal/rl/trajectories/{id}    store an uploaded trajectory (safetensors bytes)
    DELETE /internal/rl/trajectories/{id}

The jobs are ordinary engine jobs (one batch of n samples over one set of prefix handles), streamed by
job_stream.RlJobStream; the rollout's trajectory arrives as the shared-memory segment its RlResult names, mapped by
this process (shared_trajectory.py), and goes into the store (state.trajectories) under (trajectory_id, part): the
mapping is the stored array, no copy.
Step caching is off for RL jobs (a reused residual is not the policy's velocity).
"""
from __future__ import annotations

import asyncio
import logging
import re

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from services.contract.image import CacheOptions
from services.contract.rl import (MAX_TRAJECTORY_UPLOAD_BYTES, OPEN_OWNER, OWNER_HEADER, OWNER_PATTERN,
                                  RolloutJobRequest, ScoreJobRequest)
from services.kit.errors import APIError, from_validation
from services.kit.ranges import byte_range
from services.kit.streaming import OwnedStream
from services.kit.web import json_body

from ..inputs import check_handles, handles_of
from ..job_stream import RlJobStream
from ..protocol import RlResult
from ..shared_trajectory import release
from ..state import GenerationState, app_state
from ..trajectory_store import Part, not_found

log = logging.getLogger("u1serve.generation.rl")
MAX_UPLOAD_BYTES = MAX_TRAJECTORY_UPLOAD_BYTES
_OWNER = re.compile(OWNER_PATTERN)

router = APIRouter()


def _parse(st: GenerationState, model, body, check=lambda job: None):
    """The job of a body (a refusal frees the body's handles): validated, step caching and previews off, the
    size and handle checks, then `check(job)`."""
    try:
        try:
            job = model.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc.errors()) from None
        job.cache = CacheOptions()
        job.partial_images = 0
        st.check_size(job)
        check_handles(job, st.fingerprint)
        check(job)
    except APIError as err:
        raise st.reject(err, body.get("request_id") if isinstance(body, dict) else None, handles_of(body)) from None
    return job


def _respond(st: GenerationState, job, on_result):
    try:
        return RlJobStream(st, job, on_result).respond()
    except APIError as err:
        raise st.reject(err, job.request_id, list(job.handles.values())) from None


def _store_rollout(st: GenerationState, job: RolloutJobRequest, ev: RlResult) -> None:
    """The rollout's trajectory into the store, when it asked for one (the store then owns its segment)."""
    if job.rl.trajectory_id is None or ev.pixels is None:
        release(ev)
        return
    lp = np.array([[np.nan if x is None else x for x in row] for row in ev.logprobs], dtype=np.float32)
    meta = {"timesteps": ev.timesteps, "sde_steps": ev.sde_steps, "noise_scale": ev.noise_scale,
            "weights_version": ev.weights_version}
    meta.update(samples=[{"seed": s, "part": job.rl.part} for s in job.rl.seeds], kind=job.rl.sde.kind,
                noise_level=job.rl.sde.noise_level, guidance_scale=job.guidance_scale,
                timestep_shift=job.timestep_shift, t_eps=job.t_eps, cfg_norm=job.cfg_norm,
                width=job.width, height=job.height)
    st.trajectories.put(job.rl.trajectory_id, job.rl.part,
                        Part(np.asarray(ev.pixels, dtype=np.float32), lp, meta, shared=ev.mapping), job.rl.owner)


def trajectory_bytes(n: int, steps: int, width: int, height: int) -> int:
    """What a part of n samples takes in the store: latents f32 [n, N+1, 3, H, W] and log-probs f32 [n, N]."""
    return 4 * n * ((steps + 1) * 3 * width * height + steps)


def _owner(request: Request) -> str:
    """The owner the gateway names for a trajectory route (contract.rl.OWNER_HEADER; none: the keyless owner)."""
    owner = request.headers.get(OWNER_HEADER, OPEN_OWNER)
    if not _OWNER.fullmatch(owner):
        raise APIError(400, f"bad {OWNER_HEADER} header", code="invalid_owner")
    return owner


@router.post("/internal/rl/rollout")
async def rollout(request: Request):
    st = app_state(request)

    def fits(job: RolloutJobRequest) -> None:        # before any step runs: a trajectory that cannot be kept
        if job.rl.trajectory_id is not None:
            st.trajectories.check_fits(trajectory_bytes(job.n, job.num_inference_steps, job.width, job.height))
    job = _parse(st, RolloutJobRequest, await json_body(request), fits)
    return _respond(st, job, lambda job, ev: _store_rollout(st, job, ev))


@router.post("/internal/rl/score")
async def score(request: Request):
    st = app_state(request)

    def check(job: ScoreJobRequest) -> None:
        if job.weights == "reference" and st.cfg.rl_reference != "on":
            raise APIError(400, "this stack runs without a reference model (--rl-reference off)",
                           param="weights", code="reference_unavailable")
        job.with_latents(st.trajectories.latents(job.trajectory_id, job.part, job.n, job.num_inference_steps,
                                                 job.height, job.width, job.owner))
    return _respond(st, _parse(st, ScoreJobRequest, await json_body(request), check), lambda job, ev: None)


@router.get("/internal/rl/trajectories/{tid}")
async def get_trajectory(tid: str, request: Request):
    """The safetensors bytes streamed from the stored arrays (no copy of the latents), one `Range: bytes=a-b`
    honoured (206) so a trainer can resume a cut fetch. A DELETE meanwhile does not cut the stream: its reader
    holds the arrays until the stream ends (trajectory_store.Reader)."""
    reader = app_state(request).trajectories.reader(tid, _owner(request))
    try:
        size = reader.blob.size
        span = byte_range(request.headers.get("range"), size)
    except APIError:
        reader.close()
        raise
    headers = {"accept-ranges": "bytes"}
    if span is None:
        start, end, status = 0, size, 200
    else:
        start, end, status = span[0], span[1], 206
        headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
    headers["content-length"] = str(end - start)

    async def body():
        for chunk in reader.chunks(start, end):
            yield chunk

    async def closed() -> None:
        reader.close()
    return OwnedStream(body(), closed, media_type="application/octet-stream", headers=headers, status_code=status)


@router.get("/internal/rl/trajectories/{tid}/info")
async def trajectory_info(tid: str, request: Request):
    traj = app_state(request).trajectories.get(tid, _owner(request))
    return {"trajectory_id": tid, "parts": len(traj.parts), "bytes": traj.nbytes}


@router.post("/internal/rl/trajectories/{tid}")
async def put_trajectory(tid: str, request: Request):
    owner = _owner(request)
    blob = await request.body()
    if len(blob) > MAX_UPLOAD_BYTES:
        raise APIError(413, f"trajectory larger than {MAX_UPLOAD_BYTES} bytes", code="request_too_large")
    samples = await asyncio.to_thread(app_state(request).trajectories.put_safetensors, tid, blob, owner)
    return {"trajectory_id": tid, "samples": samples}


@router.delete("/internal/rl/trajectories/{tid}")
async def delete_trajectory(tid: str, request: Request):
    if not app_state(request).trajectories.delete(tid, _owner(request)):
        raise not_found(tid)
    return JSONResponse({"trajectory_id": tid, "deleted": True})
