"""The LoRA adapters the stack serves, as the gateway sees them (docs/lora.md): the stack's --lora-modules, then
what was loaded since. A request's `model` resolves here to an adapter (or the base model); load and unload go
to every replica of both engines (fanout.py), and a load that fails on one is unloaded from the others, so the
replicas agree. An unload stops new requests at once; running ones finish with the adapter (the engines free
its slot after)."""
from __future__ import annotations

import asyncio
from typing import Optional

from services.base import knobs
from services.kit.errors import APIError, bad_request

from .fanout import Fanout, Replica, first_failure

OP_TIMEOUT_S = 660.0


class Adapters:
    """Adapter name -> its path, for every adapter every engine holds."""

    def __init__(self, base_model: str, names: dict[str, str], enabled: bool):
        self.base_model = base_model      # the served model's name: never an adapter's
        self.names = names
        self.enabled = enabled
        self.lock = asyncio.Lock()        # one load / unload at a time

    @classmethod
    def from_knobs(cls, base_model: str) -> "Adapters":
        """The stack's adapters (the launcher's --lora-modules / --max-loras, passed on as knobs)."""
        names: dict[str, str] = {}
        for item in (x.strip() for x in knobs.LORA_MODULES.get().split(",")):
            name, sep, path = item.partition("=")
            if sep and name.strip():
                names[name.strip()] = path.strip()
        return cls(base_model, names, bool(names) or (knobs.MAX_LORAS.get() or 0) > 0)

    def resolve(self, model: Optional[str]) -> Optional[str]:
        """The adapter a request's `model` names (None: the base model). Raises the 404 of an unknown model;
        without adapters every name means the base model."""
        if not self.enabled or not model or model == self.base_model:
            return None
        if model in self.names:
            return model
        raise APIError(404, f"The model {model!r} does not exist (GET /v1/models lists the served model and its "
                       "LoRA adapters)", type="invalid_request_error", param="model", code="model_not_found")

    def models(self) -> list[dict]:
        """The adapters as /v1/models entries."""
        return [{"id": n, "object": "model", "created": 0, "owned_by": "u1serve", "root": p, "parent": self.base_model}
                for n, p in self.names.items()]

    async def load(self, fanout: Fanout, name: str, path: str, strength: float) -> list[tuple[Replica, dict]]:
        """Load on every replica: each one's answer. A failure on one unloads it from those that took it."""
        if not self.enabled:
            raise bad_request("this stack serves no LoRA adapters: start it with --max-loras N (or --lora-modules)",
                              param="lora_name", code="lora_disabled")
        async with self.lock:
            if name == self.base_model or name in self.names:
                raise bad_request(f"The lora adapter {name!r} has already been loaded.", param="lora_name",
                                  code="lora_already_loaded")
            replicas = fanout.replicas()
            results = await fanout.everywhere("/internal/lora/load", {"name": name, "path": path,
                                                                      "strength": strength}, OP_TIMEOUT_S,
                                              replicas=replicas)
            failed = first_failure(results)
            if failed is not None:
                if any(not isinstance(r, BaseException) for r in results):   # those that took it give it back
                    await fanout.everywhere("/internal/lora/unload", {"name": name}, OP_TIMEOUT_S)
                raise failed
            self.names[name] = path
        return list(zip(replicas, results))

    async def unload(self, fanout: Fanout, name: str) -> int:
        """Unload from every replica (new requests are refused from here on): the requests still running with it."""
        async with self.lock:
            if name not in self.names:
                raise APIError(404, f"The lora adapter {name!r} cannot be found.", param="lora_name",
                               code="lora_not_found")
            del self.names[name]
            results = await fanout.everywhere("/internal/lora/unload", {"name": name}, OP_TIMEOUT_S)
        failed = first_failure(results)
        if failed is not None:
            raise failed
        return sum(int(r.get("requests") or 0) for r in results)
