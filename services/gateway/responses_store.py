"""Stored responses of /v1/responses, in the gateway's memory: what `store`, `previous_response_id` and
`background` need. Each record belongs to the API key that made it (context.caller_identity's owner, a hash of the
key): another key gets the same 404 as an id that never was. Bounded: finished records expire after `responses_ttl_s` and the
oldest finished go first beyond `responses_max_stored` records or `responses_store_mb` of text and images;
at most `responses_max_background` background responses queued or running (more: 429 with Retry-After).

Nothing is written to disk: a restarted gateway has lost them. A response id carries the id of the gateway
process that made it (BOOT), so the 404 for an id of an earlier process says that it restarted."""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from services.kit.errors import APIError

from .config import GatewayConfig

BOOT = secrets.token_hex(4)          # this gateway process; 8 hex characters after "resp_"
ID_PREFIX = "resp_"
MiB = 1024 * 1024
RETRY_AFTER_S = 5
FINAL = ("completed", "incomplete", "failed", "cancelled")


def new_id(prefix: str = ID_PREFIX) -> str:
    return f"{prefix}{BOOT}{secrets.token_hex(12)}"


def _size(obj: Any) -> int:
    """About the bytes a record holds: its strings (text, base64 images) and a little per value."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_size(v) for v in obj.values()) + 16 * len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(_size(v) for v in obj) + 8 * len(obj)
    return 8


@dataclass
class Stored:
    owner: str
    response: dict                        # the live response object (its output grows while it runs)
    messages: list[dict] = field(default_factory=list)   # the conversation to this turn's answer, for the next turn
    last_image: Optional[str] = None      # the image a next edit starts from (base64 or data URL)
    made_image: bool = False              # last_image is this response's own generated image
    task: Optional[asyncio.Task] = None   # a background response's work
    finished_at: Optional[float] = None
    size: int = 0

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def done(self) -> bool:
        return self.response["status"] in FINAL


def not_found(rid: str, param: Optional[str] = None) -> APIError:
    if rid.startswith(ID_PREFIX) and len(rid) > 13 and rid[5:13] != BOOT:
        return APIError(404, f"response {rid!r} is lost: the gateway restarted since it was made, and stored "
                        "responses live in its memory only", type="invalid_request_error", param=param,
                        code="response_lost_on_restart")
    return APIError(404, f"no response with id {rid!r} (never made with this API key, not stored, or expired)",
                    type="invalid_request_error", param=param, code="response_not_found")


class ResponseStore:
    def __init__(self, cfg: GatewayConfig):
        self.max_stored, self.max_bytes = cfg.responses_max_stored, int(cfg.responses_store_mb * MiB)
        self.ttl_s, self.max_background = cfg.responses_ttl_s, cfg.responses_max_background
        self._records: OrderedDict[str, Stored] = OrderedDict()     # oldest first
        self._bytes = 0

    def get(self, owner: str, rid: str, param: Optional[str] = None) -> Stored:
        self._expire()
        rec = self._records.get(rid)
        if rec is None or not secrets.compare_digest(rec.owner, owner):
            raise not_found(rid, param)
        return rec

    def __contains__(self, rid: str) -> bool:
        return rid in self._records

    def forget(self, rid: str) -> None:
        if rid in self._records:
            self._drop(rid)

    def running(self) -> int:
        return sum(1 for r in self._records.values() if r.task is not None and not r.done)

    def admit_background(self) -> None:
        """A 429 when as many background responses as allowed are queued or running."""
        if self.running() >= self.max_background:
            raise APIError(429, f"{self.max_background} background responses are queued or running on this "
                           "gateway: try again later", type="rate_limit_error", code="too_many_background_responses",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def add(self, rec: Stored) -> None:
        """Keep `rec` (running or finished)."""
        self._records[rec.id] = rec
        if rec.done:
            self.finished(rec)

    def finished(self, rec: Stored) -> None:
        """`rec` has its final status: it counts against the bounds from now on."""
        if rec.id not in self._records or rec.finished_at is not None:
            return
        rec.finished_at = time.monotonic()
        rec.size = _size(rec.response) + _size(rec.messages) + _size(rec.last_image)
        self._bytes += rec.size
        self._records.move_to_end(rec.id)
        self._expire()
        self._evict()

    def _drop(self, rid: str) -> None:
        rec = self._records.pop(rid)
        self._bytes -= rec.size

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r.id for r in self._records.values()
                    if r.finished_at is not None and now - r.finished_at > self.ttl_s]:
            self._drop(rid)

    def _evict(self) -> None:
        """The oldest finished records go until the count and bytes fit (running ones are never dropped)."""
        for rid in [r.id for r in self._records.values() if r.finished_at is not None]:
            if len(self._records) <= self.max_stored and self._bytes <= self.max_bytes:
                return
            self._drop(rid)

    async def cancel_all(self, timeout_s: float = 5.0) -> None:
        """On shutdown: background work ends, its undo (engines told to stop) handed to the janitor before the
        gateway's HTTP client closes."""
        tasks = [r.task for r in self._records.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
