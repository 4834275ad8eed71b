"""The engines as HTTP peers: a request opened on a replica the routing picks (moving on while it has not
started), the internal headers, a time limit on every wait for an engine, and engine answers turned into
APIErrors. Replicas and the routing rules: routing.py."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
import httpx

from services.contract.control import ReleaseRequest
from services.kit import sse
from services.kit.errors import APIError, from_event, from_upstream, unavailable
from services.kit.middleware import TOKEN_HEADER

from .routing import Endpoint, EndpointPool

T = TypeVar("T")
log = logging.getLogger("u1serve.gateway")
DEFAULT_RETRY_AFTER = "1"
CONTROL_TIMEOUT_S = 5.0          # abort / cancel / release calls
RELEASE_TRIES = 3                # a release not answered 200 (busy, restarting, the connection dropped) goes again


def engine_headers(internal_token: str | None, request_id: str | None = None) -> dict[str, str]:
    h = {}
    if internal_token:
        h[TOKEN_HEADER] = internal_token
    if request_id:
        h["x-request-id"] = request_id
    return h


class Deadline:
    """The time limits of one request's waits on the engines: `idle_s` for any single wait (a response head, the
    next bytes of a stream) and the request's total deadline. Either one ends the wait with a 504."""

    def __init__(self, idle_s: float, total_s: float):
        self.idle_s = idle_s
        self.total_s = total_s
        self.ends = time.monotonic() + total_s

    async def wait(self, aw: Awaitable[T], service: str, idle: bool = True) -> T:
        """`await aw` within the limits; `idle=False` for a wait that may legitimately be silent (the head of a
        non-streamed answer) and is bounded by the deadline only."""
        left = self.ends - time.monotonic()
        by_idle = idle and self.idle_s < left
        try:
            with anyio.fail_after(max(0.0, self.idle_s if by_idle else left)):
                return await aw
        except TimeoutError:
            if by_idle:
                raise APIError(504, f"{service} service sent nothing for {self.idle_s:g} s",
                               code="upstream_timeout") from None
            raise APIError(504, f"request did not finish within {self.total_s:g} s",
                           code="deadline_exceeded") from None

    async def lines(self, resp: httpx.Response, service: str) -> AsyncIterator[str]:
        it = resp.aiter_lines().__aiter__()
        while True:
            try:
                line = await self.wait(it.__anext__(), service)
            except StopAsyncIteration:
                return
            yield line

    def events(self, resp: httpx.Response, service: str) -> AsyncIterator[dict]:
        """The JSON events of an SSE response until [DONE] (any line, comments too, counts as a sign of life)."""
        return sse.aevents(self.lines(resp, service))


@contextlib.asynccontextmanager
async def reading(pool: EndpointPool, ep: Endpoint, resp: httpx.Response) -> AsyncIterator[httpx.Response]:
    """While `resp` is read: its endpoint counts as busy, a broken connection marks it down (503), and the
    response is closed however the reading ends."""
    with pool.use(ep):
        try:
            yield resp
        except httpx.TransportError as exc:
            pool.down(ep)
            raise connection_error(pool.service, ep.url, exc) from None
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()


def is_timeout(err: APIError) -> bool:
    return err.status == 504 and err.code in ("upstream_timeout", "deadline_exceeded")


@dataclass
class Target:
    """Where one engine call went, known from the moment an endpoint is picked (so a request that ends while
    waiting for the head can still abort the work there), and what routes it: the affinity `key` (a
    conversation's start) and the `source` replica whose KV the call will read."""
    ep: Endpoint | None = None
    key: Optional[int] = None
    source: Optional[Endpoint] = None


RETRY_ELSEWHERE = (429, 503)      # a replica that answers these did not start the request: another may take it


async def open_stream(http: httpx.AsyncClient, pool: EndpointPool, path: str, body: dict, hdrs: dict[str, str],
                      deadline: Deadline, target: Target, idle: bool = True,
                      retry_refused: bool = True) -> httpx.Response:
    """POST to the replica the routing picks (target.key, target.source) and return its streaming response
    (head read).

    A request that has not started moves on to another replica: a refused connection, a connection that breaks
    before the response head (after one retry on a fresh connection: typically a pooled keep-alive connection to
    a process that has since died or restarted), a 503 head (ejected) or a 429 head (it is busy). When every
    replica was tried: a 503 for no connection at all, else the last answer. No head in time: a 504 (that
    replica counts as down for a moment). retry_refused=False: a 429 / 503 head is the answer (a body that is
    spent once an engine has read it: generation frees the prefix pages of a job it refuses)."""
    tried: set[str] = set()
    last: Exception | None = None
    while True:
        ep = target.ep = pool.pick(exclude=tried, key=target.key, source=target.source)
        resp: httpx.Response | None = None
        for _attempt in (1, 2):
            try:
                req = http.build_request("POST", ep.url + path, json=body, headers=hdrs)
                resp = await deadline.wait(http.send(req, stream=True), pool.service, idle)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                last = exc
                break
            except httpx.TransportError as exc:
                last = exc
            except APIError:
                pool.down(ep)
                raise
        tried.add(ep.url)
        last_one = not pool.untried(tried, target.source)
        if resp is not None and resp.status_code == 200:
            ep.mark_up()                   # a served request ends an ejection backoff, as a good probe does
        if resp is not None and (resp.status_code not in RETRY_ELSEWHERE or last_one or not retry_refused):
            return resp
        if resp is not None:
            log.info("%s at %s answered %d before starting the request; trying another replica",
                     pool.service, ep.url, resp.status_code)
            await resp.aclose()
            if resp.status_code == 429:
                continue
        pool.down(ep)
        if last_one:
            raise connection_error(pool.service, ep.url, last) from None


