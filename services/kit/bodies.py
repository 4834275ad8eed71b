"""Request bodies, bounded before they cost anything (pure ASGI middleware, the innermost one: authentication and
admission have run). Each route has a BodyRule (a per-route table, `BodyRules`): its size limit, checked from
Content-Length and again while the body streams in (chunked uploads), its accepted media types (415 otherwise) and
an element budget for JSON, counted on the raw bytes as they arrive. A JSON body is then parsed strictly (no
NaN/Infinity, bounded nesting: web.parse_json) in a worker thread, off the event loop, and handed to the route
parsed (web.json_body, web.ParsedJsonRoute)."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Optional

import anyio
import anyio.to_thread

from services.contract import limits as L

from .errors import APIError
from .web import json_elements_bound, parse_json, remember_json

JSON = "application/json"
MULTIPART = "multipart/form-data"
INLINE_PARSE_BYTES = 64 * 1024          # smaller bodies are parsed on the loop: a thread hop costs more
_WITH_BODY = ("POST", "PUT", "PATCH")


@dataclass(frozen=True)
class BodyRule:
    """What one route accepts as a body. media_types None: any type (a JSON one is still parsed strictly).
    optional: the route takes no body, so an empty one is no error (a POST action such as a cancel)."""
    max_bytes: int
    media_types: Optional[tuple[str, ...]] = (JSON,)
    max_json_elements: int = L.MAX_JSON_ELEMENTS
    optional: bool = False

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_json_elements < 1:
            raise ValueError("body limits must be positive")


class BodyRules:
    """The rule of each route (by exact path, or a pattern with `*` for one path segment, e.g.
    /v1/items/*/cancel); routes not listed get `default`."""

    def __init__(self, default: BodyRule, routes: Optional[Mapping[str, BodyRule]] = None):
        self.default = default
        self.routes = dict(routes or {})

    def rule(self, path: str) -> BodyRule:
        if path in self.routes:
            return self.routes[path]
        for pattern, rule in self.routes.items():
            if "*" in pattern and pattern.count("/") == path.count("/") and fnmatch.fnmatchcase(path, pattern):
                return rule
        return self.default


def media_type(headers: dict[str, bytes]) -> str:
    return headers.get("content-type", b"").split(b";")[0].strip().lower().decode("latin-1")


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes", code="request_too_large")


class BodyMiddleware:
    def __init__(self, app, *, rules: BodyRules, parse_threads: int = 2):
        self.app = app
        self.rules = rules
        self.parse_threads = parse_threads
        self._limiter: Optional[anyio.CapacityLimiter] = None     # made on the loop, at first use

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in _WITH_BODY:
            return await self.app(scope, receive, send)
        rule = self.rules.rule(scope.get("path", ""))
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        try:
            ctype = media_type(headers)
            if rule.media_types is not None and ctype not in rule.media_types:
                raise APIError(415, f"{scope.get('method')} {scope.get('path')} takes "
                                    f"{' or '.join(rule.media_types)}, not {ctype or 'a body without Content-Type'}",
                               param="Content-Type", code="unsupported_media_type")
            declared = headers.get("content-length", b"")
            if declared.isdigit() and int(declared) > rule.max_bytes:
                raise too_large(rule.max_bytes)
            if ctype == JSON:
                raw = await self._read(receive, rule)
                if raw or not rule.optional:
                    remember_json(scope, await self._parse(raw))
                receive = _replay(raw, receive)
            else:
                receive = _limited(receive, rule.max_bytes)
        except APIError as err:
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)

    async def _read(self, receive, rule: BodyRule) -> bytes:
        """The whole body, refused as soon as it passes the size limit or the JSON element budget."""
        chunks, size, elements = [], 0, 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(499, "client disconnected", code="cancelled")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > rule.max_bytes:
                raise too_large(rule.max_bytes)
            elements += json_elements_bound(chunk)
            if elements > rule.max_json_elements:
                raise APIError(400, f"the JSON body has more than {rule.max_json_elements} elements",
                               code="json_too_complex")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _parse(self, raw: bytes):
        if len(raw) <= INLINE_PARSE_BYTES:
            return parse_json(raw)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.parse_threads)
        return await anyio.to_thread.run_sync(parse_json, raw, limiter=self._limiter)


def _limited(receive, limit: int):
    """`receive`, raising a 413 once more than `limit` bytes came in (a route reading a multipart body)."""
    seen = {"n": 0}

    async def limited():
        message = await receive()
        if message["type"] == "http.request":
            seen["n"] += len(message.get("body", b""))
            if seen["n"] > limit:
                raise too_large(limit)
        return message
    return limited


def _replay(body: bytes, receive):
    sent = {"done": False}

    async def replay():
        if not sent["done"]:
            sent["done"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
