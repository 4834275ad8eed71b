"""Calls to every engine replica at once (the weights update, LoRA load / unload): one control call, answered as
JSON or raised as the engine's APIError, and the same call to every replica of both engines, understanding first.
The image and chat paths go through routing instead (one replica per request)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from services.kit.errors import APIError, from_upstream, unavailable

from .routing import EndpointPool
from .upstream import engine_headers


@dataclass(frozen=True)
class Replica:
    service: str        # "understanding" | "generation"
    url: str


class Fanout:
    """The engine replicas as one group for control calls."""

    def __init__(self, http: httpx.AsyncClient, pools: list[EndpointPool], internal_token: Optional[str]):
        self.http, self.pools, self.internal_token = http, pools, internal_token

    def replicas(self) -> list[Replica]:
        """Every engine replica, in the pools' order (understanding first)."""
        return [Replica(pool.service, ep.url) for pool in self.pools for ep in list(pool.endpoints)]

    async def call(self, replica: Replica, method: str, path: str, body: Optional[dict], timeout_s: float) -> Any:
        """One call's JSON answer; a refusal is the engine's error, an unreachable replica a 503
        `<service>_unavailable`."""
        try:
            r = await self.http.request(method, replica.url + path, json=body,
                                        headers=engine_headers(self.internal_token), timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise unavailable(f"{replica.service} service at {replica.url} is unreachable ({type(exc).__name__})",
                              code=f"{replica.service}_unavailable") from None
        try:
            payload = r.json()
        except ValueError:
            payload = r.text
        if r.status_code != 200:
            raise from_upstream(r.status_code, payload, replica.service)
        return payload

    async def everywhere(self, path: str, body: Optional[dict], timeout_s: float, method: str = "POST",
                         replicas: Optional[list[Replica]] = None) -> list[Any]:
        """The same call to every replica (or `replicas`) at once: each one's answer or exception, in order."""
        group = self.replicas() if replicas is None else replicas
        return await asyncio.gather(*(self.call(r, method, path, body, timeout_s) for r in group),
                                    return_exceptions=True)


def first_failure(results: list[Any]) -> Optional[BaseException]:
    """The error to answer for a fan-out: the first engine refusal (APIError), else the first exception."""
    failed = [r for r in results if isinstance(r, BaseException)]
    return next((e for e in failed if isinstance(e, APIError)), failed[0] if failed else None)
