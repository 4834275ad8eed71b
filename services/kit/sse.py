"""Server-sent events: one encoder and one decoder for every stream u1serve writes or reads."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterable, Iterator

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "[DONE]"
# a comment line: no event for the reader, but a sign of life for every idle timeout on the way (a job that
# waits in a queue sends these, so the gateway's idle limit never fires before the queue's own timeout)
HEARTBEAT = b": keep-alive\n\n"
_BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def encode(data: Any) -> bytes:
    """`data: <json>\\n\\n` (a str is sent as is, e.g. "[DONE]").

    A dict's `bytes` values (top level) are base64 text, spliced in as JSON strings without passing through
    `json.dumps`: an image's 17 MB of base64 would otherwise be scanned for escapes and copied three times
    (~40 ms of the path from the last step to the client)."""
    if isinstance(data, dict) and any(isinstance(v, bytes) for v in data.values()):
        return _encode_spliced(data)
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def _encode_spliced(data: dict) -> bytes:
    rest = {k: v for k, v in data.items() if not isinstance(v, bytes)}
    parts = [b"data: ", json.dumps(rest, separators=(",", ":"), ensure_ascii=False).encode()[:-1]]   # "{...", no "}"
    sep = b"," if rest else b""
    for key, blob in data.items():
        if isinstance(blob, bytes):
            if blob.translate(None, _BASE64):
                raise ValueError(f"{key!r}: a bytes value must be base64 text")
            parts += [sep, json.dumps(key).encode(), b':"', blob, b'"']
            sep = b","
    parts.append(b"}\n\n")
    return b"".join(parts)


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
