"""Engine replicas behind the gateway: which replica gets a request.

- Understanding: prefix-cache affinity. Requests that start the same conversation (cache salt, messages up to
  the first user turn; an image job's mode, prompt and first image) go to the same replica, so its radix cache
  holds their prefix: rendezvous hashing over the live replicas (a replica that joins or leaves moves only its
  own share of keys), with a bounded load (a replica far busier than the average hands the key to the next one
  in the key's order).
- Generation: the least loaded (queue depth from its /health, or this gateway's requests in flight if higher)
  among the replicas that can read the prefix's KV: a producer on the shm transport pairs only with consumers in
  its shared-memory domain (same host or pod); a network (nixl) producer with any, preferring its own domain
  (the bytes then move through shared memory).
- Health: `ReplicaMonitor` polls every replica's /health (readiness, load, KV transport) and /health/live (its
  shared-memory domain). A failed probe or request ejects a replica for a backoff that doubles with each
  consecutive failure (up to `eject_max_s`); it is probed again when the backoff ends, and a good probe brings
  it back.
- Discovery: a configured URL whose host name resolves to several addresses stands for one replica per address
  (a headless Kubernetes Service), re-resolved every `dns_refresh_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import ipaddress
import itertools
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlsplit, urlunsplit

import httpx

from services.kit.errors import unavailable
from services.kit.live import LIVE_PATH

log = logging.getLogger("u1serve.gateway.routing")
LOAD_BOUND = 1.25        # an affinity replica may carry this times the average load ...
LOAD_SLACK = 4           # ... plus this many requests (engines batch: a few more cost little) before keys move on


@dataclass(eq=False)
class Endpoint:
    """One replica of an engine as the gateway sees it."""
    url: str
    in_flight: int = 0            # this gateway's requests on it (counted while their response is read)
    down_until: float = 0.0       # monotonic time; routing skips it until then
    failures: int = 0             # consecutive failures: the ejection backoff doubles with each
    reported_load: int = 0        # running + queued, from its /health
    shm_domain: Optional[str] = None     # from /health/live: who can map its shared memory
    kv_transport: Optional[str] = None   # understanding: "shm" | "nixl" (its handles), from /health

    def mark_down(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def mark_up(self) -> None:
        self.down_until = 0.0
        self.failures = 0

    @property
    def looks_up(self) -> bool:
        return time.monotonic() >= self.down_until

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_load)


class EndpointPool:
    """The replicas of one engine service and the routing rules above."""

    def __init__(self, service: str, urls: list[str], retry_down_after_s: float, eject_max_s: float = 30.0):
        if not urls:
            raise ValueError(f"no {service} endpoints configured")
        self.service = service
        self.configured = list(urls)
        self.endpoints = [Endpoint(u) for u in urls]
        self._rr = itertools.count()
        self.retry_down_after_s = retry_down_after_s
        self.eject_max_s = max(eject_max_s, retry_down_after_s)

    # ------------------------------------------------------------------------------------------ choice
    def pick(self, exclude: set[str] | frozenset = frozenset(), key: Optional[int] = None,
             source: Optional[Endpoint] = None) -> Endpoint:
        """The replica for a request: by `key` (affinity) when given, else the least loaded; with `source` (the
        understanding replica that holds a job's KV) only replicas that can read it. Replicas that look up
        first; if none does, the others anyway (a probe may be stale)."""
        eligible = self.eligible(source)
        candidates = [e for e in eligible if e.url not in exclude] or eligible
        live = [e for e in candidates if e.looks_up] or candidates
        if key is not None:
            return by_affinity(live, key)
        start = next(self._rr) % len(live)
        rotated = live[start:] + live[:start]
        near = source.shm_domain if source is not None else None
        return min(rotated, key=lambda e: (e.load, not (near and e.shm_domain == near)))

    def eligible(self, source: Optional[Endpoint] = None) -> list[Endpoint]:
        """The replicas that can take a request reading `source`'s KV (all of them without a source)."""
        if source is None:
            return list(self.endpoints)
        out = [e for e in self.endpoints if can_read(source, e)]
        if not out:
            raise unavailable(f"no {self.service} replica can read the KV of {source.url} (its shm transport "
                              "reaches only its own host; run understanding with --kv-transport nixl)",
                              code="no_kv_route")
        return out

    def untried(self, tried: set[str], source: Optional[Endpoint] = None) -> bool:
        return any(e.url not in tried for e in self.eligible(source))

    @contextlib.contextmanager
    def use(self, ep: Endpoint):
        ep.in_flight += 1
        try:
            yield ep
        finally:
            ep.in_flight -= 1

    def down(self, ep: Endpoint) -> None:
        """Eject after a failure, for a backoff that doubles with each consecutive failure."""
        ep.failures += 1
        ep.mark_down(min(self.eject_max_s, self.retry_down_after_s * 2 ** (ep.failures - 1)))

    def pinned(self, url: str) -> "EndpointPool":
        """This pool narrowed to the replica at `url` (the same Endpoint object: load and down state are shared),
        for work that must stay where an earlier part of it ran (an interleaved answer's KV pool)."""
        view = copy.copy(self)
        view.endpoints = [e for e in self.endpoints if e.url == url] or [Endpoint(url)]
        return view

    # ------------------------------------------------------------------------------------------ membership
    def set_urls(self, urls: Iterable[str]) -> None:
        """The replicas are now `urls`: known ones keep their state, gone ones leave (requests on them finish)."""
        urls = list(dict.fromkeys(urls))
        if not urls:
            return
        have = {e.url: e for e in self.endpoints}
        new = [have.get(u) or Endpoint(u) for u in urls]
        if [e.url for e in new] != [e.url for e in self.endpoints]:
            log.info("%s replicas: %s", self.service, ", ".join(urls))
        self.endpoints = new


def can_read(source: Endpoint, consumer: Endpoint) -> bool:
    """Can a generation replica import KV made by this understanding replica? Network handles: anywhere; shm
    handles: only in the producer's shared-memory domain (unknown domains are given the benefit of the doubt:
    the consumer answers 503 and the request moves on)."""
    if source.kv_transport != "shm" or source.shm_domain is None or consumer.shm_domain is None:
        return True
    return source.shm_domain == consumer.shm_domain


def _score(key: int, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


def by_affinity(live: list[Endpoint], key: int) -> Endpoint:
    """Rendezvous hashing with a bounded load: the key's first replica unless it carries LOAD_BOUND times the
    average load plus LOAD_SLACK (then the next in the key's order)."""
    order = sorted(live, key=lambda e: _score(key, e.url), reverse=True)
    cap = LOAD_BOUND * (sum(e.load for e in live) + 1) / len(live) + LOAD_SLACK
    return next((e for e in order if e.load < cap), order[0])


def affinity_key(*parts: Any) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, separators=(",", ":"), default=str).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "big")


