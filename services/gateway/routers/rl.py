"""RL on the serving stack (docs/rl.md): POST /v1/rl/rollout, POST /v1/rl/score, GET / DELETE
/v1/rl/trajectories/{id}.

A rollout runs one image job per prompt (or per sample when the prompt samples its own think text) through the
same orchestrator as /v1/images: one understanding prefix, then a generation RL job of its G samples over those
prefix pages (one batch). Every job of a request goes to one generation replica, which keeps the trajectory in
its store; the gateway remembers which replica holds which trajectory. A rollout that fails or whose client
goes away is undone as an image job is (engines stopped, pages released) and its trajectory deleted.
"""
from __future__ import annotations

import asyncio
import json
import base64
import binascii
import hashlib
import collections
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
import httpx
from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from services.contract.image import PrefixRequest
from services.contract.rl import (OWNER_HEADER, RolloutJobRequest, RolloutRequest, RolloutResponse, ScoreJobRequest,
                                  ScoreRequest, ScoreResponse, ThinkOptions, check_trajectory_id)
from services.kit.errors import APIError, bad_request, unavailable
from services.kit.streaming import OwnedStream
from services.kit.web import ParsedJsonRoute, until_disconnect

from ..context import cache_salt, caller_identity, gateway, request_id
from ..jobs import ImageJob
from ..schemas import ERRORS
from ..state import GatewayState
from ..upstream import CONTROL_TIMEOUT_S, engine_headers

router = APIRouter(tags=["rl"], route_class=ParsedJsonRoute)
MAX_REMEMBERED_TRAJECTORIES = 4096
TRAJECTORY_READ_TIMEOUT_S = 300.0       # between two chunks of a trajectory from generation
RELAY_READ_BYTES = 4 << 20              # the largest chunk the trajectory relay reads from generation at once


# ------------------------------------------------------------------------------------------ jobs
@dataclass(frozen=True)
class RLJob(ImageJob):
    """One prefix + one generation RL job (rollout or score) of `n` samples; duck-types ImageJob for the
    orchestrator."""
    path: str = "/internal/rl/rollout"
    images: int = 0
    first_sample: int = 0

    def generate_path(self) -> str:
        return self.path

    def expected_images(self) -> int:
        return self.images

    def generate_body(self, handles: dict) -> dict[str, Any]:
        model = RolloutJobRequest if self.path.endswith("rollout") else ScoreJobRequest
        try:
            return model(**self.generate, handles=handles).model_dump(mode="json", exclude={"cache"})
        except ValidationError as exc:
            raise APIError(502, f"understanding service sent handles that do not fit the job: "
                           f"{exc.errors()[0]['msg']}", code="upstream_protocol_error") from None


def _sampling_fields(req, w: int, h: int, mode: str) -> dict:
    return {"mode": mode, "width": w, "height": h, "num_inference_steps": req.num_inference_steps,
            "guidance_scale": req.guidance_scale, "image_guidance_scale": req.image_guidance_scale,
            "timestep_shift": req.timestep_shift, "t_eps": req.t_eps, "cfg_norm": req.cfg_norm}


def _check(state: GatewayState, req, stores_trajectory: bool = False) -> tuple[int, int]:
    """The request against the server's limits, before any job starts: size, steps, prompts, the compute
    (samples x steps x pixels) and, for a rollout that keeps one, its trajectory's bytes."""
    cfg = state.config
    w, h = req.width_height
    samples, steps = len(req.prompts) * req.group_size, req.num_inference_steps
    if samples * steps * w * h > cfg.rl_max_pixel_steps:
        raise APIError(413, f"this request asks for {samples} samples x {steps} steps x {w * h} pixels; this "
                       f"server takes at most {cfg.rl_max_pixel_steps} (--rl-max-pixel-steps)",
                       param="num_inference_steps", code="rl_compute_too_large")
    traj = 4 * samples * ((steps + 1) * 3 * w * h + steps)
    if stores_trajectory and traj > cfg.rl_max_trajectory_bytes:
        raise APIError(413, f"this rollout's trajectory would take {traj} bytes; this server keeps at most "
                       f"{cfg.rl_max_trajectory_bytes} (--rl-max-trajectory-mb): fewer samples, steps or pixels, "
                       "or return_trajectory=false", param="return_trajectory", code="trajectory_too_large")
    problem = cfg.size_problem(w, h)
    if problem:
        raise bad_request(f"unsupported size {w}x{h}: {problem}", param="size", code="invalid_size")
    if req.num_inference_steps > cfg.max_steps:
        raise bad_request(f"num_inference_steps: at most {cfg.max_steps} on this server",
                          param="num_inference_steps")
    for i, p in enumerate(req.prompts):
        if len(p.prompt) > cfg.max_prompt_chars:
            raise bad_request(f"prompts[{i}].prompt: at most {cfg.max_prompt_chars} characters on this server",
                              param=f"prompts[{i}].prompt", code="prompt_too_long")
    return w, h


