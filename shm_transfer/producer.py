"""The understanding service's side of the handoff, by kind: which Transport creates the pool it exports into."""
from __future__ import annotations

from .layout import KVLayout
from .nixl_transport import NixlTransport
from .transport import LocalShmTransport, Transport


def create_producer(kind: str, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
                    pin: bool | None = None, owner: str = "", **network) -> "Transport":
    """The understanding service's transport: kind "shm" (same host) or "nixl" (network; `network` holds
    NixlTransport.create's listen_host / listen_port / advertise_host); `owner` (the stack's id) is recorded in the
    segment."""
    if kind == "shm":
        return LocalShmTransport.create(name, layout, size_bytes, model_fingerprint, pin=pin, owner=owner)
    if kind == "nixl":
        return NixlTransport.create(name, layout, size_bytes, model_fingerprint, pin=pin, owner=owner, **network)
    raise ValueError(f"unknown KV transport {kind!r}; one of 'shm', 'nixl'")
