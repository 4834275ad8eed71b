"""POST /internal/abort {"request_id"}: end the job now (its stream gets a 499 `cancelled` error); the engine
stops it before its next step and frees its pages."""
from __future__ import annotations

from fastapi import APIRouter, Request

from services.contract.control import AbortReply, AbortRequest
from services.kit.web import json_body

from ..state import app_state

router = APIRouter()


@router.post("/internal/abort")
async def abort(request: Request):
    rid = AbortRequest.model_validate(await json_body(request)).request_id
    return AbortReply(request_id=rid, aborted=int(app_state(request).engine.abort(rid))).model_dump()