async def _inputs(state: GatewayState, req) -> list[list[str]]:
    """Each prompt's input images, checked and re-encoded as the images API does."""
    out = []
    for i, p in enumerate(req.prompts):
        if not p.images:
            out.append([])
            continue
        checked = await state.images.check([(f"prompts[{i}].images[{k}]", im) for k, im in enumerate(p.images)])
        out.append([c.b64 for c in checked])
    return out


def _prefix(rid: str, req, p: int, images: list[str], salt: Optional[str], think: dict) -> PrefixRequest:
    return PrefixRequest(request_id=rid, mode="edit" if images else "t2i", prompt=req.prompts[p].prompt,
                         images=images, guidance_scale=req.guidance_scale,
                         image_guidance_scale=req.image_guidance_scale, stream=True, cache_salt=salt,
                         **{"think": False, **think})


def _plan(req, rid: str, images: list[list[str]], salt: Optional[str], path: str, extra, think) -> list[RLJob]:
    """The jobs of a request: per prompt one job of G samples, or G jobs of one sample when the prompt's samples
    have their own think text (each sample its own prefix; the radix cache shares the prompt's pages).
    `extra(p, first, n)`: (the job's RL fields, images it returns); `think(p, sample)`: the prefix's think fields
    (empty: one shared prefix without think)."""
    w, h = req.width_height
    G, jobs = req.group_size, []
    for p in range(len(req.prompts)):
        mode = "edit" if images[p] else "t2i"
        own_think = any(think(p, p * G + i) for i in range(G))
        groups = [(p * G + i, 1) for i in range(G)] if own_think else [(p * G, G)]
        for first, n in groups:
            jrid = f"{rid}-rl{first}"
            own, expected_images = extra(p, first, n)
            fields = {**_sampling_fields(req, w, h, mode), "request_id": jrid, "n": n, **own}
            # a cache domain per prompt: no prompt reads another's pages (see _own_salt)
            psalt = f"{salt}-{p}" if salt else None
            jobs.append(RLJob(_prefix(jrid, req, p, images[p], psalt, think(p, first) if own_think else {}), fields,
                              "b64_json", False, path=path, images=expected_images, first_sample=first))
    return jobs


def _own_salt(request: Request, state: GatewayState, rid: str) -> str:
    """A prefix-cache domain of this request alone (and _plan gives each prompt its own inside it): every prefix is
    computed the same way, cold, never partly from the radix cache, whose reused and recomputed tokens differ from
    a full prefill in the last bits. One domain per request was not enough: the prompts' unconditional prefixes
    are the same tokens, so prompt 2's read prompt 1's pages or not depending on whether those were in the radix
    tree yet when it started (timing: a loaded machine gave prompt 2's samples other bits, ~1e-7, in 1 of 6
    replays); a replayed rollout now gets the same prefix KV and the same trajectory bit for bit."""
    seen = f"{cache_salt(request, state, None) or ''}\0{rid}".encode()
    return "rl-" + hashlib.sha256(seen).hexdigest()[:32]


# ------------------------------------------------------------------------------------------ running
class Placement:
    """Which generation replica holds which trajectory (LRU-bounded; a gateway restart falls back to asking
    every replica)."""

    def __init__(self) -> None:
        self._where: collections.OrderedDict[str, str] = collections.OrderedDict()

    def remember(self, tid: str, url: str) -> None:
        self._where[tid] = url
        self._where.move_to_end(tid)
        while len(self._where) > MAX_REMEMBERED_TRAJECTORIES:
            self._where.popitem(last=False)

    def candidates(self, tid: str, state: GatewayState) -> list[str]:
        known = self._where.get(tid)
        urls = [e.url for e in state.gen.endpoints]
        return [known] + [u for u in urls if u != known] if known else urls

    def forget(self, tid: str) -> None:
        self._where.pop(tid, None)


