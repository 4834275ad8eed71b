"""The engines' stream events read through the contract's types (services/contract/control.py), in one place:
the orchestrator passes every event of understanding's prefix stream through `prefix_event` and every event of
generation's job stream through `generation_event`. The rest of the gateway then sees only declared events whose
declared fields are present and of their types (`relayed`), never a half event; fields the contract does not
declare pass through as they came (a newer engine's additions reach the client). An event of a type the
contract does not declare is skipped (logged once per type); a declared type with fields that do not fit, or
something that is no event at all, ends the job with a 502 `upstream_protocol_error` that names the field."""
from __future__ import annotations

import logging
from typing import Any, Optional, get_args

from pydantic import BaseModel, TypeAdapter, ValidationError

from services.contract.control import GenerationEvent, PrefixEvent, wire
from services.kit.errors import APIError

log = logging.getLogger("u1serve.gateway")
_MAX_LOGGED_UNKNOWN = 32


class EventReader:
    """One engine stream's events (`union`: the contract's discriminated union of them)."""

    def __init__(self, service: str, union: Any):
        self.service = service
        self._events = TypeAdapter(union)
        self.types = frozenset(m.model_fields["type"].default for m in get_args(get_args(union)[0]))
        self._logged_unknown: set[str] = set()

    def __call__(self, raw: Any) -> Optional[BaseModel]:
        """One decoded event as its contract model; None for an event of an undeclared type. Raises APIError 502
        for a malformed one."""
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind not in self.types:
            if kind not in self._logged_unknown and len(self._logged_unknown) < _MAX_LOGGED_UNKNOWN:
                self._logged_unknown.add(kind)
                log.warning("%s sent an event of an undeclared type %r: skipped", self.service, kind[:64])
            return None
        try:
            return self._events.validate_python(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"][1:]) or "event"   # loc[0]: the union's tag
            what = f"{kind} event" if isinstance(kind, str) else "event"
            raise APIError(502, f"{self.service} service sent a malformed {what} ({where}: {first['msg']})",
                           code="upstream_protocol_error") from None


generation_event = EventReader("generation", GenerationEvent)
prefix_event = EventReader("understanding", PrefixEvent)


def relayed(raw: dict, event: BaseModel) -> dict:
    """What the gateway passes on of a parsed event: its validated fields over the fields it came with."""
    return {**raw, **wire(event)}
