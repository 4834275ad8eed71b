"""Request bodies and client liveness: strict JSON parsing (no NaN/Infinity, bounded nesting, an element budget),
the route class that hands FastAPI the body parsed once (kit.bodies parsed it), and the one disconnect watcher
every long request runs under."""
from __future__ import annotations

import json
import math
from typing import Any, Awaitable, Callable, TypeVar

import anyio
from fastapi import Request
from fastapi.routing import APIRoute

from services.contract.limits import MAX_JSON_DEPTH

from .errors import bad_request

T = TypeVar("T")
_STATE_KEY = "u1_json"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed in JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is out of range for a float")
    return v


def _depth_ok(obj: Any, max_depth: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def json_elements_bound(raw: bytes) -> int:
    """An upper bound of the JSON values in `raw` (each value after the first follows a ',' or opens a container),
    counted on bytes as they arrive, before any parsing. Commas inside strings count too: text with more commas
    than the budget is far above any context length anyway."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{")


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON -> Python, or a 400 that says why: not JSON, NaN/Infinity/overflowing numbers, nesting too deep."""
    if not raw:
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(f"JSON nested deeper than {max_depth} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not _depth_ok(obj, max_depth):
        raise bad_request(f"JSON nested deeper than {max_depth} levels", code="invalid_json")
    return obj


async def json_body(request: Request) -> dict:
    """The request's JSON object (parsed once by the middleware when it ran; strict either way)."""
    state = request.scope.setdefault("state", {})
    if _STATE_KEY in state:
        body = state[_STATE_KEY]
    else:
        body = parse_json(await request.body())
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def remember_json(scope: dict, obj: Any) -> None:
    scope.setdefault("state", {})[_STATE_KEY] = obj


class _ParsedJsonRequest(Request):
    async def json(self) -> Any:
        state = self.scope.get("state", {})
        if _STATE_KEY in state:
            return state[_STATE_KEY]
        return parse_json(await self.body())


class ParsedJsonRoute(APIRoute):
    """A route whose FastAPI body parameter is the JSON the body middleware parsed (strictly, off the event loop)
    rather than a second, lenient `json.loads` on the loop. Every router of a service behind kit.bodies uses it
    (`APIRouter(route_class=ParsedJsonRoute)`)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def parsed(request: Request):
            return await handler(_ParsedJsonRequest(request.scope, request.receive, request._send))
        return parsed


async def until(stop: Callable[[], Awaitable[Any]], work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()`, cancelling it when `stop()` returns first. Returns (finished, result); an exception of
    `work` propagates (outside the task group, unwrapped)."""
    box: dict[str, Any] = {}

    async with anyio.create_task_group() as tg:
        async def watch():
            await stop()
            box["stopped"] = True
            tg.cancel_scope.cancel()

        async def run():
            try:
                box["result"] = await work()
            except Exception as exc:
                box["error"] = exc
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if "error" in box:
        raise box["error"]
    if box.get("stopped") and "result" not in box:
        return False, None
    return True, box.get("result")


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()`, cancelling it when the client disconnects. Returns (finished, result); an exception of
    `work` propagates (outside the task group, unwrapped)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return await until(disconnected, work)
