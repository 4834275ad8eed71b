"""Multi-LoRA on the public API, vLLM's conventions (docs/lora.md):

    GET  /v1/models                  the served model and every loaded adapter (`parent`: the base model)
    POST /v1/load_lora_adapter       {"lora_name", "lora_path", "strength"?}   (admin, behind the API key)
    POST /v1/unload_lora_adapter     {"lora_name"}

A request's `model` picks the adapter; with adapters served (`--max-loras` / `--lora-modules`), a name that is
neither the model nor an adapter is a 404 `model_not_found` (without adapters every name means the model, as
before). The adapter travels to both engines in the internal bodies (`lora`); chat text bodies keep their
`model`, which understanding resolves the same way. The adapters and their load / unload on every replica:
adapters.py.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from services.contract import limits as L
from services.kit.web import ParsedJsonRoute

from ..context import gateway
from ..schemas import ERRORS
from ..state import GatewayState

router = APIRouter(tags=["lora"], route_class=ParsedJsonRoute)


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")     # vLLM's other fields (lora_int_id, load_inplace)
    lora_name: str = Field(min_length=1, max_length=L.MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="PEFT directory or official .safetensors file, readable by every engine")
    strength: float = Field(1.0, ge=-L.MAX_LORA_STRENGTH, le=L.MAX_LORA_STRENGTH,
                            description="u1serve: scale of the adapter's product")


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=L.MAX_LORA_NAME_CHARS)


@router.post("/v1/load_lora_adapter", responses=ERRORS)
async def load_lora_adapter(req: LoadLoraAdapterRequest, state: GatewayState = Depends(gateway)):
    answers = await state.adapters.load(state.fanout, req.lora_name, req.lora_path, req.strength)
    return {"object": "lora_adapter", "id": req.lora_name, "loaded": True, "parent": state.config.model_name,
            "engines": [{"service": r.service, "url": r.url, **answer} for r, answer in answers]}


@router.post("/v1/unload_lora_adapter", responses=ERRORS)
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, state: GatewayState = Depends(gateway)):
    running = await state.adapters.unload(state.fanout, req.lora_name)
    return {"object": "lora_adapter", "id": req.lora_name, "unloaded": True, "running_requests": running}