def conversation_key(body: dict) -> int:
    """A chat's affinity: its cache salt and its messages up to the first user turn (the system prompt and the
    first question: what later turns of the conversation share)."""
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    head = []
    for m in messages:
        head.append(m)
        if isinstance(m, dict) and m.get("role") == "user":
            break
    return affinity_key("chat", body.get("cache_salt"), head)


def image_key(prefix_body: dict) -> int:
    """An image job's affinity: what its prefix starts with (mode, prompt, the first input image)."""
    images = prefix_body.get("images") or []
    return affinity_key("image", prefix_body.get("cache_salt"), prefix_body.get("mode"), prefix_body.get("prompt"),
                        images[0] if images else None)


# ------------------------------------------------------------------------------------------ discovery
Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """The addresses of a host name (IPv4 ones if it has any), in a stable order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    return v4 or sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})


def is_address(host: str) -> bool:
    """An IP address literal (not a name)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def expand(url: str, resolver: Resolver = resolve) -> list[str]:
    """One URL per address of the URL's host name when it has several (a headless Service); the URL itself when
    it names an address, resolves to one address, or does not resolve now."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host or is_address(host):
        return [url]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addrs = resolver(host, port)
    except OSError:
        return [url]
    if len(addrs) <= 1:
        return [url]
    return [urlunsplit(parts._replace(netloc=f"{f'[{a}]' if ':' in a else a}:{port}")) for a in addrs]


# ------------------------------------------------------------------------------------------ health
class ReplicaMonitor:
    """Keeps the pools' view of their replicas current: DNS discovery, readiness, load, KV pairing facts."""

    def __init__(self, http: httpx.AsyncClient, pools: list[EndpointPool], headers: dict[str, str], *,
                 interval_s: float, timeout_s: float, dns_refresh_s: float, resolver: Resolver = resolve):
        self.http, self.pools, self.headers = http, pools, headers
        self.interval_s, self.timeout_s, self.dns_refresh_s = interval_s, timeout_s, dns_refresh_s
        self.resolver = resolver
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        await self.discover()
        if self.interval_s > 0 or self.dns_refresh_s > 0:
            self._task = asyncio.create_task(self._run(), name="u1serve-replica-monitor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        next_dns = time.monotonic() + self.dns_refresh_s
        while True:
            try:
                if self.dns_refresh_s > 0 and time.monotonic() >= next_dns:
                    next_dns = time.monotonic() + self.dns_refresh_s
                    await self.discover()
                if self.interval_s > 0:
                    await self.probe_all()
            except Exception:          # never let the monitor die: routing would go stale
                log.exception("replica monitor round failed")
            await asyncio.sleep(self.interval_s if self.interval_s > 0 else self.dns_refresh_s)

    async def discover(self) -> None:
        for pool in self.pools:
            urls: list[str] = []
            for url in pool.configured:
                urls += await asyncio.to_thread(expand, url, self.resolver)
            pool.set_urls(urls)

    async def probe_all(self) -> None:
        """One round: every replica that is not serving an ejection backoff."""
        await asyncio.gather(*(self.probe(pool, ep) for pool in self.pools for ep in list(pool.endpoints)
                               if ep.looks_up or ep.failures == 0))

    async def probe(self, pool: EndpointPool, ep: Endpoint) -> dict:
        """One replica's /health into its routing state; returns what the gateway's /health reports of it
        (status "ok" | "unavailable", the engine's HTTP status or the connection error)."""
        report = {"service": pool.service, "url": ep.url}
        try:
            r = await self.http.get(ep.url + "/health", headers=self.headers, timeout=self.timeout_s)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if ep.shm_domain is None or r.status_code != 200:
                live = await self.http.get(ep.url + LIVE_PATH, headers=self.headers, timeout=self.timeout_s)
                if live.status_code == 200:
                    ep.shm_domain = live.json().get("shm_domain")
        except (httpx.HTTPError, ValueError) as exc:
            pool.down(ep)
            ep.shm_domain = None       # it may come back elsewhere (a new pod at the same address)
            return {**report, "status": "unavailable", "detail": type(exc).__name__}
        ep.reported_load = _load(body)
        kv = body.get("kv") if isinstance(body, dict) else None
        if isinstance(kv, dict):
            ep.kv_transport = kv.get("transport")
        report["http_status"] = r.status_code
        if r.status_code == 200:
            ep.mark_up()
            return {**report, "status": "ok"}
        ep.mark_down(pool.retry_down_after_s)   # loading or restarting: not ready, asked again next round
        return {**report, "status": "unavailable"}


def _load(body: Any) -> int:
    """Requests running or waiting on a replica, from its /health (understanding: running + waiting;
    generation: queued + running)."""
    if not isinstance(body, dict):
        return 0
    total = 0
    for k in ("running", "waiting", "queued"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            total += v
    return total
