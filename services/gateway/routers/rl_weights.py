"""Live weight updates of the whole stack (admin routes, behind the API key like every /v1 route):

    POST /v1/rl/weights          {"path"?, "lora"?, "lora_strength"?, "version"?}
    POST /v1/rl/weights/upload   ?version=&kind=weights|lora&lora_strength=   body: safetensors bytes
    GET  /v1/rl/weights          the version of every engine replica

Two-phase over every replica of both engines (services/kit/weights_api.py): stage everywhere (each engine
reads and validates its tensors on all its ranks), then commit understanding, then generation. Any stage
failure aborts every staged copy and answers the engine's error (a refused update is a 400 naming the keys):
the old weights keep serving. Understanding commits first, so generation, still on the old version, holds
the handles of the new one until its own commit instead of refusing them (generation/weights.py).

One update at a time per gateway. An upload is written to a temporary file on the gateway's host and handed
to the engines as a path (so, like `path`, it reaches engines that share this host's file system); its body
limit is UPLOAD_MAX_BYTES (docs/rl.md).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from typing import Literal, Optional

import httpx
from fastapi import APIRouter, Depends, Query, Request

from services import knobs
from services.contract.rl_weights import (VERSION_PATTERN, WeightsStatus, WeightsUpdateRequest, WeightsUpdateResponse,
                                          next_version)
from services.kit.errors import APIError, from_upstream, unavailable
from services.kit.web import ParsedJsonRoute

from ..context import gateway
from ..schemas import ERRORS
from ..state import GatewayState
from ..upstream import engine_headers

router = APIRouter(tags=["rl"], route_class=ParsedJsonRoute)
UPLOAD_MAX_BYTES = 64 << 30          # a whole 8B checkpoint; the route's own limit (the gateway's table: bodies.py)
OP_TIMEOUT_S = 1800.0                # stage reads a branch from disk; commit waits for the jobs in flight
STATUS_TIMEOUT_S = 10.0
UPLOAD_READ_TIMEOUT_S = 60.0         # between two pieces of an upload's body: a stalled body is cut (408)
MAX_HEADER_BYTES = 100 << 20         # safetensors' own bound on its JSON header
_LOCK_KEY = "rl_weights_lock"


def _lock(state: GatewayState) -> asyncio.Lock:
    lock = getattr(state, _LOCK_KEY, None)
    if lock is None:
        lock = asyncio.Lock()
        setattr(state, _LOCK_KEY, lock)
    return lock


def _replicas(state: GatewayState) -> list[tuple[str, str]]:
    """(service, url) of every engine replica, understanding first."""
    return [(pool.service, ep.url) for pool in (state.und, state.gen) for ep in list(pool.endpoints)]


async def _call(state: GatewayState, method: str, url: str, path: str, body: Optional[dict], service: str,
                timeout_s: float) -> dict:
    hdrs = engine_headers(state.config.internal_token)
    try:
        r = await state.http.request(method, url + path, json=body, headers=hdrs, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise unavailable(f"{service} service at {url} is unreachable ({type(exc).__name__}); the weights did not "
                          "change", code=f"{service}_unavailable") from None
    try:
        payload = r.json()
    except ValueError:
        payload = r.text
    if r.status_code != 200:
        raise from_upstream(r.status_code, payload, service)
    return payload


async def _versions(state: GatewayState) -> dict[str, dict[str, Optional[str]]]:
    async def one(service: str, url: str):
        try:
            return service, url, (await _call(state, "GET", url, "/internal/weights", None, service,
                                              STATUS_TIMEOUT_S)).get("weights_version")
        except APIError:
            return service, url, None
    out: dict[str, dict[str, Optional[str]]] = {"understanding": {}, "generation": {}}
    for service, url, v in await asyncio.gather(*(one(s, u) for s, u in _replicas(state))):
        out[service][url] = v
    return out


def _one(versions: dict[str, Optional[str]]) -> Optional[str]:
    vs = set(versions.values())
    return vs.pop() if len(vs) == 1 else None


async def update_weights(state: GatewayState, req: WeightsUpdateRequest) -> dict:
    """Stage on every replica, then commit (understanding, then generation); see the module doc."""
    async with _lock(state):
        t0 = time.perf_counter()
        versions = await _versions(state)
        current = _one({**{f"u{u}": v for u, v in versions["understanding"].items()},
                        **{f"g{u}": v for u, v in versions["generation"].items()}})
        if current is None and req.version is None:
            raise APIError(409, f"the engines serve different weights versions ({versions}); give `version`",
                           param="version", code="weights_versions_differ")
        version = req.version or next_version(current)
        op = {"id": "w-" + os.urandom(6).hex(), "version": version, "path": req.path, "lora": req.lora,
              "lora_strength": req.lora_strength}
        replicas = _replicas(state)
        staged = await asyncio.gather(*(_call(state, "POST", url, "/internal/weights/stage", op, service, OP_TIMEOUT_S)
                                        for service, url in replicas), return_exceptions=True)
        failed = [r for r in staged if isinstance(r, BaseException)]
        if failed:
            await _abort_all(state, replicas, op["id"])
            err = next((e for e in failed if isinstance(e, APIError)), None)
            if err is None:
                raise failed[0]
            raise err
        t_stage = time.perf_counter() - t0
        updated = {"understanding": 0, "generation": 0}
        for service, r in zip((s for s, _ in replicas), staged):
            updated[service] += int(r.get("updated", 0))
        drain = {}
        for service in ("understanding", "generation"):
            urls = [u for s, u in replicas if s == service]
            done = await asyncio.gather(*(_call(state, "POST", u, "/internal/weights/commit", {"id": op["id"]},
                                                service, OP_TIMEOUT_S) for u in urls), return_exceptions=True)
            bad = [e for e in done if isinstance(e, BaseException)]
            if bad:
                await _abort_all(state, replicas, op["id"])
                raise APIError(500, f"the weight update failed while committing on {service} ({bad[0]}); some "
                               f"engines may serve version {version!r}, others the old one: GET /v1/rl/weights "
                               "tells which, and a new update brings them together", code="weights_commit_failed")
            drain[service] = max(float(r.get("drain_seconds") or 0.0) for r in done)
        t = time.perf_counter() - t0
        return {"weights_version": version, "seconds": t, "stage_seconds": t_stage, "commit_seconds": t - t_stage,
                "drain_seconds": drain, "updated": updated}


async def _abort_all(state: GatewayState, replicas, op_id: str) -> None:
    await asyncio.gather(*(_call(state, "POST", url, "/internal/weights/abort", {"id": op_id}, service,
                                 STATUS_TIMEOUT_S) for service, url in replicas), return_exceptions=True)


@router.post("/v1/rl/weights", response_model=WeightsUpdateResponse, responses=ERRORS)
async def post_weights(body: WeightsUpdateRequest, state: GatewayState = Depends(gateway)):
    """Load new weights (a safetensors directory under the checkpoint's key names, and/or a LoRA delta) into
    every engine without a restart; answers when every engine serves the new version."""
    return await update_weights(state, body)


@router.post("/v1/rl/weights/upload", response_model=WeightsUpdateResponse, responses=ERRORS,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def upload_weights(request: Request, version: Optional[str] = Query(None, pattern=VERSION_PATTERN),
                         kind: Literal["weights", "lora"] = Query("weights", description=(
                             "weights: tensors under the checkpoint's key names; lora: an adapter (official "
                             "layout) applied as a delta")),
                         lora_strength: float = Query(1.0, ge=-100.0, le=100.0),
                         state: GatewayState = Depends(gateway)):
    """The same update with the safetensors file as the request body (for trainers without a shared file
    system: small models, LoRA deltas)."""
    uploads = state.weight_uploads
    uploads.acquire()                  # one upload at a time (429 for another meanwhile)
    tmp = tempfile.mkdtemp(prefix="u1serve-weights-", dir=knobs.WEIGHTS_UPLOAD_DIR.text() or None)
    try:
        path = os.path.join(tmp, "update.safetensors")
        await _save_upload(request, path)
        req = WeightsUpdateRequest(path=path if kind == "weights" else None, lora=path if kind == "lora" else None,
                                   lora_strength=lora_strength, version=version)
        return await update_weights(state, req)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        uploads.release()


def _invalid(why: str) -> APIError:
    return APIError(400, f"the body must be a safetensors file: {why}", code="invalid_weights")


def _declared_size(header_len: int, raw: bytes) -> int:
    """The file size a safetensors header declares (8 + header + the tensors' bytes); 400 when it is not one."""
    try:
        header = json.loads(raw)
    except ValueError:
        raise _invalid("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _invalid("its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _invalid("a tensor's data_offsets are not two ordered byte offsets")
        end = max(end, offsets[1])
    return 8 + header_len + end


async def _save_upload(request: Request, path: str) -> int:
    """Stream the body into `path`: its header read and checked first (a body that is no safetensors file, or
    one larger than UPLOAD_MAX_BYTES, is refused before the rest is read), each piece within
    UPLOAD_READ_TIMEOUT_S, and exactly the bytes the header declares. Returns the size."""
    pieces = request.stream().__aiter__()

    async def piece() -> Optional[bytes]:
        try:
            return await asyncio.wait_for(pieces.__anext__(), UPLOAD_READ_TIMEOUT_S)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise APIError(408, f"the upload sent nothing for {UPLOAD_READ_TIMEOUT_S:g} s", code="upload_timeout") \
                from None
    head = bytearray()
    while len(head) < 8 or len(head) < 8 + int.from_bytes(head[:8], "little"):
        if len(head) >= 8 and not 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER_BYTES:
            raise _invalid("its header length is out of bounds")
        chunk = await piece()
        if chunk is None:
            raise _invalid("the body ends inside its header")
        head += chunk
    n = int.from_bytes(head[:8], "little")
    total = _declared_size(n, bytes(head[8:8 + n]))
    if total > UPLOAD_MAX_BYTES:
        raise APIError(413, f"the file's header declares {total} bytes; uploads take at most {UPLOAD_MAX_BYTES}",
                       code="request_too_large")
    size = len(head)
    with open(path, "wb") as f:
        f.write(head)
        while size <= total:
            chunk = await piece()
            if chunk is None:
                break
            size += len(chunk)
            if size > total:
                break
            await asyncio.to_thread(f.write, chunk)
    if size != total:
        raise _invalid(f"its header declares {total} bytes, the body has {'more' if size > total else size}")
    return size


@router.get("/v1/rl/weights", response_model=WeightsStatus, responses=ERRORS)
async def get_weights(state: GatewayState = Depends(gateway)):
    """The weights version every engine replica serves."""
    versions = await _versions(state)
    und, gen = _one(versions["understanding"]), _one(versions["generation"])
    return {"weights_version": und if und == gen else None, "generation": gen, "understanding": und,
            "reference": None, "replicas": versions}
