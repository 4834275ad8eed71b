"""GET /health (open: readiness, the queue and the engine's shape) and GET /metrics (Prometheus)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..state import app_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    body = app_state(request).health()
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request):
    st = app_state(request)
    queued, _ = st.engine.table.counts()
    st.metrics.queue_depth.set(queued)
    data, ctype = st.metrics.render()
    return Response(data, media_type=ctype)
