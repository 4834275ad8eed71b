"""The request middleware of every service (pure ASGI, so streaming and disconnect detection keep working):
request id, access log (sanitised, /health at debug level), authentication (401; duplicate Authorization
headers are a 400), the body rules (kit.bodies: 413/415, strict JSON parsed once; the engines' run here, the
gateway's innermost, after admission), and an x-request-id on every response, also on errors raised before any
route ran."""
from __future__ import annotations

import contextvars
import hmac
import json
import logging
import re
import secrets
import time
from typing import Iterable, Optional, Protocol

from .bodies import BodyMiddleware, BodyRule, BodyRules
from .errors import APIError, bad_request
from .live import LIVE_PATH
from .logsafe import safe

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
TOKEN_HEADER = "x-u1-internal-token"
_PROBES = ("/health", LIVE_PATH)      # polled all the time: logged at debug
_QUIET = (*_PROBES, "/metrics")


class RequestIdFilter(logging.Filter):
    """Adds `%(request_id)s` to log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def new_request_id() -> str:
    return "req-" + secrets.token_hex(12)


def _same(given: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(given, expected)


class Auth(Protocol):
    def check(self, path: str, headers: dict[str, bytes]) -> Optional[APIError]: ...


def _bearer(headers: dict[str, bytes]) -> Optional[bytes]:
    raw = headers.get("authorization")
    if raw is None:
        return None
    scheme, _, value = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return value.strip()


def bearer_key(scope: dict) -> Optional[str]:
    """The Bearer credential of an authenticated request (what the API key check accepted), else None."""
    return scope.get("state", {}).get("bearer")


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on the public API paths (the gateway; `paths`: prefixes ending in '/', or
    exact paths); one key or several (key rotation, one key per client)."""

    def __init__(self, key: str | Iterable[str], paths: tuple[str, ...] = ("/v1/",)):
        keys = [key] if isinstance(key, str) else list(key)
        if not keys or not all(keys):
            raise ValueError("API keys must be non-empty")
        self.keys = [k.encode("utf-8") for k in keys]
        self.prefixes = tuple(p for p in paths if p.endswith("/"))
        self.exact = frozenset(p for p in paths if not p.endswith("/"))

    def check(self, path, headers):
        if not path.startswith(self.prefixes) and path not in self.exact:
            return None
        given = _bearer(headers)
        # compare with every key (no early exit): the time taken does not depend on which one matched
        matched = given is not None and sum(_same(given, k) for k in self.keys) > 0
        if not matched:
            return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        return None


class InternalTokenAuth:
    """The engines: every route but the open ones (the probes) needs the stack's internal token, as
    X-U1-Internal-Token or `Authorization: Bearer` (what a Prometheus scrape config sends)."""

    def __init__(self, token: str, open_paths: tuple[str, ...] = _PROBES):
        if not token:
            raise ValueError("an internal token is required")
        self.token = token.encode("utf-8")
        self.open_paths = open_paths

    def check(self, path, headers):
        if path in self.open_paths:
            return None
        given = headers.get(TOKEN_HEADER)
        if given is None:
            given = _bearer(headers)
        if given is None or not _same(given.strip(), self.token):
            return APIError(401, "missing or wrong internal token (X-U1-Internal-Token)", code="unauthorized")
        return None


class Hooks(Protocol):
    """Optional metrics hooks of a service."""
    def begin(self, path: str) -> None: ...
    def first_byte(self, path: str, seconds: float) -> None: ...
    def end(self, path: str, status: int) -> None: ...


class ServiceMiddleware:
    def __init__(self, app, *, service: str, max_body_bytes: Optional[int] = None, auth: Optional[Auth] = None,
                 unique_ids: bool = False, hooks: Optional[Hooks] = None):
        """unique_ids: the gateway gives each request an engine id `<client id>.<8 hex>` (clients reuse ids)
        and echoes the client's id; the engines use the id they are sent. max_body_bytes: one body rule for
        every route, applied here (the engines); None: the service installs its own BodyMiddleware (the
        gateway, innermost)."""
        if max_body_bytes is not None:
            app = BodyMiddleware(app, rules=BodyRules(BodyRule(max_body_bytes, media_types=None)))
        self.app = app
        self.log = logging.getLogger(f"u1serve.{service}.access")
        self.auth = auth
        self.unique_ids = unique_ids
        self.hooks = hooks

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        incoming = headers.get("x-request-id", b"").decode("latin-1")
        if _SAFE_ID.match(incoming):
            echo, rid = incoming, (f"{incoming}.{secrets.token_hex(4)}" if self.unique_ids else incoming)
        else:
            echo = rid = new_request_id()
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        started = time.monotonic()
        status = {"code": 500, "sent": False}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"], status["sent"] = message["status"], True
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", echo.encode())]
                if self.hooks:
                    self.hooks.first_byte(path, time.monotonic() - started)
            await send(message)

        async def reply(err: APIError):
            hdrs = [(b"content-type", b"application/json")] + [
                (k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            await send_with_id({"type": "http.response.start", "status": err.status, "headers": hdrs})
            await send_with_id({"type": "http.response.body", "body": json.dumps(err.body()).encode()})

        if self.hooks:
            self.hooks.begin(path)
        try:
            if sum(1 for k, _ in scope["headers"] if k.lower() == b"authorization") > 1:
                return await reply(bad_request("send one Authorization header, not several",
                                               param="Authorization", code="duplicate_header"))
            err = self.auth.check(path, headers) if self.auth else None
            if err is not None:
                return await reply(err)
            if self.auth is not None:
                given = _bearer(headers)
                scope["state"]["bearer"] = given.decode("latin-1") if given is not None else None
            try:
                await self.app(scope, receive, send_with_id)
            except APIError as exc:       # raised by the body limit while a route streamed the body in
                if status["sent"]:
                    raise
                await reply(exc)
            except Exception as exc:
                if status["sent"]:
                    raise
                logging.getLogger("u1serve.errors").exception("unexpected error on %s", safe(path))
                await reply(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
        finally:
            if self.hooks:
                self.hooks.end(path, status["code"])
            # /health answers 503 by design while a service loads or restarts (polled every fraction of a
            # second by the launcher): its state is on the page and in the service's own log, not per poll
            level = logging.DEBUG if path in _PROBES or (path in _QUIET and status["code"] < 500) else logging.INFO
            self.log.log(level, "%s %s -> %s %.3fs", scope.get("method"), safe(path), status["code"],
                         time.monotonic() - started)
            request_id_var.reset(token)
