"""OpenAI-shaped errors: every failure the gateway reports goes through APIError."""
from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error with an HTTP status and OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "invalid_request_error"
    if status == 429:
        return "rate_limit_error"
    if status < 500:
        return "invalid_request_error"
    if status in (502, 503, 504):
        return "service_unavailable"
    return "server_error"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, code=code)


def from_upstream(status: int, payload: Any, service: str) -> APIError:
    """Turn an engine's error (status + body, OpenAI-shaped or not) into an APIError."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or f"{service} service error")
        return APIError(status, message, type=err.get("type"), param=err.get("param"),
                        code=err.get("code"))
    text = payload if isinstance(payload, str) else repr(payload)
    return APIError(status, f"{service} service returned HTTP {status}: {text[:300]}",
                    code="upstream_error")
