"""Live weight updates of the whole stack (admin routes, behind the API key like every /v1 route):

    POST /v1/rl/weights          {"path"?, "lora"?, "lora_strength"?, "version"?}
    POST /v1/rl/weights/upload   ?version=&kind=weights|lora&lora_strength=   body: safetensors bytes
    GET  /v1/rl/weights          the version of every engine replica

The update itself (two-phase over every replica, one at a time): weights.py. An upload is written to a
temporary file on the gateway's host (weights_upload.py) and handed to the engines as a path (so, like `path`,
it reaches engines that share this host's file system); its body limit is UPLOAD_MAX_BYTES (docs/rl.md).
"""
from __future__ import annotations

from typing import Literal, Optional

from fastapi import APIRouter, Depends, Query, Request

from services.contract import limits as L
from services.contract.rl_weights import VERSION_PATTERN, WeightsStatus, WeightsUpdateRequest, WeightsUpdateResponse
from services.kit.web import ParsedJsonRoute

from ..context import gateway
from ..schemas import ERRORS
from ..state import GatewayState
from ..weights_upload import received_upload

router = APIRouter(tags=["rl"], route_class=ParsedJsonRoute)


@router.post("/v1/rl/weights", response_model=WeightsUpdateResponse, responses=ERRORS)
async def post_weights(body: WeightsUpdateRequest, state: GatewayState = Depends(gateway)):
    """Load new weights (a safetensors directory under the checkpoint's key names, and/or a LoRA delta) into
    every engine without a restart; answers when every engine serves the new version."""
    return await state.weights.update(body)


@router.post("/v1/rl/weights/upload", response_model=WeightsUpdateResponse, responses=ERRORS,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def upload_weights(request: Request, version: Optional[str] = Query(None, pattern=VERSION_PATTERN),
                         kind: Literal["weights", "lora"] = Query("weights", description=(
                             "weights: tensors under the checkpoint's key names; lora: an adapter (official "
                             "layout) applied as a delta")),
                         lora_strength: float = Query(1.0, ge=-L.MAX_LORA_STRENGTH, le=L.MAX_LORA_STRENGTH),
                         state: GatewayState = Depends(gateway)):
    """The same update with the safetensors file as the request body (for trainers without a shared file
    system: small models, LoRA deltas)."""
    uploads = state.weight_uploads
    uploads.acquire()                  # one upload at a time (429 for another meanwhile)
    try:
        async with received_upload(request) as path:
            req = WeightsUpdateRequest(path=path if kind == "weights" else None,
                                       lora=path if kind == "lora" else None, lora_strength=lora_strength,
                                       version=version)
            return await state.weights.update(req)
    finally:
        uploads.release()


@router.get("/v1/rl/weights", response_model=WeightsStatus, responses=ERRORS)
async def get_weights(state: GatewayState = Depends(gateway)):
    """The weights version every engine replica serves."""
    return await state.weights.status()
