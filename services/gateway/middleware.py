"""ASGI middleware: request id, access log, body-size limit and API key, all in one pass.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect detection work.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import time

from .errors import APIError
from .metrics import GatewayMetrics

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
log = logging.getLogger("u1serve.gateway")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def new_request_id() -> str:
    return "req-" + secrets.token_hex(12)


def _error_bytes(err: APIError) -> bytes:
    return json.dumps(err.body()).encode()


class GatewayMiddleware:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics: GatewayMetrics):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        incoming = hdrs.get("x-request-id", "")
        # The response echoes the client's id; the engines key their requests by the id the gateway
        # sends them, so that one is unique per request even when a client reuses its id (two requests
        # with one engine id would take each other's outputs). It starts with the client's id (logs).
        if _SAFE_ID.match(incoming):
            echo, rid = incoming, f"{incoming}.{secrets.token_hex(4)}"
        else:
            echo = rid = new_request_id()
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        route = self.metrics.route_label(path)
        started = time.monotonic()
        status_box = {"status": 500}
        started_box: dict = {}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status_box["status"] = started_box["status"] = message["status"]
                message["headers"] = list(message.get("headers", [])) + [
                    (b"x-request-id", echo.encode())]
                self.metrics.latency.labels(route).observe(time.monotonic() - started)
            await send(message)

        async def reply_error(err: APIError):
            await send_with_id({"type": "http.response.start", "status": err.status,
                                "headers": [(b"content-type", b"application/json")]})
            await send_with_id({"type": "http.response.body", "body": _error_bytes(err)})

        self.metrics.in_flight.inc()
        try:
            if self.api_key and path.startswith("/v1/") and not self._authorized(hdrs):
                return await reply_error(APIError(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
            declared = hdrs.get("content-length")
            if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
                return await reply_error(self._too_large())
            seen = {"n": 0}

            async def limited_receive():
                message = await receive()
                if message["type"] == "http.request":
                    seen["n"] += len(message.get("body", b""))
                    if seen["n"] > self.max_body_bytes:
                        raise self._too_large()
                return message

            try:
                await self.app(scope, limited_receive, send_with_id)
            except Exception as exc:
                # Starlette answers unhandled errors outside this middleware (no x-request-id there)
                if "status" in started_box:
                    raise
                log.exception("unexpected error")
                await reply_error(APIError(500, f"internal error: {type(exc).__name__}",
                                           code="internal_error"))
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status_box["status"])).inc()
            log.info("%s %s -> %s %.3fs", scope.get("method"), path, status_box["status"],
                     time.monotonic() - started)
            request_id_var.reset(token)

    def _authorized(self, hdrs: dict[str, str]) -> bool:
        auth = hdrs.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(key.strip(), self.api_key)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_body_bytes} bytes",
                        code="request_too_large")