def with_retry_after(err: APIError, seconds: Any = None) -> APIError:
    """Every 429 the gateway passes on says when to retry (the engine's value, else 1 s)."""
    if err.status == 429 and not any(k.lower() == "retry-after" for k in err.headers):
        err.headers["Retry-After"] = str(seconds) if seconds is not None else DEFAULT_RETRY_AFTER
    return err


async def error_from_response(resp: httpx.Response, service: str, deadline: Deadline) -> APIError:
    """An engine's non-200 answer as the APIError the client gets."""
    raw = await deadline.wait(resp.aread(), service)
    if resp.status_code in (401, 403):
        # the engines only check the internal token: this is a deployment error, not the client's
        return APIError(502, f"{service} service rejected the gateway's internal token "
                        "(check U1SERVE_INTERNAL_TOKEN on both sides)", code="internal_auth_failed")
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = raw.decode("utf-8", "replace")
    return with_retry_after(from_upstream(resp.status_code, payload, service, dict(resp.headers)))


def error_from_event(event: dict, service: str) -> APIError:
    """An engine's `{"type": "error", "status", "error"}` stream event as an APIError (a 429 keeps its
    `retry_after`)."""
    return with_retry_after(from_event(event, service), event.get("retry_after"))


def connection_error(service: str, url: str, exc: Exception | None) -> APIError:
    return unavailable(f"{service} service at {url} is unreachable ({type(exc).__name__})",
                       code=f"{service}_unavailable")


class Janitor:
    """The control calls that undo work after a request ended early (abort, cancel, release) run as background
    tasks: no client waits for a hung engine, and shutdown waits for them only briefly."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def later(self, work: Awaitable[Any]) -> None:
        try:
            task = asyncio.ensure_future(work)
        except RuntimeError:          # no event loop (interpreter shutdown): the leases reclaim the pages
            log.warning("no event loop for a cleanup call; leaving it to the KV lease")
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def tell(http: httpx.AsyncClient, url: str, body: dict, hdrs: dict[str, str], timeout_s: float) -> Any:
    """A best-effort control call (abort, cancel, release): its JSON answer, or None; never raises."""
    try:
        r = await http.post(url, json=body, headers=hdrs, timeout=timeout_s)
        ok = r.status_code == 200
        log.log(logging.INFO if ok else logging.WARNING, "%s -> %d", url.rsplit("/", 1)[-1], r.status_code)
        return r.json() if ok else None
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("%s failed: %s", url, type(exc).__name__)
        return None


async def release_pages(http: httpx.AsyncClient, und_url: str, handles: list[dict], hdrs: dict[str, str]) -> bool:
    """Give prefix pages back to understanding. Release frees only pages still the handles' (idempotent), so one
    not answered 200 (understanding busy past the timeout, restarting, a dropped connection) is sent again with
    backoff, RELEASE_TRIES times, before the pages are left to their lease (kv_lease_s, 300 s by default); a 4xx
    (handles it cannot read) is final. True once understanding answered 200."""
    body = ReleaseRequest(handles=handles).model_dump()
    for attempt in range(RELEASE_TRIES):
        try:
            r = await http.post(und_url + "/internal/release", json=body, headers=hdrs, timeout=CONTROL_TIMEOUT_S)
            if r.status_code == 200:
                return True
            if 400 <= r.status_code < 500 and r.status_code != 429:
                log.warning("release -> %d: %s", r.status_code, r.text[:200])
                return False
            why = str(r.status_code)
        except httpx.HTTPError as exc:
            why = type(exc).__name__
        log.warning("release of %d handle(s) at %s failed (%s), try %d of %d", len(handles), und_url, why,
                    attempt + 1, RELEASE_TRIES)
        if attempt + 1 < RELEASE_TRIES:
            await asyncio.sleep(0.5 * 2 ** attempt)
    return False
