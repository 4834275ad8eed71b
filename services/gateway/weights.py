"""Live weight updates of the whole stack (docs/rl.md), two-phase over every replica of both engines
(services/kit/weights_api.py): stage everywhere (each engine reads and validates its tensors on all its ranks),
then commit understanding, then generation. Any stage failure aborts every staged copy and answers the engine's
error (a refused update is a 400 naming the keys): the old weights keep serving. Understanding commits first, so
generation, still on the old version, holds the handles of the new one until its own commit instead of refusing
them (generation/weights.py). One update at a time per gateway (`WeightsUpdater.lock`)."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Optional

from services.contract.rl_weights import WeightsUpdateRequest, next_version
from services.kit.errors import APIError

from .fanout import Fanout, Replica, first_failure

OP_TIMEOUT_S = 1800.0                # stage reads a branch from disk; commit waits for the jobs in flight
STATUS_TIMEOUT_S = 10.0
SERVICES = ("understanding", "generation")      # the commit order


class WeightsUpdater:
    def __init__(self, fanout: Fanout):
        self.fanout = fanout
        self.lock = asyncio.Lock()

    async def versions(self) -> dict[str, dict[str, Optional[str]]]:
        """{service: {url: the version it serves (None: unreachable)}}."""
        async def one(replica: Replica) -> Optional[str]:
            try:
                answer = await self.fanout.call(replica, "GET", "/internal/weights", None, STATUS_TIMEOUT_S)
            except APIError:
                return None
            return answer.get("weights_version")
        replicas = self.fanout.replicas()
        out: dict[str, dict[str, Optional[str]]] = {s: {} for s in SERVICES}
        for replica, v in zip(replicas, await asyncio.gather(*(one(r) for r in replicas))):
            out[replica.service][replica.url] = v
        return out

    async def status(self) -> dict:
        """GET /v1/rl/weights: the version of each engine (None where its replicas differ) and of every replica."""
        versions = await self.versions()
        und, gen = same_version(versions["understanding"]), same_version(versions["generation"])
        return {"weights_version": und if und == gen else None, "generation": gen, "understanding": und,
                "reference": None, "replicas": versions}

    async def update(self, req: WeightsUpdateRequest) -> dict:
        """Stage on every replica, then commit (understanding, then generation); see the module doc."""
        async with self.lock:
            t0 = time.perf_counter()
            versions = await self.versions()
            current = same_version({**{f"u{u}": v for u, v in versions["understanding"].items()},
                                    **{f"g{u}": v for u, v in versions["generation"].items()}})
            if current is None and req.version is None:
                raise APIError(409, f"the engines serve different weights versions ({versions}); give `version`",
                               param="version", code="weights_versions_differ")
            version = req.version or next_version(current)
            op = {"id": "w-" + os.urandom(6).hex(), "version": version, "path": req.path, "lora": req.lora,
                  "lora_strength": req.lora_strength}
            replicas = self.fanout.replicas()
            staged = await self.fanout.everywhere("/internal/weights/stage", op, OP_TIMEOUT_S, replicas=replicas)
            failed = first_failure(staged)
            if failed is not None:
                await self._abort(replicas, op["id"])
                raise failed
            t_stage = time.perf_counter() - t0
            updated = {s: 0 for s in SERVICES}
            for replica, r in zip(replicas, staged):
                updated[replica.service] += int(r.get("updated", 0))
            drain = {}
            for service in SERVICES:
                done = await self.fanout.everywhere("/internal/weights/commit", {"id": op["id"]}, OP_TIMEOUT_S,
                                                    replicas=[r for r in replicas if r.service == service])
                bad = [e for e in done if isinstance(e, BaseException)]
                if bad:
                    await self._abort(replicas, op["id"])
                    raise APIError(500, f"the weight update failed while committing on {service} ({bad[0]}); some "
                                   f"engines may serve version {version!r}, others the old one: GET /v1/rl/weights "
                                   "tells which, and a new update brings them together",
                                   code="weights_commit_failed")
                drain[service] = max(float(r.get("drain_seconds") or 0.0) for r in done)
            t = time.perf_counter() - t0
            return {"weights_version": version, "seconds": t, "stage_seconds": t_stage,
                    "commit_seconds": t - t_stage, "drain_seconds": drain, "updated": updated}

    async def _abort(self, replicas: list[Replica], op_id: str) -> None:
        await self.fanout.everywhere("/internal/weights/abort", {"id": op_id}, STATUS_TIMEOUT_S, replicas=replicas)


def same_version(versions: dict[str, Optional[str]]) -> Optional[str]:
    """The one version all of `versions` serve (None when they differ)."""
    vs = set(versions.values())
    return vs.pop() if len(vs) == 1 else None
