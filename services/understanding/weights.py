"""Live weight updates in the understanding engine (the two-phase ops of services/kit/weights_api.py).

Rank 0 takes each op from the HTTP process (ZMQ), broadcasts it to the TP ranks on the control group (so
every rank stages its own shard: services/model/weights_io.py), and the ranks agree on the outcome.

A commit drains: admission of new requests pauses (the scheduler's `admitting`), the running requests finish
(a preempted one is let back in: its earlier tokens were sampled under the old weights), then every rank
copies the weights in place, the radix prefix cache is emptied (no KV computed under the old weights is read
again) and admission resumes. So every chat answer and every exported prefix comes from one version, and
each exported handle carries it (`weights_version`) for generation to check.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("u1serve.understanding.weights")


@dataclass
class WeightsOp:
    """HTTP process -> rank 0 -> the other ranks: one weights op (stage / commit / abort)."""
    op: dict


class EngineWeights:
    """One rank's side; rank 0 also queues the ops and decides when a commit may run."""

    def __init__(self, model, tp):
        from services.model.weights_io import LiveWeights
        self.live = LiveWeights(model)
        self.tp = tp
        self.ops: list[dict] = []
        self.draining: Optional[dict] = None
        self.drain_started = 0.0

    @property
    def version(self) -> str:
        return self.live.version

    # -- rank 0 ------------------------------------------------------------------------------------
    def take(self, op: dict) -> None:
        self.ops.append(op)

    def next_op(self, sched) -> Optional[dict]:
        """The op to run now (None: none, or a commit still draining). Pauses admission while a commit waits.
        While a stage reads its files (in a thread of each rank), only the polls of that read."""
        if self.live.reading is not None:
            return self.live.poll_op()
        if self.draining is None and self.ops:
            op = self.ops.pop(0)
            if op["op"] != "commit":
                return op
            self.draining, self.drain_started = op, time.monotonic()
            sched.admitting = False
        if self.draining is not None and not sched.running and not any(r.admitted_once for r in sched.waiting):
            op, self.draining = self.draining, None
            return {**op, "drain_seconds": time.monotonic() - self.drain_started}
        return None

    def after(self, op: dict, sched) -> None:
        """Rank 0 after an op: a commit empties the prefix cache and resumes admission."""
        if op["op"] != "commit":
            return
        sched.cache.reset()
        if sched.cache.total_tokens:     # nothing runs, so nothing is referenced; a guard
            log.error("prefix cache kept %d tokens after a weight update", sched.cache.total_tokens)
        sched.admitting = True

    # -- every rank ------------------------------------------------------------------------------
    def run(self, op: dict, rank: int) -> Optional[dict]:
        """Run `op` here, agree with the other TP ranks; rank 0 gets the reply (the others None)."""
        reply = self.live.run(op, self._gather)
        return reply if rank == 0 else None

    def _gather(self, obj) -> list:
        if self.tp is None:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.tp.world_size
        dist.all_gather_object(out, obj, group=self.tp.ctrl_group)
        return out


# -- the HTTP process ----------------------------------------------------------------------------------
class UnderstandingWeights:
    """The internal weights API of the understanding service (routes exist before the engine does: `bind`)."""

    def __init__(self):
        from services.kit.weights_api import WeightsEndpoint
        self.engine = None
        self.endpoint = WeightsEndpoint("understanding", self._send)

    def bind(self, engine) -> None:
        self.engine = engine
        engine.on_weights = self.endpoint.reply

    def _send(self, op: dict) -> bool:
        e = self.engine
        unit = e.supervisor.unit if e is not None else None
        return bool(e is not None and e.ready and unit is not None and unit.send(WeightsOp(op)))
