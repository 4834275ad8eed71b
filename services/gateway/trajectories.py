"""RL trajectories on the generation replicas that store them (docs/rl.md): which replica holds which trajectory
(remembered, LRU-bounded; a gateway restart falls back to asking every replica), and the calls on a holder's
store: find, upload, delete, and the relayed download. Every call names the trajectory's owner (OWNER_HEADER),
so a tenant reaches only its own."""
from __future__ import annotations

import asyncio
import collections
import json
from typing import Optional

import aiohttp
import httpx

from services.contract.rl import OWNER_HEADER, check_trajectory_id
from services.kit.errors import APIError, bad_request, unavailable

from .routing import EndpointPool
from .upstream import CONTROL_TIMEOUT_S, engine_headers

MAX_REMEMBERED_TRAJECTORIES = 4096
TRAJECTORY_READ_TIMEOUT_S = 300.0       # between two chunks of a trajectory from generation
RELAY_READ_BYTES = 4 << 20              # the largest chunk the trajectory relay reads from generation at once
UPLOAD_TIMEOUT_S = 60.0


class Trajectories:
    def __init__(self, http: httpx.AsyncClient, gen: EndpointPool, internal_token: Optional[str]):
        self.http, self.gen, self.internal_token = http, gen, internal_token
        self._where: collections.OrderedDict[str, str] = collections.OrderedDict()

    # ---- placement ---------------------------------------------------------------------------------------------
    def remember(self, tid: str, url: str) -> None:
        self._where[tid] = url
        self._where.move_to_end(tid)
        while len(self._where) > MAX_REMEMBERED_TRAJECTORIES:
            self._where.popitem(last=False)

    def forget(self, tid: str) -> None:
        self._where.pop(tid, None)

    def _candidates(self, tid: str) -> list[str]:
        known = self._where.get(tid)
        urls = [e.url for e in self.gen.endpoints]
        return [known] + [u for u in urls if u != known] if known else urls

    # ---- calls on a holder ------------------------------------------------------------------------------------
    def owned(self, owner: str) -> dict[str, str]:
        """The engine headers of a trajectory call: the internal token and whose trajectory it is."""
        return {**engine_headers(self.internal_token), OWNER_HEADER: owner}

    async def holder(self, tid: str, owner: str) -> str:
        """The generation replica holding `owner`'s trajectory `tid` (404 trajectory_not_found when none does:
        also when it is another tenant's, so an id tells nothing of who else exists)."""
        try:
            check_trajectory_id(tid)
        except ValueError as exc:
            raise bad_request(str(exc), param="trajectory_id") from None
        hdrs = self.owned(owner)
        for url in self._candidates(tid):
            try:
                r = await self.http.get(f"{url}/internal/rl/trajectories/{tid}/info", headers=hdrs,
                                        timeout=CONTROL_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                self.remember(tid, url)
                return url
        self.forget(tid)
        raise APIError(404, f"trajectory {tid!r} not found (never stored, deleted, or evicted)",
                       param="trajectory_id", code="trajectory_not_found")

    async def delete(self, url: str, tid: str, owner: str) -> Optional[httpx.Response]:
        """DELETE `owner`'s trajectory on a generation replica (None when unreachable)."""
        try:
            return await self.http.delete(f"{url}/internal/rl/trajectories/{tid}", headers=self.owned(owner),
                                          timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError:
            return None

    async def delete_known(self, tid: str, owner: str) -> None:
        """DELETE /v1/rl/trajectories/{id}: the holder frees it (404 when none holds it)."""
        url = await self.holder(tid, owner)
        answer = await self.delete(url, tid, owner)
        self.forget(tid)
        if answer is not None and answer.status_code != 200:
            raise engine_error(answer.status_code, answer.content)

    async def upload(self, url: str, tid: str, blob: bytes, owner: str) -> None:
        """Store a client's trajectory (safetensors bytes) on a generation replica, for a score."""
        try:
            r = await self.http.post(f"{url}/internal/rl/trajectories/{tid}", content=blob,
                                     headers={**self.owned(owner), "content-type": "application/octet-stream"},
                                     timeout=UPLOAD_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise unavailable(f"generation service unreachable: {type(exc).__name__}",
                              code="generation_unavailable")
        if r.status_code != 200:
            raise engine_error(r.status_code, r.content)

    async def open_download(self, tid: str, owner: str,
                            byte_range: Optional[str]) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
        """The holder's GET of a trajectory (with the client's `Range`), its body not yet read. aiohttp rather
        than the gateway's httpx client for this one relay: httpcore reads a body 64 KiB at a time and spent 6x
        the CPU per byte here (a GB-sized body is CPU-bound in the gateway; docs/benchmarks/rl.md); aiohttp reads
        what the socket has, up to RELAY_READ_BYTES, and stops reading (TCP back-pressure) while twice that
        waits unsent."""
        url = await self.holder(tid, owner)
        headers = self.owned(owner)
        if byte_range is not None:
            headers["range"] = byte_range
        session = aiohttp.ClientSession(read_bufsize=RELAY_READ_BYTES, auto_decompress=False,
                                        timeout=aiohttp.ClientTimeout(sock_connect=CONTROL_TIMEOUT_S,
                                                                      sock_read=TRAJECTORY_READ_TIMEOUT_S))
        try:
            return session, await session.get(f"{url}/internal/rl/trajectories/{tid}", headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            await session.close()
            raise unavailable(f"generation service unreachable: {type(exc).__name__}",
                              code="generation_unavailable")


def engine_error(status: int, body: bytes, headers: Optional[dict[str, str]] = None) -> APIError:
    """Generation's OpenAI-shaped refusal, passed on with `headers` (502 when it is not one)."""
    try:
        err = json.loads(body)["error"]
        return APIError(status, err["message"], param=err.get("param"), code=err.get("code"), headers=headers)
    except (ValueError, KeyError, TypeError):
        return APIError(502, f"generation answered {status}", code="upstream_error")