def _placement(request: Request) -> Placement:
    app_state = request.app.state
    if not hasattr(app_state, "rl_placement"):
        app_state.rl_placement = Placement()
    return app_state.rl_placement


async def _run_job(state: GatewayState, job: RLJob, pins: dict, after: Optional[asyncio.Event],
                   prefixed: asyncio.Event) -> dict:
    """Run one job: {"prefix_s", "think", "images", "result"}. Its prefix starts once `after` is set (None: at
    once); `prefixed` is set when its prefix is done (or the job ended)."""
    out: dict[str, Any] = {"images": {}, "result": None, "think": None, "prefix_s": 0.0}
    if after is not None:
        await after.wait()
    t0 = time.monotonic()
    run = state.orchestrator.run(job, state.deadline(), pins=dict(pins))
    try:
        async for ev in run:
            kind = ev.get("type")
            if kind == "think_done":
                prefixed.set()
                out["prefix_s"] = time.monotonic() - t0
                pre = ev.get("prefix") or {}
                if "think_token_ids" in pre:
                    out["think"] = {"text": ev.get("think_text") or "", "token_ids": pre["think_token_ids"],
                                    "logprobs": pre.get("think_logprobs") or []}
            elif kind == "image":
                out["images"][int(ev.get("index", 0))] = ev.get("b64")
            elif kind == "rl_result":
                out["result"] = ev
    finally:
        prefixed.set()
        await run.aclose()
    if out["result"] is None:
        raise unavailable("generation ended the RL job without its result", code="upstream_protocol_error")
    return out


async def _run_all(request: Request, state: GatewayState, jobs: list[RLJob], gen_url: str,
                   one_prefix_at_a_time: bool) -> list[dict]:
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


def _owned(state: GatewayState, owner: str) -> dict[str, str]:
    """The engine headers of a trajectory route: the internal token and whose trajectory it is."""
    return {**engine_headers(state.config.internal_token), OWNER_HEADER: owner}


async def _delete(state: GatewayState, url: str, tid: str, owner: str) -> Optional[httpx.Response]:
    """DELETE `owner`'s trajectory on a generation replica (None when unreachable)."""
    try:
        return await state.http.delete(f"{url}/internal/rl/trajectories/{tid}", headers=_owned(state, owner),
                                       timeout=CONTROL_TIMEOUT_S)
    except httpx.HTTPError:
        return None


def _one_version(results: list[dict]) -> str:
    versions = {r["result"]["weights_version"] for r in results}
    if len(versions) != 1:
        raise APIError(409, f"the weights changed during this request (versions {sorted(versions)}); retry it",
                       code="weights_changed")
    return versions.pop()


# ------------------------------------------------------------------------------------------ routes
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
    started, created = time.monotonic(), int(time.time())
    _check(state, body, body.return_trajectory)
    owner = caller_identity(request).owner
    rid = request_id(request)
    images = await _inputs(state, body)
    salt = _own_salt(request, state, rid)
    seeds = body.seed_grid(body.seed if body.seed is not None else random.randrange(0, 2**31))
    tid = f"traj-{uuid.uuid4().hex}" if body.return_trajectory else None
    G = body.group_size

    def extra(p: int, first: int, n: int) -> dict:
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

    jobs = _plan(body, rid, images, salt, "/internal/rl/rollout", extra, think)
    gen_url = state.gen.pick().url
    results, version = None, None
    try:
        results = await _run_all(request, state, jobs, gen_url,
                                 not any(body.thinks(p) for p in range(len(body.prompts))))
        version = _one_version(results) if results is not None else None
    finally:
        if tid is not None and (results is None or version is None):   # failed, cancelled, or the client gone
            state.janitor.later(_delete(state, gen_url, tid, owner))
    if results is None:
        return Response(status_code=499)
    if tid is not None:
        _placement(request).remember(tid, gen_url)
    first = results[0]["result"]
    samples = []
    for job, res in zip(jobs, results):
        p = job.first_sample // G
        for k, lp in enumerate(res["result"]["logprobs"]):
            i = job.first_sample - p * G + k
            samples.append({"prompt_index": p, "sample_index": i, "seed": seeds[p][i],
                            "image": res["images"].get(k), "logprobs": lp, "think": res["think"]})
    prefix_s = [r["prefix_s"] for r in results]
    return {"id": f"rl-{uuid.uuid4().hex[:24]}", "object": "rl.rollout", "created": created,
            "weights_version": version, "timesteps": first["timesteps"], "noise_scale": first["noise_scale"],
            "sde_steps": first["sde_steps"], "trajectory_id": tid, "samples": samples,
            "prefill": {"prefixes": len(jobs), "shared_by": max(j.n for j in jobs), "seconds": sum(prefix_s)},
            "usage": {"images": len(samples) if body.return_images else 0,
                      "denoise_steps": len(samples) * body.num_inference_steps},
            "timings": {"total_s": time.monotonic() - started, "prefill_max_s": max(prefix_s)}}


