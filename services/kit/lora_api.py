"""An engine service's internal LoRA routes (HTTP process side), shared by understanding and generation:

    POST /internal/lora/load     {"name", "path", "strength"?} -> {"name", "slot", "modules", "seconds"}
    POST /internal/lora/unload   {"name"} -> {"name", "requests": still running with it}

Each op goes to the engine's ranks over the weights channel (weights_api.WeightsEndpoint: rank 0 takes it between
steps and every rank runs it, services/model/lora_registry.LoraRegistry.run); a refusal comes back as the
engine's 4xx (bad file or modules that do not bind: 400, unknown name: 404, no free slot: 409).
"""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from services.contract import limits as L
from services.kit.errors import validated
from services.kit.local_files import private_copy
from services.kit.web import json_body

LORA_TIMEOUT_S = 600.0      # reading an adapter + waiting for the step in flight


class LoraLoadBody(BaseModel):
    name: str = Field(min_length=1, max_length=L.MAX_LORA_NAME_CHARS)
    path: str = Field(min_length=1, max_length=4096)
    strength: float = Field(1.0, ge=-L.MAX_LORA_STRENGTH, le=L.MAX_LORA_STRENGTH)


class LoraUnloadBody(BaseModel):
    name: str = Field(min_length=1, max_length=L.MAX_LORA_NAME_CHARS)


def lora_router(endpoint) -> APIRouter:
    """The routes over `endpoint` (a WeightsEndpoint: its channel to the engine ranks)."""
    r = APIRouter()

    @r.post("/internal/lora/load")
    async def load(request: Request):
        body = validated(LoraLoadBody, await json_body(request))
        # an allowed regular file, read here into a private copy: the ranks' step loop reads only that
        async with private_copy(body.path, "lora") as copy:
            msg = await endpoint._call({"op": "lora_load", "id": "l-" + uuid.uuid4().hex[:12],
                                        **body.model_dump(), "path": copy}, LORA_TIMEOUT_S)
        return {k: msg.get(k) for k in ("name", "slot", "modules", "seconds")}

    @r.post("/internal/lora/unload")
    async def unload(request: Request):
        body = validated(LoraUnloadBody, await json_body(request))
        msg = await endpoint._call({"op": "lora_unload", "id": "l-" + uuid.uuid4().hex[:12], **body.model_dump()},
                                   LORA_TIMEOUT_S)
        return {k: msg.get(k) for k in ("name", "requests", "seconds")}
    return r
