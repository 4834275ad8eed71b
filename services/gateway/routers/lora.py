"""Multi-LoRA on the public API, vLLM's conventions (docs/lora.md):

    GET  /v1/models                  the served model and every loaded adapter (`parent`: the base model)
    POST /v1/load_lora_adapter       {"lora_name", "lora_path", "strength"?}   (admin, behind the API key)
    POST /v1/unload_lora_adapter     {"lora_name"}

A request's `model` picks the adapter; with adapters served (`--max-loras` / `--lora-modules`), a name that is
neither the model nor an adapter is a 404 `model_not_found` (without adapters every name means the model, as
before). The adapter travels to both engines in the internal bodies (`lora`); chat text bodies keep their
`model`, which understanding resolves the same way. Load and unload go to every replica of both engines
(their /internal/lora routes); a load that fails on one is unloaded from the others, so the replicas agree.
An unload stops new requests at once; running ones finish with the adapter (the engines free its slot after).
"""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from services import knobs
from services.contract import limits as L
from services.kit.errors import APIError, bad_request
from services.kit.web import ParsedJsonRoute

from ..context import gateway
from ..schemas import ERRORS
from ..state import GatewayState
from .rl_weights import _call, _replicas

router = APIRouter(tags=["lora"], route_class=ParsedJsonRoute)
OP_TIMEOUT_S = 660.0


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")     # vLLM's other fields (lora_int_id, load_inplace)
    lora_name: str = Field(min_length=1, max_length=L.MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="PEFT directory or official .safetensors file, readable by every engine")
    strength: float = Field(1.0, ge=-100.0, le=100.0, description="u1serve: scale of the adapter's product")


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=L.MAX_LORA_NAME_CHARS)


class Adapters:
    """The gateway's view of the adapters every engine holds (the stack's --lora-modules, then its loads)."""

    def __init__(self):
        self.names: dict[str, str] = {}
        for item in (x.strip() for x in knobs.LORA_MODULES.get().split(",")):
            name, sep, path = item.partition("=")
            if sep and name.strip():
                self.names[name.strip()] = path.strip()
        self.enabled = bool(self.names) or (knobs.MAX_LORAS.get() or 0) > 0
        self.lock = asyncio.Lock()


def adapters(state: GatewayState) -> Adapters:
    a = getattr(state, "lora_adapters", None)
    if a is None:
        a = Adapters()
        state.lora_adapters = a
    return a


def adapter_for(state: GatewayState, model: Optional[str]) -> Optional[str]:
    """The adapter a request's `model` names (None: the base model). Raises the 404 of an unknown model."""
    a = adapters(state)
    if not a.enabled or not model or model == state.config.model_name:
        return None
    if model in a.names:
        return model
    raise APIError(404, f"The model {model!r} does not exist (GET /v1/models lists the served model and its LoRA "
                   "adapters)", type="invalid_request_error", param="model", code="model_not_found")


def adapter_models(state: GatewayState) -> list[dict]:
    base = state.config.model_name
    return [{"id": n, "object": "model", "created": 0, "owned_by": "u1serve", "root": p, "parent": base}
            for n, p in adapters(state).names.items()]


async def _everywhere(state: GatewayState, path: str, body: dict) -> list:
    return await asyncio.gather(*(_call(state, "POST", url, path, body, service, OP_TIMEOUT_S)
                                  for service, url in _replicas(state)), return_exceptions=True)


@router.post("/v1/load_lora_adapter", responses=ERRORS)
async def load_lora_adapter(req: LoadLoraAdapterRequest, state: GatewayState = Depends(gateway)):
    a = adapters(state)
    if not a.enabled:
        raise bad_request("this stack serves no LoRA adapters: start it with --max-loras N (or --lora-modules)",
                          param="lora_name", code="lora_disabled")
    async with a.lock:
        if req.lora_name == state.config.model_name or req.lora_name in a.names:
            raise bad_request(f"The lora adapter {req.lora_name!r} has already been loaded.", param="lora_name",
                              code="lora_already_loaded")
        body = {"name": req.lora_name, "path": req.lora_path, "strength": req.strength}
        results = await _everywhere(state, "/internal/lora/load", body)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            if len(failed) < len(results):        # the replicas that took it give it back
                await _everywhere(state, "/internal/lora/unload", {"name": req.lora_name})
            raise next((e for e in failed if isinstance(e, APIError)), failed[0])
        a.names[req.lora_name] = req.lora_path
    return {"object": "lora_adapter", "id": req.lora_name, "loaded": True, "parent": state.config.model_name,
            "engines": [{"service": s, "url": u, **r} for (s, u), r in zip(_replicas(state), results)]}


@router.post("/v1/unload_lora_adapter", responses=ERRORS)
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, state: GatewayState = Depends(gateway)):
    a = adapters(state)
    async with a.lock:
        if req.lora_name not in a.names:
            raise APIError(404, f"The lora adapter {req.lora_name!r} cannot be found.", param="lora_name",
                           code="lora_not_found")
        del a.names[req.lora_name]       # new requests: 404 from here on
        results = await _everywhere(state, "/internal/lora/unload", {"name": req.lora_name})
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise next((e for e in failed if isinstance(e, APIError)), failed[0])
    return {"object": "lora_adapter", "id": req.lora_name, "unloaded": True,
            "running_requests": sum(int(r.get("requests") or 0) for r in results)}
