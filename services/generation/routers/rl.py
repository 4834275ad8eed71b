"""Generation's internal RL routes (docs/rl.md): rollout and score jobs, and the trajectory store.

    POST   /internal/rl/rollout              RolloutJobRequest -> SSE: queued, progress..., image... (when asked),
                                             rl_result (log-probs, grid, weights version), [DONE]
    POST   /internal/rl/score                ScoreJobRequest   -> SSE: queued, progress..., rl_result, [DONE]
    GET    /internal/rl/trajectories/{id}    safetensors bytes (trajectory_store.py); .../info: its size
    POST   /internal/rl/trajectories/{id}    store an uploaded trajectory (safetensors bytes)
    DELETE /internal/rl/trajectories/{id}

The jobs are ordinary engine jobs (one batch of n samples over one set of prefix handles); the rollout's
trajectory arrives as the raw frame of its `rl` event and goes into the store under (trajectory_id, part).
Step caching is off for RL jobs (a reused residual is not the policy's velocity).
"""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from services.contract.image import CacheOptions
from services.contract.rl import RolloutJobRequest, ScoreJobRequest
from services.kit import sse
from services.kit.errors import APIError, bad_request, from_validation
from services.kit.logsafe import safe
from services.kit.web import json_body

from ..encode import encode_image
from ..image_limits import size_error
from ..inputs import check_handles, handles_of
from ..trajectory_store import Part, TrajectoryStore, not_found

log = logging.getLogger("u1serve.generation.rl")
MAX_UPLOAD_BYTES = 64 << 20


def add_rl_flags(p) -> None:
    p.add_argument("--rl-reference", choices=["on", "off"], default="on",
                   help="RL scoring against a frozen copy of the start weights (loaded on first use: one more "
                        "copy of the gen branch in device memory)")
    p.add_argument("--rl-trajectory-store-mb", type=float, default=4096.0,
                   help="host memory for rollout trajectories (LRU by bytes)")


def install(app, *, engine, keeper, args, fingerprint, max_tokens, encoder, reject) -> TrajectoryStore:
    store = TrajectoryStore(int(args.rl_trajectory_store_mb * (1 << 20)))
    app.state.trajectories = store

    def parse(model, body):
        try:
            job = model.model_validate(body)
        except ValidationError as exc:
            raise from_validation(exc.errors()) from None
        job.cache = CacheOptions()
        job.partial_images = 0
        too_big = size_error(job.width, job.height, max_tokens)
        if too_big:
            raise bad_request(too_big, param="size", code="invalid_size")
        check_handles(job, fingerprint)
        return job

    async def run(request: Request, job, on_rl) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(ev: dict) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:
                pass

        try:
            engine.submit(job, deliver)
        except APIError as err:
            raise reject(err, job.request_id, list(job.handles.values())) from None
        return StreamingResponse(_stream(job, events, loop, on_rl), media_type="text/event-stream",
                                 headers=sse.HEADERS)

    async def _stream(job, events: asyncio.Queue, loop, on_rl):
        started, outcome = time.monotonic(), "disconnected"
        try:
            yield sse.encode({"type": "queued"})
            while True:
                ev = await events.get()
                kind = ev.get("type")
                if kind == "end":
                    break
                if kind == "progress":
                    yield sse.encode({"type": "progress", "step": ev["step"], "total": ev["total"]})
                elif kind == "image":
                    b64 = await loop.run_in_executor(encoder, encode_image, ev["pixels"], job.output_format)
                    yield sse.encode({"type": "image", "index": ev["index"], "b64": b64,
                                      "format": job.output_format, "width": job.width, "height": job.height})
                elif kind == "rl":
                    try:
                        yield sse.encode(on_rl(job, ev))
                    except APIError as err:
                        outcome = str(err.code)
                        engine.cancel(job.request_id, "trajectory refused")
                        yield sse.encode(err.event())
                elif kind == "error":
                    outcome = str(ev.get("error", {}).get("code") or "error")
                    yield sse.encode(ev)
            if outcome == "disconnected":
                outcome = "ok"
            yield sse.encode(sse.DONE)
        finally:
            if outcome == "disconnected":
                engine.cancel(job.request_id, "client disconnected")
            log.info("rl job %s %s in %.2fs", safe(job.request_id), outcome, time.monotonic() - started)

    def result(ev: dict) -> dict:
        return {"type": "rl_result", **{k: ev[k] for k in ("logprobs", "timesteps", "sde_steps", "noise_scale",
                                                            "weights_version")}}

    def on_rollout(job: RolloutJobRequest, ev: dict) -> dict:
        frame = ev.get("pixels")
        if job.rl.trajectory_id is not None and frame is not None:
            lp = np.array([[np.nan if x is None else x for x in row] for row in ev["logprobs"]], dtype=np.float32)
            meta = {k: ev[k] for k in ("timesteps", "sde_steps", "noise_scale", "weights_version")}
            meta.update(samples=[{"seed": s, "part": job.rl.part} for s in job.rl.seeds], kind=job.rl.sde.kind,
                        noise_level=job.rl.sde.noise_level, guidance_scale=job.guidance_scale,
                        timestep_shift=job.timestep_shift, t_eps=job.t_eps, cfg_norm=job.cfg_norm,
                        width=job.width, height=job.height)
            store.put(job.rl.trajectory_id, job.rl.part, Part(np.array(frame, dtype=np.float32), lp, meta))
        return result(ev)

    @app.post("/internal/rl/rollout")
    async def rollout(request: Request):
        body = await json_body(request)
        try:
            job = parse(RolloutJobRequest, body)
        except APIError as err:
            raise reject(err, body.get("request_id") if isinstance(body, dict) else None,
                         handles_of(body)) from None
        return await run(request, job, on_rollout)

    @app.post("/internal/rl/score")
    async def score(request: Request):
        body = await json_body(request)
        try:
            job = parse(ScoreJobRequest, body)
            if job.weights == "reference" and args.rl_reference != "on":
                raise APIError(400, "this stack runs without a reference model (--rl-reference off)",
                               param="weights", code="reference_unavailable")
            job.with_latents(store.latents(job.trajectory_id, job.part, job.n, job.num_inference_steps,
                                           job.height, job.width))
        except APIError as err:
            raise reject(err, body.get("request_id") if isinstance(body, dict) else None,
                         handles_of(body)) from None
        return await run(request, job, lambda _job, ev: result(ev))

    @app.get("/internal/rl/trajectories/{tid}")
    async def get_trajectory(tid: str):
        blob = await asyncio.to_thread(store.to_safetensors, tid)
        return Response(blob, media_type="application/octet-stream")

    @app.get("/internal/rl/trajectories/{tid}/info")
    async def trajectory_info(tid: str):
        traj = store.get(tid)
        return {"trajectory_id": tid, "parts": len(traj.parts), "bytes": traj.nbytes}

    @app.post("/internal/rl/trajectories/{tid}")
    async def put_trajectory(tid: str, request: Request):
        blob = await request.body()
        if len(blob) > MAX_UPLOAD_BYTES:
            raise APIError(413, f"trajectory larger than {MAX_UPLOAD_BYTES} bytes", code="request_too_large")
        samples = await asyncio.to_thread(store.put_safetensors, tid, blob)
        return {"trajectory_id": tid, "samples": samples}

    @app.delete("/internal/rl/trajectories/{tid}")
    async def delete_trajectory(tid: str):
        if not store.delete(tid):
            raise not_found(tid)
        return JSONResponse({"trajectory_id": tid, "deleted": True})

    return store
