"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status. Every failure a
service reports goes through APIError, also inside SSE streams (`event()`)."""
from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Optional

from fastapi.responses import JSONResponse

log = logging.getLogger("u1serve.errors")


def default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 499:
        return "cancelled"
    if status < 500:
        return "invalid_request_error"
    if status in (502, 503, 504):
        return "service_unavailable"
    return "server_error"


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def event(self) -> dict[str, Any]:
        """The error as an SSE event of the internal streams."""
        return {"type": "error", "status": self.status, **self.body()}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str = "missing or invalid credentials", code: str = "unauthorized") -> APIError:
    return APIError(401, message, code=code)


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, code=code)


def overloaded(message: str, retry_after_s: float = 1.0, code: str = "overloaded") -> APIError:
    """429 with Retry-After (whole seconds, at least 1)."""
    return APIError(429, message, code=code, headers={"Retry-After": str(max(1, int(round(retry_after_s))))})


def from_event(event: dict, service: str) -> APIError:
    """An `{"type": "error", "status", "error": {...}}` event (or any error body) back into an APIError."""
    return from_upstream(int(event.get("status", 500)), event, service)


def from_upstream(status: int, payload: Any, service: str, headers: Optional[dict[str, str]] = None) -> APIError:
    """An engine's error (status + body, OpenAI-shaped or not) as an APIError; Retry-After passes through."""
    err = payload.get("error") if isinstance(payload, dict) else None
    keep = {k: v for k, v in (headers or {}).items() if k.lower() == "retry-after"}
    if isinstance(err, dict):
        return APIError(status, str(err.get("message") or f"{service} service error"), type=err.get("type"),
                        param=err.get("param"), code=err.get("code"), headers=keep)
    text = payload if isinstance(payload, str) else repr(payload)
    return APIError(status, f"{service} service returned HTTP {status}: {text[:300]}", code="upstream_error",
                    headers=keep)


# pydantic's labels of union members in a loc ("str", "TextPart", "list[tagged-union[TextPart,ImagePart]]"): not fields
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|bytes|none|dict|list|tuple|[A-Z]\w*|.*[\[\-].*)$")


def _loc_to_param(loc: Iterable[Any]) -> Optional[str]:
    out = ""
    for part in loc:
        if part in ("body", "query", "path", "header", "form"):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic adds the tag of a discriminated union / the function of a validator / the member type of
            # a plain union (str, list[str], ImageURL, constrained-str) to the loc
            if isinstance(part, str) and (part.startswith("function-") or part in ("text", "image_url")
                                          and out.endswith("]") or _UNION_MEMBER.match(part)):
                continue
            out += ("." if out else "") + str(part)
    return out or None


def from_validation(errors: list[dict]) -> APIError:
    """pydantic / FastAPI validation errors -> one 400 naming the first offending field and what is allowed."""
    if not errors:
        return bad_request("invalid request")
    # a value that fits no member of a union gets one error per member: the deepest says the most
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    # a model-level check names its field in ctx["param"] (e.g. an option given twice)
    param = _loc_to_param(first.get("loc", ())) or (first.get("ctx") or {}).get("param")
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    kind = first.get("type", "")
    code = "missing_required_parameter" if kind == "missing" else (
        "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value")
    text = f"{param}: {msg}" if param else msg
    if kind == "json_invalid":
        code, text = "invalid_json", f"request body is not valid JSON: {msg}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return APIError(400, text, param=param, code=code)


def validated(model, body):
    """`body` as pydantic `model`, or the 400 that names the first bad field (from_validation)."""
    from pydantic import ValidationError
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None


def install(app, service: str) -> None:
    """Register the handlers that turn every exception into an OpenAI-shaped response."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request, exc: RequestValidationError):
        return from_validation(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(_request, exc: ValidationError):
        return from_validation(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http(_request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else (
            "method_not_allowed" if exc.status_code == 405 else None)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("%s: unexpected error on %s", service, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
