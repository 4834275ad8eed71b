"""Rank 0's scheduler: decides what the next step runs. It takes the HTTP process's commands (protocol.py) from
the inbox and returns the StepPlan every rank executes: the running jobs to abort, the queued jobs that join
(FIFO within `max_batch_tokens` image tokens per forward and `max_running_jobs`), the weights op that runs now
(weights.py: a commit waits until no job runs, and admission pauses meanwhile), and whether to stop. After the
plan ran, `update` takes what it did.

It owns the pool pages of every job it holds: a job that leaves without its import (aborted while queued,
refused, an admission that failed) has its pages freed here and nowhere else (`_drop`); an admitted job's import
frees them (Engine.admit). The emitter only encodes.

The batching rule: a queued job joins the running batch only while the forward's rows (image tokens x
branches on the busiest rank) stay within `max_batch_tokens`; otherwise it waits its turn, FIFO, and runs
when enough of the batch has finished (a single job above the budget runs alone). Batching pays only while
a step is launch- or latency-bound: once one forward holds ~8k rows the GEMMs are saturated, so packing more
rows gains nothing and costs (H200, fp8 + graphs, 2026-12-01: two concurrent 2048² CFG jobs, 16,384 rows a
step, took 21.0 s together vs 9.1 s alone: 0.87x of running them one after the other, and both finish last;
1024² jobs, 2,048 rows each, batch well). config.BATCH_TOKENS = 8,192 rows, one 2048² CFG job, is the default:
2048² CFG jobs run in turns, up to four 1024² CFG jobs (or eight guidance-1 ones) batch. bench/gpu_defaults.sh
measures the pair under the old budget (16,384) and this one.
"""
from __future__ import annotations

import collections
import queue
from typing import Callable, Iterable, Optional

from services.contract.image import GenerateRequest
from services.kit.errors import APIError

from .inputs import busiest_rank_tokens
from .protocol import AbortJob, StepPlan, Stop, SubmitJob, WeightsOp

IDLE_WAIT_S = 0.5          # an idle rank 0 wakes this often (a stop, a weights op)


class Scheduler:
    def __init__(self, max_batch_tokens: int, max_running_jobs: int, world: int, sp: int = 1, *,
                 weights=None, release: Callable[[Iterable[dict]], None] = lambda handles: None,
                 failed: Callable[[str, dict], None] = lambda request_id, event: None):
        """world: CFG ranks; sp: sequence-parallel ranks per CFG rank; weights: the rank's RankWeights (None:
        no live weight updates); release(handles) frees pool pages (the prefix source's); failed(request_id,
        error event) tells the HTTP process that a job ended with an error."""
        self.max_batch_tokens = max_batch_tokens
        self.max_running_jobs = max_running_jobs
        self.world = world
        self.sp = sp
        self.weights = weights
        self.release = release
        self.failed = failed
        self.pending: collections.deque[GenerateRequest] = collections.deque()
        self.stopping = False

    def tokens(self, spec: GenerateRequest) -> int:
        return busiest_rank_tokens(spec, self.world, self.sp)

    # -- the plan ----------------------------------------------------------------------------------
    def schedule(self, inbox: queue.SimpleQueue, running: list) -> StepPlan:
        """The commands waiting in `inbox` (waits for one when nothing runs or waits), then the next plan."""
        aborts = [rid for msg in _drain(inbox, block=not running and not self.pending)
                  if (rid := self.take(msg, running)) is not None]
        if self.weights is not None:
            self.weights.screen(self.pending, self.refuse)   # jobs whose prefix another weights version computed
        op = None if self.stopping or self.weights is None else self.weights.next_op(bool(running))
        admit = []
        if not self.stopping and (self.weights is None or self.weights.admitting(op)):
            admit = self.pick(sum(self.tokens(j.spec) for j in running), len(running))
        return StepPlan(admit=admit, abort=aborts, weights=op, stop=self.stopping)

    def take(self, msg, running: list) -> Optional[str]:
        """Apply one command; the request id of a running job to abort, if it is one."""
        match msg:
            case Stop():
                self.stopping = True
            case SubmitJob(job=job):
                self.pending.append(job)
            case WeightsOp(op=op):
                self.weights.take(op)
            case AbortJob(request_id=rid):      # the HTTP process already ended the stream: just stop the work
                spec = self.remove(rid) or (self.weights.remove_held(rid) if self.weights is not None else None)
                if spec is not None:            # never imported: free its pages now, not at lease expiry
                    self._drop(spec)
                elif any(j.request_id == rid for j in running):
                    return rid
            case _:
                raise TypeError(f"unknown command {msg!r}")
        return None

    def pick(self, running_tokens: int, running_jobs: int) -> list[GenerateRequest]:
        out = []
        budget = self.max_batch_tokens - running_tokens
        while self.pending and running_jobs + len(out) < self.max_running_jobs:
            need = self.tokens(self.pending[0])
            if need > budget and (running_jobs or out):
                break  # strict FIFO: a big job is not overtaken forever by small ones
            out.append(self.pending.popleft())
            budget -= need
        return out

    def remove(self, request_id: str) -> GenerateRequest | None:
        for spec in self.pending:
            if spec.request_id == request_id:
                self.pending.remove(spec)
                return spec
        return None

    # -- after the plan ran ------------------------------------------------------------------------
    def update(self, plan: StepPlan, failed: dict[str, dict]) -> None:
        """What `plan` did on every rank: the admissions in `failed` ({request_id: error event}) end (their
        pages freed here; the failure itself the emitter encodes with the plan); after a commit the jobs held for
        it queue first, after an abort they are refused (a LoRA load / unload changes no version: nothing is held
        for it)."""
        for spec in plan.admit:
            if spec.request_id in failed:
                self._drop(spec)
        if plan.weights is not None and plan.weights["op"] in ("commit", "abort"):
            self.weights.release_held(self.pending, self.refuse)

    def refuse(self, spec: GenerateRequest, err: APIError) -> None:
        """A queued job ends with `err` before its import."""
        self._drop(spec)
        self.failed(spec.request_id, err.event())

    def _drop(self, spec: GenerateRequest) -> None:
        """The one place a job's pages are freed without its import (idempotent: a handle frees only pages it
        still owns, so an admission that imported some branches before failing is covered too)."""
        self.release(spec.handles.values())


def _drain(inbox: queue.SimpleQueue, block: bool) -> list:
    msgs = []
    try:
        msgs.append(inbox.get(timeout=IDLE_WAIT_S) if block else inbox.get_nowait())
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return msgs
