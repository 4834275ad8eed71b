"""Engine endpoints: pick one (least busy, round-robin on ties), track liveness, read SSE."""
from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx

from .errors import APIError, from_upstream, unavailable

TOKEN_HEADER = "X-U1-Internal-Token"


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    down_until: float = 0.0   # monotonic time; routing skips it until then

    def mark_down(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def mark_up(self) -> None:
        self.down_until = 0.0

    @property
    def looks_up(self) -> bool:
        return time.monotonic() >= self.down_until


class EndpointPool:
    def __init__(self, service: str, urls: list[str], retry_down_after_s: float):
        if not urls:
            raise ValueError(f"no {service} endpoints configured")
        self.service = service
        self.endpoints = [Endpoint(u) for u in urls]
        self._rr = itertools.count()
        self.retry_down_after_s = retry_down_after_s

    def pick(self) -> Endpoint:
        """Least busy of the endpoints that look up; if all look down, try them anyway."""
        live = [e for e in self.endpoints if e.looks_up] or self.endpoints
        start = next(self._rr) % len(live)
        rotated = live[start:] + live[:start]
        return min(rotated, key=lambda e: e.in_flight)

    @contextlib.contextmanager
    def use(self, ep: Endpoint):
        ep.in_flight += 1
        try:
            yield ep
        finally:
            ep.in_flight -= 1

    def down(self, ep: Endpoint) -> None:
        ep.mark_down(self.retry_down_after_s)


def headers(internal_token: str | None, request_id: str | None = None) -> dict[str, str]:
    h = {}
    if internal_token:
        h[TOKEN_HEADER] = internal_token
    if request_id:
        h["x-request-id"] = request_id
    return h


async def error_from_response(resp: httpx.Response, service: str) -> APIError:
    raw = await resp.aread()
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = raw.decode("utf-8", "replace")
    return from_upstream(resp.status_code, payload, service)


def connection_error(service: str, url: str, exc: Exception) -> APIError:
    return unavailable(f"{service} service at {url} is unreachable ({type(exc).__name__})",
                       code=f"{service}_unavailable")


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict]:
    """Yield the JSON objects of `data:` lines until `[DONE]`."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if not data:
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def sse(data: Any) -> bytes:
    """One server-sent event line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
