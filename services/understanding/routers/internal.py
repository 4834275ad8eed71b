"""The gateway's internal calls: POST /internal/image_prefix, /internal/interleave_segment, /internal/release,
/internal/abort."""
from __future__ import annotations

from fastapi import APIRouter, Request

from services.contract.control import AbortReply, AbortRequest, ReleaseRequest
from services.contract.image import PrefixRequest
from services.contract.interleave import InterleaveSegmentRequest
from services.kit.web import json_body

from ..state import app_state

router = APIRouter()


@router.post("/internal/image_prefix")
async def image_prefix(request: Request):
    st = app_state(request)
    req = PrefixRequest.model_validate(await json_body(request))
    return await st.prefixes.handle(request, req)


@router.post("/internal/interleave_segment")
async def interleave_segment(request: Request):
    st = app_state(request)
    req = InterleaveSegmentRequest.model_validate(await json_body(request))
    return await st.interleave.handle(req)


@router.post("/internal/release")
async def release(request: Request):
    st = app_state(request)
    req = ReleaseRequest.model_validate(await json_body(request))
    return st.prefixes.release(req.handles)


@router.post("/internal/abort")
async def abort(request: Request):
    """Abort whatever runs under this request id: an image prefix (all its branches) or a text request."""
    st = app_state(request)
    rid = AbortRequest.model_validate(await json_body(request)).request_id
    n = st.prefixes.abort(rid)
    if st.engine is not None:
        for engine_rid in [r for r in st.engine.queues if r == rid or r.startswith(rid + ".")]:
            st.engine.abort(engine_rid)
            n += 1
    return AbortReply(request_id=rid, aborted=n).model_dump()