@router.post("/v1/rl/score", response_model=ScoreResponse,
             responses={**RL_ERRORS, 404: ERRORS[400] | {"description": "unknown or evicted trajectory"}})
async def score(request: Request, body: ScoreRequest = Body(openapi_examples={"reference": {"value": SCORE_EXAMPLE}}),
                state: GatewayState = Depends(gateway)):
    """Recompute the per-step transition log-probs of a stored (trajectory_id) or uploaded (trajectory_b64,
    safetensors) trajectory under the current weights or the frozen reference; the request repeats the
    rollout's prompts and sampling fields. ODE steps are null."""
    _check(state, body)
    owner = caller_identity(request).owner
    if body.think_token_ids is None and any(body.thinks(p) for p in range(len(body.prompts))):
        raise bad_request("scoring samples with think text needs their think_token_ids", param="think_token_ids")
    rid = request_id(request)
    images = await _inputs(state, body)
    salt = _own_salt(request, state, rid)
    placement = _placement(request)
    uploaded = None
    if body.trajectory_b64 is not None:
        try:
            blob = base64.b64decode(body.trajectory_b64, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("trajectory_b64 is not base64", param="trajectory_b64") from None
        gen_url = state.gen.pick().url
        uploaded = tid = f"upload-{uuid.uuid4().hex}"
        await _upload(state, gen_url, tid, blob, owner)
    else:
        tid = body.trajectory_id
        gen_url = await _holder(state, placement, tid, owner)

    def extra(p: int, first: int, n: int) -> dict:
        return {"sde": body.sde.model_dump(exclude_none=True), "trajectory_id": tid, "part": first,
                "weights": body.weights, "owner": owner}, 0

    def think(p: int, sample: int) -> dict:
        ids = body.think_token_ids[sample] if body.think_token_ids is not None else None
        return {} if not ids else {"think": True, "think_token_ids": ids}

    jobs = _plan(body, rid, images, salt, "/internal/rl/score", extra, think)
    try:
        results = await _run_all(request, state, jobs, gen_url, body.think_token_ids is None)
    finally:
        if uploaded is not None:
            state.janitor.later(_delete(state, gen_url, uploaded, owner))
    if results is None:
        return Response(status_code=499)
    logprobs = [row for r in results for row in r["result"]["logprobs"]]
    return {"object": "rl.score", "weights_version": _one_version(results), "weights": body.weights,
            "logprobs": logprobs}


async def _upload(state: GatewayState, url: str, tid: str, blob: bytes, owner: str) -> None:
    try:
        r = await state.http.post(f"{url}/internal/rl/trajectories/{tid}", content=blob,
                                  headers={**_owned(state, owner), "content-type": "application/octet-stream"},
                                  timeout=60.0)
    except httpx.HTTPError as exc:
        raise unavailable(f"generation service unreachable: {type(exc).__name__}", code="generation_unavailable")
    if r.status_code != 200:
        raise _engine_error(r.status_code, r.content)


def _engine_error(status: int, body: bytes, headers: Optional[dict[str, str]] = None) -> APIError:
    """Generation's OpenAI-shaped refusal, passed on with `headers` (502 when it is not one)."""
    try:
        err = json.loads(body)["error"]
        return APIError(status, err["message"], param=err.get("param"), code=err.get("code"), headers=headers)
    except (ValueError, KeyError, TypeError):
        return APIError(502, f"generation answered {status}", code="upstream_error")


async def _holder(state: GatewayState, placement: Placement, tid: str, owner: str) -> str:
    """The generation replica holding `owner`'s trajectory `tid` (404 trajectory_not_found when none does: also
    when it is another tenant's, so an id tells nothing of who else exists)."""
    try:
        check_trajectory_id(tid)
    except ValueError as exc:
        raise bad_request(str(exc), param="trajectory_id") from None
    hdrs = _owned(state, owner)
    for url in placement.candidates(tid, state):
        try:
            r = await state.http.get(f"{url}/internal/rl/trajectories/{tid}/info", headers=hdrs,
                                     timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            placement.remember(tid, url)
            return url
    placement.forget(tid)
    raise APIError(404, f"trajectory {tid!r} not found (never stored, deleted, or evicted)", param="trajectory_id",
                   code="trajectory_not_found")


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


async def _open_trajectory(url: str, headers: dict) -> tuple[aiohttp.ClientSession,
                                                                                   aiohttp.ClientResponse]:
    """The upstream GET, its body not yet read. aiohttp rather than the gateway's httpx client for this one
    relay: httpcore reads a body 64 KiB at a time and spent 6x the CPU per byte here (a GB-sized body is
    CPU-bound in the gateway; docs/benchmarks/rl.md); aiohttp reads what the socket has, up to
    RELAY_READ_BYTES, and stops reading (TCP back-pressure) while twice that waits unsent."""
    session = aiohttp.ClientSession(read_bufsize=RELAY_READ_BYTES, auto_decompress=False,
                                    timeout=aiohttp.ClientTimeout(sock_connect=CONTROL_TIMEOUT_S,
                                                                  sock_read=TRAJECTORY_READ_TIMEOUT_S))
    try:
        return session, await session.get(url, headers=headers)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        await session.close()
        raise unavailable(f"generation service unreachable: {type(exc).__name__}", code="generation_unavailable")


@router.get("/v1/rl/trajectories/{trajectory_id}", response_class=Response, responses=TRAJECTORY_DOC)
async def get_trajectory(trajectory_id: str, request: Request, state: GatewayState = Depends(gateway)):
    """A rollout's trajectory as safetensors bytes (application/octet-stream), streamed; one `Range: bytes=a-b`
    is honoured (206 Partial Content) to resume a cut download."""
    owner = caller_identity(request).owner
    fetches = state.rl_fetches
    fetches.acquire()                   # 429 beyond --rl-max-trajectory-fetches relays at once
    try:
        url = await _holder(state, _placement(request), trajectory_id, owner)
        headers = _owned(state, owner)
        if "range" in request.headers:
            headers["range"] = request.headers["range"]
        session, r = await _open_trajectory(f"{url}/internal/rl/trajectories/{trajectory_id}", headers)
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
            raise _engine_error(r.status, await r.read(), ranges)
        finally:
            await close()
    # Relayed as read: the next upstream read waits for the client to take the last chunk (bounded memory), and
    # a client that goes away closes the upstream response (OwnedStream runs `close` however the stream ends).
    return OwnedStream(r.content.iter_any(), close, media_type="application/octet-stream", status_code=r.status,
                       headers={**ranges, "content-length": r.headers["content-length"]})


@router.delete("/v1/rl/trajectories/{trajectory_id}", responses={404: ERRORS[400]})
async def delete_trajectory(trajectory_id: str, request: Request, state: GatewayState = Depends(gateway)):
    """Free a stored trajectory."""
    placement, owner = _placement(request), caller_identity(request).owner
    url = await _holder(state, placement, trajectory_id, owner)
    answer = await _delete(state, url, trajectory_id, owner)
    placement.forget(trajectory_id)
    if answer is not None and answer.status_code != 200:
        raise _engine_error(answer.status_code, answer.content)
    return {"trajectory_id": trajectory_id, "deleted": True}
