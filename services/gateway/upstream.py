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

    def pick(self, exclude: set[str] | frozenset = frozenset()) -> Endpoint:
        """Least busy of the endpoints that look up; if all look down, try them anyway."""
        candidates = [e for e in self.endpoints if e.url not in exclude] or self.endpoints
        live = [e for e in candidates if e.looks_up] or candidates
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


async def open_stream(http: httpx.AsyncClient, pool: EndpointPool, path: str, body: dict,
                      hdrs: dict[str, str], timeout: httpx.Timeout) -> tuple[Endpoint, httpx.Response]:
    """POST to the least busy endpoint and return its streaming response (headers read).

    A refused connection moves on to the next endpoint. A connection that breaks before the
    response head (typically a pooled keep-alive connection to a process that has since died or
    restarted) is retried once on a fresh connection, then counts as down. All down: a 503."""
    tried: set[str] = set()
    while True:
        ep = pool.pick(exclude=tried)
        for attempt in (1, 2):
            try:
                req = http.build_request("POST", ep.url + path, json=body, headers=hdrs,
                                         timeout=timeout)
                return ep, await http.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = exc
                break
            except httpx.TransportError as exc:
                last = exc
                if attempt == 2:
                    break
        pool.down(ep)
        tried.add(ep.url)
        if len(tried) >= len(pool.endpoints):
            raise connection_error(pool.service, ep.url, last) from None


def headers(internal_token: str | None, request_id: str | None = None) -> dict[str, str]:
    h = {}
    if internal_token:
        h[TOKEN_HEADER] = internal_token
    if request_id:
        h["x-request-id"] = request_id
    return h


async def error_from_response(resp: httpx.Response, service: str) -> APIError:
    raw = await resp.aread()
    if resp.status_code in (401, 403):
        # the engines only check the internal token: this is a deployment error, not the client's
        return APIError(502, f"{service} service rejected the gateway's internal token "
                        "(check U1SERVE_INTERNAL_TOKEN on both sides)", code="internal_auth_failed")
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
