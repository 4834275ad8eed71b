"""The engine side of the HTTP process: runs the rank processes under the one supervisor (kit.supervisor),
admits jobs (bounded queue -> 429), routes each engine event to its job, and ends every job exactly once.

Threads and what they may block on: the event loop only queues (link outbox, KV keeper, the stream's
asyncio queue); the link's writer thread blocks on the command pipe; its reader thread on the event pipe
(and never on a lock held across I/O); the kit supervisor's watcher on process liveness; the expiry thread
on nothing but its timer. No cycle of waits exists, so no burst of requests or images can deadlock them.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from typing import Callable, Optional

from services.contract.health import PHASE_FIELD, EnginePhase
from services.contract.image import GenerateRequest
from services.kit.engine_thread import EngineThread
from services.kit.errors import APIError, overloaded, unavailable
from services.kit.proc import start_without_main
from services.kit.restart import RestartPolicy
from services.kit.supervisor import Supervisor
from services.base.netutil import free_port

from . import shared_trajectory
from .capacity import queue_limit
from .config import GenerationConfig
from .job_table import END, Deliver, JobTable, Ticket
from .leases import HandleKeeper, JobLease
from .link import Outbox, start_reader
from .protocol import (AbortJob, Fatal, Image, JobDone, JobFailed, JobStarted, Preview, Progress, Ready, RlResult,
                       Starting, Stop, SubmitJob, TrajectoryHeld)

log = logging.getLogger("u1serve.generation")

_EXPIRY_EVERY_S = 0.5


class EngineRanks:
    """One incarnation: the rank processes and the link to rank 0 (a kit.supervisor Unit)."""

    def __init__(self, ctx, cfg: GenerationConfig, on_message: Callable[["EngineRanks", object], None],
                 grace_s: float = 5.0):
        from .worker import run_rank, run_rank_thread
        cmd_r, cmd_w = ctx.Pipe(duplex=False)     # HTTP process -> rank 0
        evt_r, evt_w = ctx.Pipe(duplex=False)     # rank 0 -> HTTP process
        world = cfg.world
        port = free_port() if world > 1 else 0
        threaded = cfg.engine_unit == "thread"   # the fused mode: rank 0 is a thread of this process
        self.procs = [EngineThread(run_rank_thread, (cfg, cmd_r, evt_w), "u1-gen-rank0")] if threaded else \
            [ctx.Process(target=run_rank, name=f"u1-gen-rank{r}", daemon=True,
                         args=(r, world, port, cfg, cmd_r if r == 0 else None, evt_w if r == 0 else None))
             for r in range(world)]
        self.started_at = time.monotonic()
        try:
            for p in self.procs:
                start_without_main(p)
        finally:
            if not threaded:    # rank 0 holds the only other ends: its death is EOF / EPIPE here
                cmd_r.close()   # (a thread closes its ends itself when its loop ends)
                evt_w.close()
        self.outbox = Outbox(cmd_w, "u1-gen-commands")
        self.reader = start_reader(evt_r, lambda msg: on_message(self, msg), "u1-gen-events")
        self.grace_s = grace_s
        self.ready = False
        self.dead = False
        self.fatal: Optional[str] = None
        self.capacity: Optional[dict] = None
        self.phase = EnginePhase.STARTING      # rank 0's Starting messages move it on (/health "phase")
        self._asked_to_stop = False

    def send(self, msg) -> None:
        """A protocol.py command to rank 0 (dropped once the ranks are dead)."""
        if not self.dead:
            self.outbox.send(msg)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    # -- kit.supervisor.Unit ---------------------------------------------------------------------
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def exit_reason(self) -> str:
        if self.fatal:
            return self.fatal
        return "engine rank exit codes " + str([p.exitcode for p in self.procs])

    def stopped_on_purpose(self) -> bool:
        return self._asked_to_stop

    def stop(self) -> None:
        """All ranks alive: ask rank 0 to stop (it stops the others) and wait up to the grace period; then
        kill whatever is left. Idempotent."""
        if self.alive() and not self._asked_to_stop:
            self._asked_to_stop = True
            self.outbox.send(Stop())
            deadline = time.monotonic() + self.grace_s
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self.dead = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        self.outbox.close(timeout=2)    # the readers are dead: a blocked write has failed by now
        self.reader.join(5)


class EngineSupervisor:
    def __init__(self, cfg: GenerationConfig, keeper: HandleKeeper, *,
                 on_stats: Callable[[object], None] = lambda msg: None,
                 on_restart: Callable[[], None] = lambda: None,
                 on_give_up: Callable[[str], None] = lambda why: None,
                 max_queued: int = 0, max_queue_wait_s: float = 600.0,
                 policy: RestartPolicy = RestartPolicy()):
        """on_stats: the engine's stats and weights replies (protocol.py), from the link reader thread."""
        self.cfg = cfg
        self.world = cfg.world
        self.keeper = keeper
        self.on_stats = on_stats
        self.on_restart = on_restart
        self.on_give_up = on_give_up
        self.configured_queue = max_queued
        self.max_queued = max_queued or None          # resolved when the engine reports its memory
        self.max_queue_wait_s = max_queue_wait_s
        self.table = JobTable()
        self.rejected = 0
        self._job_seconds = 10.0                      # running mean of job time: the Retry-After hint
        self._ctx = mp.get_context("spawn")
        if cfg.engine_unit == "thread":   # a dead engine thread is not restarted in place: the process is
            policy = RestartPolicy(max_failures=1)
        self.sup = Supervisor("generation engine", self._spawn, policy=policy, on_death=self._on_death,
                              on_give_up=self._gave_up)
        self._stop = threading.Event()
        self._expiry: Optional[threading.Thread] = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.keeper.start()
        self.sup.start()
        self._expiry = threading.Thread(target=self._expire_loop, name="u1-gen-queue-timeout", daemon=True)
        self._expiry.start()

    def end_all(self) -> None:
        """Shutting down: every job in flight ends now with a 503 (its stream closes, so the server need not
        wait for long jobs); never blocks."""
        for t in self.table.take_all():
            self._fail(t, unavailable("the generation service is shutting down; retry the request",
                                      code="shutting_down"))
            t.unit.send(AbortJob(t.request_id))

    def stop(self) -> None:
        """Fail what is in flight (503), stop the ranks gracefully, stop the threads."""
        self._stop.set()
        self.end_all()
        self.sup.stop()
        self.keeper.stop()
        if self._expiry is not None:
            self._expiry.join(2)

    @property
    def unit(self) -> Optional[EngineRanks]:
        return self.sup.unit  # type: ignore[return-value]

    @property
    def ready(self) -> bool:
        u = self.unit
        return self.sup.ready and u is not None and u.ready and not u.dead

    def status(self) -> dict:
        queued, running = self.table.counts()
        u = self.unit
        s = self.sup.status()
        state = "ok" if self.ready else ("starting" if s["state"] in ("starting", "ready") else s["state"])
        phase = EnginePhase.READY if self.ready else (u.phase if u is not None else EnginePhase.STARTING)
        return {"status": state, PHASE_FIELD: phase.value, "queued": queued, "running": running,
                "max_queued": self.max_queued,
                "restarts": s["restarts"], "last_error": s["last_error"], "failure": s["failure"],
                "engine_pids": u.pids if u is not None and not u.dead else [],
                "pending_commands": u.outbox.pending() if u is not None else 0,
                "kv_commands": self.keeper.pending()}

    # -- jobs (event loop) ---------------------------------------------------------------------
    def submit(self, job: GenerateRequest, deliver: Deliver) -> JobLease:
        """Queue a job; `deliver` gets its events, from any thread. Returns its lease (its stream reports its end
        there). Raises APIError 503 / 409 / 429 (the job's KV is then still the caller's)."""
        unit = self.unit

        def admit(queued: int, duplicate: bool) -> None:
            if unit is None or not self.ready or unit is not self.unit:
                raise unavailable("the generation engine is not ready"
                                  + (f" ({self.sup.failure})" if self.sup.failure else ""),
                                  code="engine_unavailable")
            if duplicate:
                raise APIError(409, f"request_id {job.request_id!r} is already running", param="request_id",
                               code="duplicate")
            if self.max_queued is not None and queued >= self.max_queued:
                self.rejected += 1
                raise overloaded(f"the generation queue is full ({queued} jobs wait for the engine, limit "
                                 f"{self.max_queued}); retry later", self.retry_after_s(),
                                 code="queue_full")

        ticket = Ticket(job, deliver, unit, self.keeper.lease(job.handles.values()))
        self.table.add_if(ticket, admit)
        ticket.lease.hold()
        unit.send(SubmitJob(job))
        return ticket.lease

    def abort(self, request_id: str, reason: str = "request cancelled") -> bool:
        """End the job now (its stream gets 499 cancelled); the engine aborts it before its next step."""
        t = self.table.finish(request_id, JobFailed(request_id, APIError(499, reason, type="cancelled",
                                                                          code="cancelled").event()))
        if t is None:
            return False
        self._after_end(t)
        return True

    def retry_after_s(self) -> float:
        return min(60.0, max(1.0, self._job_seconds))

    # -- internals -------------------------------------------------------------------------------
    def _spawn(self) -> EngineRanks:
        if self.sup.unit is not None:
            self.on_restart()
        return EngineRanks(self._ctx, self.cfg, self._on_message)

    def _fail(self, t: Ticket, err: APIError) -> None:
        """A job taken from the table fails with the engine (dead, or the service stopping)."""
        t.deliver(JobFailed(t.request_id, err.event()))
        t.deliver(END)
        t.lease.failed()

    def _after_end(self, t: Ticket) -> None:
        """A job ended on this side: stop it in the engine (its lease frees its pages if it never imported them)."""
        t.unit.send(AbortJob(t.request_id))
        t.lease.ended()

    def _on_message(self, unit: EngineRanks, msg) -> None:
        """The link reader thread: route one engine event (no blocking here)."""
        match msg:
            case Ready(capacity=capacity):
                unit.capacity = capacity
                self.max_queued = queue_limit(self.configured_queue, capacity, self.cfg.max_running_jobs)
                unit.ready = True
                self.sup.mark_ready(unit)
                log.info("generation engine ready: %d rank(s), %.1f s, queue limit %d", self.world,
                         time.monotonic() - unit.started_at, self.max_queued)
            case Starting(phase=phase):
                unit.phase = EnginePhase(phase)
                log.info("generation engine start: %s", phase)    # in the log too: /health shows only the latest
            case Fatal(message=message):     # the rank logged it with its traceback; the supervisor reports it
                unit.fatal = message
            case JobStarted() | Progress() | Preview() | Image() | RlResult() | JobDone() | JobFailed():
                self._on_job_event(unit, msg)
            case _:                          # stats, weights replies
                self.on_stats(msg)

    def _on_job_event(self, unit: EngineRanks, msg) -> None:
        rid = msg.request_id
        t = self.table.get(rid)
        if isinstance(msg, RlResult) and msg.segment is not None:   # from here this process owns the segment
            name = msg.segment.name
            msg = shared_trajectory.adopt(msg, wanted=t is not None and t.unit is unit)
            unit.send(TrajectoryHeld(name))          # rank 0 lets its lock go: held here now, or unlinked
            if msg is None:
                return
        if t is None or t.unit is not unit:          # ended already (aborted, timed out) or a stale unit:
            if isinstance(msg, Image) and msg.image_handle:     # a float image nobody will read back
                self.keeper.stray_image(msg.image_handle)
            return
        match msg:
            case JobStarted():                       # its KV imported: the engine frees it
                t.lease.imported()
                self.table.mark_started(rid)
            case JobDone():
                if self.table.finish(rid) is not None:
                    self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.monotonic() - t.submitted)
                    t.lease.ended()
            case JobFailed():
                if self.table.finish(rid, msg) is not None:
                    t.lease.failed()
            case _:
                if isinstance(msg, Image) and msg.image_handle and not t.lease.image(msg.image_handle):
                    return                           # its stream has closed: the lease freed the image
                t.deliver(msg)

    def _on_death(self, reason: str) -> None:
        """kit watcher thread: the incarnation died. Fail its jobs (503) and free their pages."""
        unit = self.unit
        if unit is not None:
            unit.dead = True
        tickets = self.table.take_all()
        if tickets:
            log.error("failing %d job(s) of the dead generation engine", len(tickets))
        for t in tickets:
            self._fail(t, unavailable(f"the generation engine died mid-job ({reason}); retry the request",
                                      code="engine_failed"))

    def fail_inflight(self, reason: str) -> None:
        """Every job in flight fails now (503 engine_failed, its pages freed): the fused process is exiting."""
        self._on_death(reason)

    def _gave_up(self, why: str) -> None:
        if not self._stop.is_set():
            self.on_give_up(why)

    def _expire_loop(self) -> None:
        while not self._stop.wait(_EXPIRY_EVERY_S):
            for t in self.table.waiting_longer_than(self.max_queue_wait_s):
                err = overloaded(f"waited {self.max_queue_wait_s:.0f} s for the generation engine "
                                 "(--max-queue-wait-s); retry later", self.retry_after_s(), code="queue_timeout")
                if self.table.finish(t.request_id, JobFailed(t.request_id, err.event())) is not None:
                    self._after_end(t)
