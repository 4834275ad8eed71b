"""The understanding service's side of the handoff, by kind: which Transport creates the pool it exports into,
and how its engine ranks attach that pool."""
from __future__ import annotations

from .layout import KVLayout
from .nixl_transport import NixlTransport
from .errors import HandleError, PoolError
from .transport import DeviceTransport, LocalShmTransport, Transport

KINDS = ("shm", "nixl", "device")


def create_producer(kind: str, name: str, layout: KVLayout, size_bytes: int, model_fingerprint: str, *,
                    pin: bool | None = None, owner: str = "", device=None, **network) -> "Transport":
    """The understanding service's transport: kind "shm" (same host), "nixl" (network; `network` holds
    NixlTransport.create's listen_host / listen_port / advertise_host) or "device" (the pages on `device`, for a
    generation engine in this same process); `owner` (the stack's id) is recorded in the segment."""
    if kind == "shm":
        return LocalShmTransport.create(name, layout, size_bytes, model_fingerprint, pin=pin, owner=owner)
    if kind == "nixl":
        return NixlTransport.create(name, layout, size_bytes, model_fingerprint, pin=pin, owner=owner, **network)
    if kind == "device":
        return DeviceTransport.create(name, layout, size_bytes, model_fingerprint, device=device or "cpu",
                                      owner=owner)
    raise ValueError(f"unknown KV transport {kind!r}; one of {', '.join(map(repr, KINDS))}")


def attach_exporter(name: str, expected_fingerprint: str | None = None) -> LocalShmTransport:
    """An engine rank's handle on its service's pool (whatever the transport: every kind exports into the pool
    `name`). A device pool whose pages this process cannot address is refused here, at start, rather than at
    every export (PoolError: an engine rank in another process than the service that made the pool)."""
    t = LocalShmTransport.attach(name, expected_fingerprint=expected_fingerprint)
    try:
        t.pool.require_pages()
    except HandleError as e:
        t.close()
        raise PoolError(str(e)) from None
    return t
