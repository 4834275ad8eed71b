"""GET /health (open), /metrics, /v1/models."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.contract.health import PHASE_FIELD, EnginePhase

from ..state import app_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    st = app_state(request)
    e = st.engine
    ok = e is not None and e.ready
    sup = e.status() if e is not None else {"state": "starting", "restarts": 0, "last_error": None, "failure": None}
    status = "ok" if ok else {"starting": "loading", "ready": "restarting"}.get(sup["state"], sup["state"])
    body = {"status": status, PHASE_FIELD: (e.phase if e is not None else EnginePhase.STARTING).value,
            "engine_ready": ok, "error": sup["failure"], "model": st.model_name,
            "restarts": sup["restarts"], "engine_pids": e.pids if e is not None else [],
            "last_engine_error": sup["last_error"], "weights_version": st.weights.endpoint.version}
    admission = {"in_flight": st.gate.active, "limit": st.gate.limit, "rejected": st.gate.rejected,
                 "queue_wait_limit_s": st.args.max_queue_wait_s}
    if e is not None:
        s = e.stats
        admission["queued"] = s.waiting
        body.update(running=s.running, waiting=s.waiting, kv_total=s.kv_total, kv_free=s.kv_free,
                    kv_in_use=s.kv_in_use, kv_cached=s.kv_cached, inflight=len(e.queues),
                    preemptions=s.preemptions)
    body["admission"] = admission
    if st.pool is not None:
        pool = st.pool.stats()
        body.update(shm_pages_used=pool["pages_used"], shm_pages_total=pool["pages_total"],
                    shm_handles_live=pool["handles_live"], shm_pool_generation=pool["generation"],
                    kv={"transport": st.args.kv_transport, "pool": pool["pool_name"]})
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    st = app_state(request)
    e = st.engine
    pool = st.pool.stats() if st.pool is not None else None
    text = st.metrics.render(e.stats, pool, e.status()["restarts"], st.gate)
    return Response(text, media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    st = app_state(request)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": int(st.started),
                                         "owned_by": "u1serve", "max_model_len": st.limits.max_model_len}]}
