"""Live weight updates in the generation engine (the two-phase ops of services/kit/weights_api.py).

Ranks: rank 0 takes the ops from the HTTP process and puts each into the step plan it broadcasts, so every
CFG / SP rank stages (reads + validates its copy: services/model/weights_io.py) and commits in the same loop
iteration; the ranks agree on the outcome (one all-gather) and rank 0 replies.

No job sees two versions: a commit waits until no job runs (drain: admission pauses, the running jobs finish
their steps, the weights are copied in place, admission resumes). Drain rather than a version pinned per job,
because pinning would keep two copies of the weights on the GPU (16 GB more for the 8B branch) and jobs are
short (seconds). Each job's prefix KV was computed by understanding under the version its handles carry
(`weights_version`): a queued job whose handles carry the staged version waits for the commit; one with any
other version than this engine's is refused with a retryable 503 `weights_version_mismatch` (the gateway
retries it once), so an image never mixes an old prefix with new denoising weights. Handles without a version
(older producers, warm-up) are taken as they are.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional

from services.contract.rl_weights import WEIGHTS_VERSION_MISMATCH
from services.kit.errors import APIError
from services.kit.weights_api import WeightsEndpoint

from .protocol import WeightsOp



def handles_version(spec) -> Optional[str]:
    """The weights version a job's prefixes were computed under (None: not stamped)."""
    versions = {h.get("weights_version") for h in spec.handles.values() if isinstance(h, dict)} - {None}
    if len(versions) > 1:
        return "mixed:" + ",".join(sorted(versions))
    return versions.pop() if versions else None


class RankWeights:
    """One rank's side; rank 0 also queues the ops and paces the commit."""

    def __init__(self, engine, comm):
        from services.model.weights_io import LiveWeights
        self.live = LiveWeights(engine.model)
        self.engine = engine
        self.comm = comm
        engine.weights_version = self.live.version
        self.ops: collections.deque = collections.deque()
        self.draining: Optional[dict] = None          # a commit waiting for the running jobs to end
        self.drain_started = 0.0
        self.held: list = []                          # jobs of the staged version, waiting for its commit

    # -- rank 0 ------------------------------------------------------------------------------------
    def take(self, op: dict) -> None:
        self.ops.append(op)

    def next_op(self, running: bool) -> Optional[dict]:
        """The op every rank runs this iteration (None: none yet); a commit only once no job runs; while a stage
        reads its files (in a thread of each rank) only the polls of that read."""
        if self.live.reading is not None:
            return self.live.poll_op()
        if self.draining is None and self.ops:
            op = self.ops.popleft()
            if op["op"] != "commit":
                return op
            self.draining, self.drain_started = op, time.monotonic()
        if self.draining is not None and not running:
            op, self.draining = self.draining, None
            return {**op, "drain_seconds": time.monotonic() - self.drain_started}
        return None

    def admitting(self, op: Optional[dict]) -> bool:
        """False while a commit waits or runs: no job starts under weights about to change."""
        return self.draining is None and not (op and op["op"] == "commit")

    def screen(self, pending: collections.deque, refuse: Callable[[object, APIError], None]) -> None:
        """Take out of the queue the jobs whose prefixes another version computed: held (the staged version:
        they run after its commit) or refused (retryable)."""
        if not pending:
            return
        staged, keep = self.live.staged_version, []
        for spec in pending:
            v = handles_version(spec)
            if v is None or v == self.live.version:
                keep.append(spec)
            elif v == staged:
                self.held.append(spec)
            else:
                refuse(spec, mismatch(v, self.live.version))
        if len(keep) != len(pending):
            pending.clear()
            pending.extend(keep)

    def release_held(self, pending: collections.deque, refuse: Callable[[object, APIError], None]) -> None:
        """After a commit: the held jobs go first; after an abort they are refused (that version never comes)."""
        held, self.held = self.held, []
        for spec in reversed(held):
            if handles_version(spec) == self.live.version:
                pending.appendleft(spec)
            else:
                refuse(spec, mismatch(handles_version(spec), self.live.version))

    def remove_held(self, request_id: str):
        for spec in self.held:
            if spec.request_id == request_id:
                self.held.remove(spec)
                return spec
        return None

    # -- every rank ------------------------------------------------------------------------------
    def run(self, op: dict) -> Optional[dict]:
        """Run `op` here, agree with the other ranks; rank 0 gets the reply (the others None)."""
        reply = self.live.run(op, self.comm.all_gather_objects)
        self.engine.weights_version = self.live.version
        self.engine.graphs.release()   # graphs kept across jobs were captured on the weights before the op
        streamer = getattr(self.engine.model, "weight_streamer", None)
        if streamer is not None:    # a commit copied into the layers' host copies: the device slots are stale
            streamer.invalidate()
        return reply if self.comm.rank == 0 else None


def mismatch(theirs: Optional[str], ours: str) -> APIError:
    return APIError(503, f"the image prefix was computed under weights version {theirs!r}, generation now serves "
                    f"{ours!r} (a weight update happened in between); retry the request", code=WEIGHTS_VERSION_MISMATCH)


# -- the HTTP process ----------------------------------------------------------------------------------
def weights_endpoint(engine) -> WeightsEndpoint:
    """The internal weights API of the generation service over its EngineSupervisor (ops go to rank 0 over
    the command link; rank 0 replies with a WeightsReply)."""
    def send(op: dict) -> bool:
        unit = engine.unit
        if unit is None or not engine.ready:
            return False
        unit.send(WeightsOp(op))
        return True
    return WeightsEndpoint("generation", send)
