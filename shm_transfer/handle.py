"""KVHandle: the small JSON object that names one request-branch's prefix KV in a pool."""
from __future__ import annotations

import dataclasses
import time

from .errors import HandleError
from .layout import LAYOUT_VERSION, KVLayout

_FIELD_TYPES = {
    "handle_id": int,
    "pool_name": str,
    "pool_generation": str,
    "page_ids": list,
    "num_tokens": int,
    "t_offset": int,
    "model_fingerprint": str,
    "layout_version": int,
    "layout": dict,
    "branch": str,
    "lease_deadline": (int, float),
}
# Optional fields (defaults when absent): which transport moves the bytes and what it needs to reach them.
_OPTIONAL = {"transport": (str, "shm"), "producer": (dict, None)}


@dataclasses.dataclass(frozen=True)
class KVHandle:
    handle_id: int
    pool_name: str
    pool_generation: str
    page_ids: tuple[int, ...]
    num_tokens: int
    t_offset: int  # t position of the first generated image token (= max prefix t + 1)
    model_fingerprint: str
    layout_version: int
    layout: dict
    branch: str  # "cond" | "uncond" | "img_cond" (free-form; engines decide)
    lease_deadline: float  # epoch seconds (time.time()); pages are reclaimable after it
    transport: str = "shm"  # "shm": same-host pool; "nixl": the producer's pool read over the network;
    #                         "device": pages on the device of the producer's process (consumers in that process)
    producer: dict | None = None  # network: {"agent", "host", "port", "base_addr", "table_addr", ...}

    def __post_init__(self):
        object.__setattr__(self, "page_ids", tuple(int(p) for p in self.page_ids))
        if self.producer is None:
            object.__setattr__(self, "producer", {})

    def replace(self, **changes) -> "KVHandle":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["page_ids"] = list(self.page_ids)
        d["layout"] = dict(self.layout)
        d["producer"] = dict(self.producer)
        return d

    @classmethod
    def from_dict(cls, d) -> "KVHandle":
        """Parse a handle from JSON; raises HandleError (code `malformed_handle`) naming the bad field."""
        if not isinstance(d, dict):
            raise HandleError(f"KV handle must be a JSON object, got {type(d).__name__}", "malformed_handle")
        missing = sorted(set(_FIELD_TYPES) - set(d))
        if missing:
            raise HandleError(f"KV handle is missing field(s) {missing}", "malformed_handle")
        for name, typ in _FIELD_TYPES.items():
            value = d[name]
            if isinstance(value, bool) or not isinstance(value, typ):
                raise HandleError(f"KV handle field {name!r} has the wrong type ({type(value).__name__})",
                                  "malformed_handle")
        if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in d["page_ids"]):
            raise HandleError("KV handle field 'page_ids' must be a list of non-negative ints", "malformed_handle")
        if d["num_tokens"] <= 0:
            raise HandleError("KV handle field 'num_tokens' must be positive", "malformed_handle")
        extra = {}
        for name, (typ, default) in _OPTIONAL.items():
            value = d.get(name, default)
            if value is not None and not isinstance(value, typ):
                raise HandleError(f"KV handle field {name!r} has the wrong type ({type(value).__name__})",
                                  "malformed_handle")
            extra[name] = value
        return cls(**{name: d[name] for name in _FIELD_TYPES}, **extra)

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.layout)

    def lease_left(self, now: float | None = None) -> float:
        return self.lease_deadline - (time.time() if now is None else now)


def check_static(handle: KVHandle, *, pool_name: str, generation: str, fingerprint: str,
                 layout: KVLayout, num_pages: int, expected_fingerprint: str | None) -> None:
    """Checks that need no lock: identity, versions, geometry. Ordered from most to least telling."""
    if handle.layout_version != LAYOUT_VERSION:
        raise HandleError(
            f"KV handle has layout_version {handle.layout_version}, this build understands {LAYOUT_VERSION}; "
            "producer and consumer run different u1serve versions", "layout_version_mismatch")
    if handle.pool_name != pool_name:
        raise HandleError(f"KV handle belongs to pool {handle.pool_name!r}, not {pool_name!r}", "wrong_pool")
    if handle.pool_generation != generation:
        raise HandleError(
            f"KV handle is from pool generation {handle.pool_generation}, the pool {pool_name!r} is now "
            f"generation {generation}: the producer restarted and the handle's pages are gone", "stale_generation")
    if expected_fingerprint is not None and handle.model_fingerprint != expected_fingerprint:
        raise HandleError(
            f"KV handle was produced by model {handle.model_fingerprint!r}, this engine runs "
            f"{expected_fingerprint!r}", "fingerprint_mismatch")
    if handle.model_fingerprint != fingerprint:
        raise HandleError(
            f"KV handle fingerprint {handle.model_fingerprint!r} differs from the pool's {fingerprint!r}",
            "fingerprint_mismatch")
    if handle.layout != layout.to_dict():
        raise HandleError(f"KV handle layout {handle.layout} differs from the pool layout {layout.to_dict()}",
                          "layout_mismatch")
    if len(handle.page_ids) != layout.pages_for(handle.num_tokens):
        raise HandleError(
            f"KV handle has {len(handle.page_ids)} pages for {handle.num_tokens} tokens "
            f"(expected {layout.pages_for(handle.num_tokens)})", "malformed_handle")
    if len(set(handle.page_ids)) != len(handle.page_ids) or any(p >= num_pages for p in handle.page_ids):
        raise HandleError(f"KV handle page ids are duplicated or out of range (pool has {num_pages} pages)",
                          "malformed_handle")
