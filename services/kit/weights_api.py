"""An engine service's internal weights API (HTTP process side), shared by understanding and generation:

    GET  /internal/weights           -> {"weights_version", "staged": version | null}
    POST /internal/weights/stage     {"id", "version", "path"?, "lora"?, "lora_strength"?} -> {"updated", ...}
    POST /internal/weights/commit    {"id"} -> {"weights_version", "updated", "seconds"}
    POST /internal/weights/abort     {"id"?} -> {"aborted": bool}

The engine ranks do the work (services/model/weights_io.LiveWeights); this side forwards one op at a time with
`send(op)` and waits for the engine's reply (`reply(msg)`, from any thread). The version reported here is the
engine's: it changes only when a commit reply says so, and goes back to the checkpoint's ("0") when the engine
process is restarted (it reloads the checkpoint; an update is not replayed).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Optional

from fastapi import APIRouter, Request

from services.contract.rl_weights import WeightsCommitBody, WeightsStageBody
from services.kit.errors import APIError, unavailable, validated
from services.kit.local_files import checked_path, private_copy
from services.kit.lora_api import lora_router
from services.kit.web import json_body

DEFAULT_VERSION = "0"
STAGE_TIMEOUT_S = 1800.0      # reading + validating an 8B branch from a slow disk
COMMIT_TIMEOUT_S = 1800.0     # waits for the jobs in flight (drain), then copies


class WeightsEndpoint:
    def __init__(self, service: str, send: Callable[[dict], bool]):
        """send(op) hands an op to the engine's rank 0 (False: no engine to take it)."""
        self.service = service
        self._send = send
        self.version = DEFAULT_VERSION
        self.staged: Optional[dict] = None          # the staged op (id, version) the engine holds
        self._waiting: dict[str, asyncio.Future] = {}
        self._lock = asyncio.Lock()                 # one op at a time
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # -- engine side ---------------------------------------------------------------------------------
    def reply(self, msg: dict) -> None:
        """The engine's answer to op `msg["id"]` (any thread)."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._resolve, msg)
        except RuntimeError:       # the loop is closed
            pass

    def _resolve(self, msg: dict) -> None:
        fut = self._waiting.pop(str(msg.get("id")), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def engine_restarted(self) -> None:
        """A new engine incarnation loaded the checkpoint: its weights are version "0", nothing is staged, and
        ops in flight fail (any thread)."""
        def reset():
            self.version, self.staged = DEFAULT_VERSION, None
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(unavailable(f"the {self.service} engine restarted during the weight update "
                                                  "(it serves the checkpoint's weights, version 0)",
                                                  code="engine_restarted"))
            self._waiting.clear()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(reset)
            except RuntimeError:
                pass

    async def _call(self, op: dict, timeout_s: float) -> dict:
        self._loop = asyncio.get_running_loop()
        fut = self._loop.create_future()
        self._waiting[op["id"]] = fut
        if not self._send(op):
            self._waiting.pop(op["id"], None)
            raise unavailable(f"the {self.service} engine is not ready", code="engine_unavailable")
        try:
            msg = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            self._waiting.pop(op["id"], None)
            raise APIError(504, f"the {self.service} engine did not answer the weight {op['op']} within "
                           f"{timeout_s:g} s", code="weights_timeout") from None
        if not msg.get("ok"):
            err = msg.get("error") or {}
            raise APIError(int(err.get("status", 400)), str(err.get("message", "weight update failed")),
                           param=err.get("param"), code=err.get("code") or "invalid_weights")
        return msg

    # -- routes ----------------------------------------------------------------------------------
    def status(self) -> dict:
        return {"weights_version": self.version, "staged": (self.staged or {}).get("version")}

    async def stage(self, body: WeightsStageBody) -> dict:
        # only allowed regular files reach the engine's step loop, a LoRA delta as a private copy read here
        # (kit/local_files.py)
        async with contextlib.AsyncExitStack() as files:
            update = {}
            if body.path:
                update["path"] = await checked_path(body.path, "weights")
            if body.lora:
                update["lora"] = await files.enter_async_context(private_copy(body.lora, "weights"))
            return await self._stage(body.model_copy(update=update))

    async def _stage(self, body: WeightsStageBody) -> dict:
        async with self._lock:
            if self.staged is not None and self.staged["id"] != body.id:
                raise APIError(409, f"another weight update ({self.staged['id']}) is staged on {self.service}; "
                               "commit or abort it first", code="weights_busy")
            self.staged = None
            msg = await self._call({"op": "stage", **body.model_dump()}, STAGE_TIMEOUT_S)
            self.staged = {"id": body.id, "version": body.version}
            return {"id": body.id, "staged": body.version, "updated": msg.get("updated", 0),
                    "skipped": msg.get("skipped", 0), "seconds": msg.get("seconds")}

    async def commit(self, body: WeightsCommitBody) -> dict:
        async with self._lock:
            if self.staged is None or self.staged["id"] != body.id:
                raise APIError(409, f"weight update {body.id!r} is not staged on {self.service}",
                               code="weights_not_staged")
            msg = await self._call({"op": "commit", "id": body.id}, COMMIT_TIMEOUT_S)
            self.version, self.staged = msg["version"], None
            return {"weights_version": self.version, "updated": msg.get("updated", 0),
                    "seconds": msg.get("seconds"), "drain_seconds": msg.get("drain_seconds")}

    async def abort(self, op_id: Optional[str]) -> dict:
        async with self._lock:
            if self.staged is None or (op_id and self.staged["id"] != op_id):
                return {"aborted": False}
            await self._call({"op": "abort", "id": self.staged["id"]}, STAGE_TIMEOUT_S)
            self.staged = None
            return {"aborted": True}

    def router(self) -> APIRouter:
        r = APIRouter()

        @r.get("/internal/weights")
        async def get_weights():
            return self.status()

        @r.post("/internal/weights/stage")
        async def stage(request: Request):
            return await self.stage(validated(WeightsStageBody, await json_body(request)))

        @r.post("/internal/weights/commit")
        async def commit(request: Request):
            return await self.commit(validated(WeightsCommitBody, await json_body(request)))

        @r.post("/internal/weights/abort")
        async def abort(request: Request):
            body = await json_body(request)
            op_id = body.get("id") if isinstance(body, dict) else None
            return await self.abort(op_id if isinstance(op_id, str) else None)
        r.include_router(lora_router(self))     # LoRA load / unload ride the same channel (lora_api.py)
        return r
