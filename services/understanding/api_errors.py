"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param, code)


def unavailable(message: str, code: str = "engine_unavailable") -> APIError:
    return APIError(503, message, None, code, "service_unavailable")
