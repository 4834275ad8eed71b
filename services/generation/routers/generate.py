"""POST /internal/generate: one image job (services.contract.image.GenerateRequest) -> its SSE stream
(job_stream.py; the events: services.contract.control)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from services.kit import timeline
from services.kit.errors import APIError
from services.kit.web import json_body

from ..inputs import check_handles, handles_of, parse_job
from ..job_stream import JobStream
from ..state import app_state

router = APIRouter()


@router.post("/internal/generate")
async def generate(request: Request):
    st = app_state(request)
    timeline.mark("gen", "request")
    body = await json_body(request)
    rid = body.get("request_id") if isinstance(body.get("request_id"), str) else \
        request.headers.get("x-request-id", "-")
    try:
        job = parse_job(body, st.cache_defaults)
        st.check_size(job)
        check_handles(job, st.fingerprint)
    except APIError as err:
        raise st.reject(err, rid, handles_of(body)) from None
    try:
        return JobStream(st, job).respond()
    except APIError as err:
        raise st.reject(err, job.request_id, list(job.handles.values())) from None
