"""Server-sent events: one encoder and one decoder for every stream u1serve writes or reads."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterable, Iterator

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "[DONE]"


def encode(data: Any) -> bytes:
    """`data: <json>\\n\\n` (a str is sent as is, e.g. "[DONE]")."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def _parse(line: str):
    """The JSON object of one `data:` line, DONE, or None (comments, blanks, other fields, non-objects)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    if not data:
        return None
    try:
        event = json.loads(data)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON objects of the `data:` lines until `[DONE]` (sync: clients, tests)."""
    for line in lines:
        ev = _parse(line)
        if ev is DONE:
            return
        if ev is not None:
            yield ev


async def aevents(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The same over an async line iterator (e.g. `httpx.Response.aiter_lines()`)."""
    async for line in lines:
        ev = _parse(line)
        if ev is DONE:
            return
        if ev is not None:
            yield ev
