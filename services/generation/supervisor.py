"""Runs the engine rank processes for the HTTP process: submit/cancel, event fan-out, crash recovery.

Every engine incarnation has its own queues; when any rank dies, the incarnation is torn down, every
job in flight gets a 503 error event (never a hang), and a fresh incarnation is started.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import asdict
from typing import Callable

from .request import GenerateJob, error_event
from services.netutil import free_port

log = logging.getLogger("u1serve.generation")

Sink = Callable[[dict], None]


class _Channel:
    """One direction of a pipe with a queue-like face (pipes: no feeder threads, no semaphores to
    leak, and a peer killed mid-message only breaks this incarnation's pipe)."""

    def __init__(self, reader, writer):
        self._r, self._w = reader, writer
        self._lock = threading.Lock()

    def __getstate__(self):  # sent to the spawned rank: the lock is per process
        return {"_r": self._r, "_w": self._w}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def put(self, obj) -> None:
        with self._lock:
            self._w.send(obj)

    def get(self, timeout: float | None = None):
        if timeout is not None and not self._r.poll(timeout):
            raise queue.Empty
        return self._r.recv()

    def get_nowait(self):
        return self.get(0)

    def close(self) -> None:
        for c in (self._r, self._w):
            try:
                c.close()
            except OSError:
                pass


def channel(ctx) -> _Channel:
    r, w = ctx.Pipe(duplex=False)
    return _Channel(r, w)


class _Incarnation:
    """One set of engine rank processes and their channels."""

    def __init__(self, ctx, engine_args: dict, world: int):
        self.in_q = channel(ctx)
        self.out_q = channel(ctx)
        port = free_port()
        from .worker import run_rank
        self.procs = [ctx.Process(target=run_rank, name=f"u1-gen-rank{r}", daemon=True,
                                  args=(r, world, port, engine_args,
                                        self.in_q if r == 0 else None,
                                        self.out_q if r == 0 else None))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.ready = False
        self.dead = False

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self.in_q.close()
        self.out_q.close()


class EngineSupervisor:
    def __init__(self, engine_args: dict, world: int = 1, on_stats: Callable[[dict], None] = None,
                 restart_delay: float = 0.5, release: Callable[[list[dict]], None] = None):
        self.engine_args = engine_args
        self.world = world
        self.on_stats = on_stats or (lambda m: None)
        self.restart_delay = restart_delay
        self.restarts = 0
        self.last_error: str | None = None
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._handles: dict[str, list[dict]] = {}  # in-flight jobs' KV handles (for crash cleanup)
        self.release = release or (lambda handles: None)
        self._inc: _Incarnation | None = None
        self._stopping = False
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._spawn()
        t = threading.Thread(target=self._monitor, name="u1-gen-monitor", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stopping = True
        inc = self._inc
        if inc is not None:
            try:
                inc.in_q.put(("stop",))
            except Exception:
                pass
            deadline = time.monotonic() + 5
            for p in inc.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            inc.kill()

    @property
    def ready(self) -> bool:
        inc = self._inc
        return bool(inc and inc.ready and not inc.dead)

    @property
    def pids(self) -> list[int]:
        inc = self._inc
        return [p.pid for p in inc.procs] if inc else []

    def in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    # -- jobs ----------------------------------------------------------------------------------
    def submit(self, job: GenerateJob, sink: Sink) -> None:
        """Queue a job; `sink` receives every event for it (from a background thread)."""
        with self._lock:
            inc = self._inc
            if inc is None or inc.dead or not inc.ready:
                raise RuntimeError("generation engine is not ready")
            self._sinks[job.request_id] = sink
            self._handles[job.request_id] = list(job.handles.values())
            inc.in_q.put(("job", asdict(job)))

    def is_active(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._sinks

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            inc = self._inc
            known = request_id in self._sinks
            if known and inc is not None and not inc.dead:
                inc.in_q.put(("cancel", request_id))
            return known

    # -- internals -----------------------------------------------------------------------------
    def _spawn(self) -> None:
        inc = _Incarnation(self._ctx, self.engine_args, self.world)
        self._inc = inc
        t = threading.Thread(target=self._read_events, args=(inc,), name="u1-gen-events",
                             daemon=True)
        t.start()

    def _read_events(self, inc: _Incarnation) -> None:
        while not inc.dead:
            try:
                msg = inc.out_q.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):
                return
            self._dispatch(inc, msg)

    def _dispatch(self, inc: _Incarnation, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "ready":
            inc.ready = True
            log.info("generation engine ready (%d rank(s))", self.world)
            return
        if kind == "stats":
            self.on_stats(msg)
            return
        if kind == "fatal":
            self.last_error = msg.get("message")
            log.error("generation engine fatal error: %s", self.last_error)
            return
        rid = msg.get("request_id")
        with self._lock:
            sink = self._sinks.get(rid)
            if kind == "done":
                self._sinks.pop(rid, None)
                self._handles.pop(rid, None)
        if sink is not None:
            sink(msg)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            handles, self._handles = self._handles, {}
        # Jobs still queued in the dead engine never imported their prefixes: free their pages now
        # rather than at lease expiry (idempotent: pages already imported and freed are not touched).
        try:
            self.release([h for hs in handles.values() for h in hs])
        except Exception:
            log.exception("releasing the KV handles of failed jobs")
        for rid, sink in sinks.items():
            sink({"request_id": rid, **error_event(503, message, code="engine_failed")})
            sink({"request_id": rid, "type": "done", "outcome": "error"})

    def _monitor(self) -> None:
        while not self._stopping:
            inc = self._inc
            if inc is not None and not inc.alive() and not self._stopping:
                codes = [p.exitcode for p in inc.procs]
                inc.dead = True
                reason = self.last_error or f"engine rank exit codes {codes}"
                log.error("generation engine died (%s); restarting", reason)
                inc.kill()
                self._fail_all(f"generation engine died mid-job ({reason}); retry the request")
                self.last_error = None
                self.restarts += 1
                if self._stopping:
                    return
                time.sleep(self.restart_delay)
                self._spawn()
                self.on_stats({"stat": "restart"})
            time.sleep(0.1)

    def engine_pid_env(self) -> dict:
        return {"pids": self.pids, "parent": os.getpid()}
