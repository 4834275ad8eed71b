"""Gateway-level admission: a bounded number of requests in flight, each counted until its response is fully
sent (streamed bodies included); beyond the limit a 429 with Retry-After before any work."""
from __future__ import annotations

from services.kit.admission import AdmissionGate
from services.kit.errors import APIError

ADMITTED_PATHS = frozenset({"/v1/chat/completions", "/v1/images/generations", "/v1/images/edits", "/v1/responses",
                            # RL and admin routes too (issue 37): they hold engines as long as images do
                            "/v1/rl/rollout", "/v1/rl/score", "/v1/rl/weights", "/v1/rl/weights/upload",
                            "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class AdmissionMiddleware:
    def __init__(self, app, *, gate: AdmissionGate, paths: frozenset[str] = ADMITTED_PATHS):
        self.app = app
        self.gate = gate
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        try:
            self.gate.acquire()
        except APIError as err:
            return await err.response()(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.release()
