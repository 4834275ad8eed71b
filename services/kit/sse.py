"""Server-sent events: one encoder and one decoder for every stream u1serve writes or reads."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Iterator, Optional, Union

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


@dataclass(frozen=True)
class Event:
    """One dispatched event: its data lines joined by newlines, its name ("message" unless an `event:` field
    named it) and its last id."""
    data: str
    event: str = "message"
    id: Optional[str] = None


class _Fields:
    """The reader's side of the format (WHATWG "event stream interpretation"): `field: value` lines gather until
    a blank line dispatches them; comment lines (a heartbeat) and unknown fields are skipped."""

    def __init__(self) -> None:
        self.data: list[str] = []
        self.name, self.id = "", None

    def feed(self, line: Optional[str]) -> Optional[Event]:
        """One line; a blank one (or None, the end of the input) dispatches what was gathered."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            self.data.append(value)
        elif field == "event":
            self.name = value
        elif field == "id" and "\0" not in value:
            self.id = value
        return None

    def flush(self) -> Optional[Event]:
        """The gathered event, if it has data (at the end of the input too: a last event without its blank line
        still counts, e.g. one line handed over alone)."""
        data, name, self.data, self.name = self.data, self.name, [], ""
        return Event("\n".join(data), name or "message", self.id) if data else None


def parse(lines: Iterable[str]) -> Iterator[Event]:
    """Every event of a stream's lines (the raw format: no JSON, no `[DONE]` handling). The lines come from
    httpx's `iter_lines()`, which ends a line at LF, CRLF or CR however the body's chunks were cut."""
    fields = _Fields()
    for line in _then_none(lines):
        ev = fields.feed(line)
        if ev is not None:
            yield ev


def _json(data: str):
    """The JSON object of an event's data, DONE, or None (empty data, not JSON, not an object)."""
    data = data.strip()
    if data == DONE:
        return DONE
    if not data:
        return None
    try:
        event = json.loads(data)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def events(lines: Iterable[str], *, done: bool = False) -> Iterator[Union[dict, str]]:
    """The JSON objects of the events until `[DONE]` (sync: clients, tests); with `done`, `[DONE]` itself is
    the last item when the stream ended cleanly (tests check that). Data that is not a JSON object is skipped."""
    for ev in parse(lines):
        obj = _json(ev.data)
        if obj is DONE:
            if done:
                yield DONE
            return
        if obj is not None:
            yield obj


async def aevents(lines: AsyncIterator[str], *, done: bool = False) -> AsyncIterator[Union[dict, str]]:
    """The same over an async line iterator (e.g. `httpx.Response.aiter_lines()`)."""
    fields = _Fields()
    async for line in _athen_none(lines):
        ev = fields.feed(line)
        obj = None if ev is None else _json(ev.data)
        if obj is DONE:
            if done:
                yield DONE
            return
        if obj is not None:
            yield obj


def _then_none(lines: Iterable[str]) -> Iterator[Optional[str]]:
    yield from lines
    yield None          # the end of the input: a last event without its blank line


async def _athen_none(lines: AsyncIterator[str]) -> AsyncIterator[Optional[str]]:
    async for line in lines:
        yield line
    yield None
