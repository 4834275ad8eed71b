"""Per-client accountability for responses a client holds without reading (issue 30).

A client that asks for an image and then reads nothing costs the GPU time of that image; the write deadline
(kit/streaming.py) cuts it, but only after the image was made. So the gateway keeps a ledger: a client whose
response sat unread for `--strike-hold-s` with its receive window closed (its application reads nothing: a
slow or lossy network keeps taking bytes, or keeps its window open, and is never struck) gets a strike. While
it has strikes, its new requests are refused with 429 `client_on_probation` and a Retry-After saying when it
may come back; strikes decay one per `--strike-decay-s`, so a repeat offender waits longer each time and a
client struck once by accident is served again two minutes later. A refused request adds nothing.

A client is its API key (when the gateway has keys) together with its address (IPv6 by its /64: one host's
interface has a whole /64 to pick from); behind a reverse proxy, the address is the one the proxy forwards
when it is trusted (`--forwarded-allow-ips`, uvicorn's proxy-header handling). The ledger is bounded: the
least recently struck clients are forgotten first.
"""
from __future__ import annotations

import hashlib
import ipaddress
import math
import time
from collections import OrderedDict
from typing import Callable

from services.kit.errors import overloaded
from services.kit.middleware import bearer_key

MAX_CLIENTS = 65536          # clients with strikes remembered at once


def client_of(scope: dict) -> str:
    """Who sent a request: a fingerprint of its API key (if it gave an accepted one) and its address."""
    host = (scope.get("client") or ("-", 0))[0] or "-"
    try:
        addr = ipaddress.ip_address(host)
        if addr.version == 6 and addr.ipv4_mapped is None:
            host = str(ipaddress.ip_network(f"{addr}/64", strict=False))
        elif addr.version == 6:
            host = str(addr.ipv4_mapped)
    except ValueError:
        pass                   # a unix socket path or a proxy's non-address name: taken as it is
    key = bearer_key(scope)
    fp = hashlib.sha256(b"u1serve-client\0" + key.encode("latin-1")).hexdigest()[:12] if key else "-"
    return f"{fp}@{host}"


class ClientLedger:
    """Strikes per client, each worth `decay_s` of probation; a leaky bucket (strikes drain one per decay_s)."""

    def __init__(self, decay_s: float, max_clients: int = MAX_CLIENTS, clock: Callable[[], float] = time.monotonic):
        if decay_s <= 0:
            raise ValueError("decay_s must be positive")
        self.decay_s, self.max_clients, self.clock = decay_s, max_clients, clock
        self.strikes: OrderedDict[str, tuple[float, float]] = OrderedDict()   # client -> (strikes, as of)

    def _now_strikes(self, client: str) -> float:
        entry = self.strikes.get(client)
        if entry is None:
            return 0.0
        left = entry[0] - (self.clock() - entry[1]) / self.decay_s
        if left <= 0:
            del self.strikes[client]
            return 0.0
        return left

    def strike(self, client: str) -> float:
        """One more strike; returns the client's probation left, in seconds."""
        left = self._now_strikes(client) + 1
        self.strikes[client] = (left, self.clock())
        self.strikes.move_to_end(client)
        while len(self.strikes) > self.max_clients:
            self.strikes.popitem(last=False)
        return left * self.decay_s

    def probation_s(self, client: str) -> float:
        """Seconds until `client` is served again; 0 when it has no strike."""
        return self._now_strikes(client) * self.decay_s

    def on_probation(self) -> int:
        """Clients with strikes now (the metrics gauge)."""
        return sum(self._now_strikes(c) > 0 for c in list(self.strikes))


class ProbationMiddleware:
    """Refuses the admitted routes' requests of a client on probation (429 + Retry-After), before its body is
    read or any work starts. Sits inside the API key check: a struck client is its key and its address."""

    def __init__(self, app, *, ledger: ClientLedger, paths: frozenset[str], on_refused: Callable[[], None]):
        self.app, self.ledger, self.paths, self.on_refused = app, ledger, paths, on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            return await self.app(scope, receive, send)
        left = self.ledger.probation_s(client_of(scope))
        if left <= 0:
            return await self.app(scope, receive, send)
        self.on_refused()
        err = overloaded(f"this client recently held a response without reading it; new requests are refused "
                         f"for another {math.ceil(left)} s", retry_after_s=math.ceil(left), code="client_on_probation")
        return await err.response()(scope, receive, send)


def hold_reporter(ledger: ClientLedger, paths: frozenset[str], on_strike: Callable[[], None],
                  log) -> Callable[[dict, float], None]:
    """The SlowReaderGuard's `on_hold`: a strike for the client of a held response of `paths` (the routes that
    make work; a trainer that pauses while it fetches a trajectory is not struck)."""
    def held(scope: dict, seconds: float) -> None:
        if scope.get("path") not in paths:
            return
        client = client_of(scope)
        left = ledger.strike(client)
        on_strike()
        log.warning("%s: client %s held its response unread for %.1f s with its receive window closed: a strike "
                    "(new requests refused for %.0f s)", scope.get("path", ""), client, seconds, left)
    return held
