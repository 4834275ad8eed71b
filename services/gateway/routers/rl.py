"""RL on the serving stack (docs/rl.md): POST /v1/rl/rollout, POST /v1/rl/score, GET / DELETE
/v1/rl/trajectories/{id}. The requests as jobs: rl_jobs.py; running them: rl_run.py; the stored trajectories:
trajectories.py.
"""
from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from services.contract.rl import RolloutRequest, RolloutResponse, ScoreRequest, ScoreResponse
from services.kit.streaming import OwnedStream
from services.kit.web import ParsedJsonRoute

from ..context import cache_salt, caller_identity, gateway, request_id
from ..relay import client_gone
from ..rl_run import rollout as run_rollout, score as run_score
from ..schemas import ERRORS
from ..state import GatewayState
from ..trajectories import engine_error

router = APIRouter(tags=["rl"], route_class=ParsedJsonRoute)
ROLLOUT_EXAMPLE = {"model": "sensenova-u1", "prompts": [{"prompt": "a red cube on a table"}], "group_size": 4,
                   "size": "512x512", "num_inference_steps": 10, "guidance_scale": 4.0,
                   "sde": {"kind": "flow", "noise_level": 0.7, "window": {"start": 0, "size": 3}}, "seed": 42}
SCORE_EXAMPLE = {"prompts": [{"prompt": "a red cube on a table"}], "group_size": 4, "size": "512x512",
                 "num_inference_steps": 10, "guidance_scale": 4.0,
                 "sde": {"kind": "flow", "noise_level": 0.7, "window": {"start": 0, "size": 3}},
                 "trajectory_id": "traj-0123abcd", "weights": "reference"}


RL_ERRORS = {**ERRORS, 409: ERRORS[400] | {"description": "the weights changed during the request (retry)"}}


@router.post("/v1/rl/rollout", response_model=RolloutResponse, responses=RL_ERRORS)
async def rollout(request: Request, body: RolloutRequest = Body(openapi_examples={"flow": {"value": ROLLOUT_EXAMPLE}}),
                  state: GatewayState = Depends(gateway)):
    """G samples per prompt with the SDE sampler: per sample the image, the per-step transition log-probs and
    the seed; the trajectory z_0..z_N as a handle (GET /v1/rl/trajectories/{id}); the weights version. The G
    samples of a prompt share one prefix prefill unless they sample their own think text."""
    out = await run_rollout(request, state, body, rid=request_id(request), owner=caller_identity(request).owner,
                            salt=cache_salt(request, state, None))
    return client_gone() if out is None else out


@router.post("/v1/rl/score", response_model=ScoreResponse,
             responses={**RL_ERRORS, 404: ERRORS[400] | {"description": "unknown or evicted trajectory"}})
async def score(request: Request, body: ScoreRequest = Body(openapi_examples={"reference": {"value": SCORE_EXAMPLE}}),
                state: GatewayState = Depends(gateway)):
    """Recompute the per-step transition log-probs of a stored (trajectory_id) or uploaded (trajectory_b64,
    safetensors) trajectory under the current weights or the frozen reference; the request repeats the
    rollout's prompts and sampling fields. ODE steps are null."""
    out = await run_score(request, state, body, rid=request_id(request), owner=caller_identity(request).owner,
                          salt=cache_salt(request, state, None))
    return client_gone() if out is None else out


TRAJECTORY_DOC = {200: {"description": "safetensors bytes (streamed, Content-Length set): latents f32 [S, N+1, 3, H, W], timesteps f32 [N+1], "
                                       "logprobs f32 [S, N] (NaN on ODE steps), sde_mask u8 [N]; metadata "
                                       "'u1serve' = JSON of the rollout parameters and weights_version",
                        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                  206: {"description": "the bytes of the one range asked (`Range: bytes=a-b`), with Content-Range",
                        "headers": {"Content-Range": {"description": "bytes FIRST-LAST/SIZE",
                                                      "schema": {"type": "string"}}},
                        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                  404: ERRORS[400] | {"description": "unknown or evicted trajectory"},
                  416: ERRORS[400] | {"description": "the range lies past the end",
                                      "headers": {"Content-Range": {"description": "bytes */SIZE",
                                                                    "schema": {"type": "string"}}}}}


RANGE_HEADERS = ("content-range", "accept-ranges")       # a 206's, and a 416's `Content-Range: bytes */SIZE`


@router.get("/v1/rl/trajectories/{trajectory_id}", response_class=Response, responses=TRAJECTORY_DOC)
async def get_trajectory(trajectory_id: str, request: Request, state: GatewayState = Depends(gateway)):
    """A rollout's trajectory as safetensors bytes (application/octet-stream), streamed; one `Range: bytes=a-b`
    is honoured (206 Partial Content) to resume a cut download."""
    owner = caller_identity(request).owner
    fetches = state.rl_fetches
    fetches.acquire()                   # 429 beyond --rl-max-trajectory-fetches relays at once
    try:
        session, r = await state.trajectories.open_download(trajectory_id, owner, request.headers.get("range"))
    except BaseException:
        fetches.release()
        raise

    async def close() -> None:
        try:
            r.release()
            await session.close()
        finally:
            fetches.release()
    ranges = {k: r.headers[k] for k in RANGE_HEADERS if k in r.headers}
    if r.status not in (200, 206):
        try:
            raise engine_error(r.status, await r.read(), ranges)
        finally:
            await close()
    # Relayed as read: the next upstream read waits for the client to take the last chunk (bounded memory), and
    # a client that goes away closes the upstream response (OwnedStream runs `close` however the stream ends).
    return OwnedStream(r.content.iter_any(), close, media_type="application/octet-stream", status_code=r.status,
                       headers={**ranges, "content-length": r.headers["content-length"]})


@router.delete("/v1/rl/trajectories/{trajectory_id}", responses={404: ERRORS[400]})
async def delete_trajectory(trajectory_id: str, request: Request, state: GatewayState = Depends(gateway)):
    """Free a stored trajectory."""
    await state.trajectories.delete_known(trajectory_id, caller_identity(request).owner)
    return {"trajectory_id": trajectory_id, "deleted": True}
