"""GET /health (both engines), /metrics (Prometheus), /v1/models."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from services.kit.web import ParsedJsonRoute

from ..context import gateway
from ..schemas import ERRORS, HealthReport, ModelList
from ..state import GatewayState
from ..routing import EndpointPool

router = APIRouter(tags=["ops"], route_class=ParsedJsonRoute)


@router.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
async def models(state: GatewayState = Depends(gateway)):
    base = {"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "u1serve"}
    if state.config.model_hub_id:         # u1serve up --model <org>/<name>[@<revision>]
        base.update(root=state.config.model_hub_id, revision=state.config.model_revision)
    return {"object": "list", "data": [base, *state.adapters.models()]}


async def _probe(state: GatewayState, pool: EndpointPool) -> list[dict]:
    """Every replica of one service, probed as the replica monitor probes (the same routing state updates)."""
    return list(await asyncio.gather(*(state.monitor.probe(pool, ep) for ep in list(pool.endpoints))))


@router.get("/health", response_model=HealthReport, responses={503: {"model": HealthReport}})
async def health(state: GatewayState = Depends(gateway)):
    """Every engine replica's /health; 503 when a service has no healthy replica ("degraded" while only some
    replicas are down: the others serve)."""
    und, gen = await asyncio.gather(_probe(state, state.und), _probe(state, state.gen))
    serving = all(any(p["status"] == "ok" for p in probes) for probes in (und, gen))
    status = "unavailable" if not serving else ("ok" if all(p["status"] == "ok" for p in und + gen) else "degraded")
    return JSONResponse({"status": status, "understanding": und, "generation": gen},
                        status_code=200 if serving else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(state: GatewayState = Depends(gateway)):
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
