"""HTTP-process side of the engine: starts the engine processes, submits requests over ZMQ and routes
the per-step outputs to per-request asyncio queues.

Crash recovery (same contract as `services/generation/supervisor.py`): the engine rank processes of one
start form an *incarnation* with its own ZMQ sockets and TP rendezvous port. When any rank of a ready
incarnation dies (crash, OOM kill) or reports a fatal error, every in-flight request gets an
`engine_dead` error output (the HTTP layer turns it into a 503), the remaining ranks are killed,
`on_engine_dead` runs (the server releases the shm pages of image prefixes not yet handed out) and a
fresh incarnation is started. The shared-memory KV pool belongs to the HTTP process and is untouched: same
name and generation, so handles held by the generation service stay valid. An engine that fails while
loading at the very first start is not restarted (the error stays on /health); a restarted incarnation
that fails while loading is retried a few times with back-off before giving up the same way. A rank that
exits on SIGTERM/SIGINT is taken as a stop (the launcher signals the whole process group), not a crash.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import uuid
from typing import Callable, Optional

import zmq
import zmq.asyncio

from .engine import EngineConfig, run_engine
from .protocol import Abort, EngineStats, RequestOutput, Shutdown, SubmitRequest
from services.netutil import free_port

log = logging.getLogger("u1serve.understanding.client")

_MAX_LOAD_RETRIES = 3      # consecutive failed loads of a restarted engine before giving up


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(self, cfg: EngineConfig, restart_delay: float = 0.5,
                 on_engine_dead: Optional[Callable[[str], None]] = None):
        self._dir = tempfile.mkdtemp(prefix="u1und-")
        self.base_cfg = cfg
        self.cfg = cfg
        self.restart_delay = restart_delay
        self.on_engine_dead = on_engine_dead or (lambda reason: None)
        self.ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self.out = None
        self.inp = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = EngineStats(kv_total=cfg.kv_cache_tokens)
        self.ready = False
        self.fatal: Optional[str] = None
        self.last_error: Optional[str] = None    # why the previous incarnation died
        self.restarts = 0
        self.restarting = False
        self.fingerprint: Optional[str] = None
        self.kv_cache_tokens = cfg.kv_cache_tokens
        self.max_model_len = cfg.max_model_len
        self.procs: list[mp.Process] = []
        self._task: Optional[asyncio.Task] = None
        self._watch_task: Optional[asyncio.Task] = None
        self._ready_event = asyncio.Event()
        self._stopping = False
        self._was_ready = False       # the current incarnation reported ready at least once
        self._load_failures = 0

    # ---- incarnations ------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Start one incarnation: fresh sockets, addresses and TP port; the same engine settings."""
        tag = uuid.uuid4().hex[:8]
        cfg = dataclasses.replace(self.base_cfg, in_addr=f"ipc://{self._dir}/in-{tag}",
                                  out_addr=f"ipc://{self._dir}/out-{tag}", dist_port=free_port())
        self.cfg = cfg
        self.out = self.ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.bind(cfg.out_addr)
        self.inp = self._sync_ctx.socket(zmq.PUSH)   # plain socket: sends never wait on the event loop
        self.inp.setsockopt(zmq.LINGER, 0)
        self.inp.connect(cfg.in_addr)
        self.ready = False
        self.fatal = None
        self._was_ready = False
        self._ready_event = asyncio.Event()
        mpctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(cfg.tp):
            p = mpctx.Process(target=run_engine, args=(rank, cfg), daemon=True, name=f"u1-und-engine-{rank}")
            p.start()
            self.procs.append(p)
        self._task = asyncio.get_running_loop().create_task(self._pump(self.out))

    def _teardown(self) -> None:
        """Kill what is left of the current incarnation and drop its sockets (never blocks for long)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for s in (self.out, self.inp):
            if s is not None:
                s.close(linger=0)
        self.out = self.inp = None
        for name in os.listdir(self._dir):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass

    def start(self) -> None:
        self._spawn()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    @property
    def alive(self) -> bool:
        return self.fatal is None and bool(self.procs) and all(p.is_alive() for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return self.ready

    async def _watch(self) -> None:
        """Fail every in-flight request promptly if an engine process dies, then start a fresh engine."""
        while not self._stopping:
            await asyncio.sleep(0.25)
            if self._stopping or not self.procs or self.alive:
                continue
            dead = [f"{p.name} exit code {p.exitcode}" for p in self.procs if not p.is_alive()]
            reason = f"engine process died ({', '.join(dead)})" if dead else self.fatal
            was_ready = self._was_ready
            self.ready = False
            self.fatal = reason
            self._ready_event.set()
            self._teardown()                 # also stops the pump: no late outputs from the dead engine
            self.stats = EngineStats(kv_total=self.kv_cache_tokens)   # the new engine starts empty
            queues, self.queues = self.queues, {}
            for rid, q in queues.items():
                q.put_nowait(RequestOutput(rid, [], "error", error=f"{reason}; retry the request",
                                           error_code="engine_dead"))
            try:
                self.on_engine_dead(reason)
            except Exception:
                log.exception("engine-dead cleanup failed")
            if any(p.exitcode in (-signal.SIGTERM, -signal.SIGINT) for p in self.procs):
                # SIGTERM/SIGINT is a stop (the launcher signals the whole process group), not a crash
                log.warning("understanding engine terminated by a signal (%s); not restarting", reason)
                return
            if not was_ready:
                self._load_failures += 1
                if self.restarts == 0 or self._load_failures > _MAX_LOAD_RETRIES:
                    log.error("understanding engine failed to start (%s); not restarting", reason)
                    return
            else:
                self._load_failures = 0
            log.error("understanding engine died (%s); failed %d in-flight request(s), restarting",
                      reason, len(queues))
            self.last_error = reason
            self.restarting = True
            await asyncio.sleep(self.restart_delay * (2 ** self._load_failures))
            if self._stopping:
                return
            self.restarts += 1
            self._spawn()

    async def _pump(self, sock) -> None:
        while True:
            msg = await sock.recv_pyobj()
            kind = msg.get("type")
            if kind == "step":
                self.stats = msg["stats"]
                for o in msg["outs"]:
                    q = self.queues.get(o.rid)
                    if q is not None:
                        q.put_nowait(o)
            elif kind == "ready":
                self.kv_cache_tokens = msg.get("kv_cache_tokens", self.cfg.kv_cache_tokens)
                self.max_model_len = msg.get("max_model_len", self.cfg.max_model_len)
                self.ready = True
                self._was_ready = True
                self.restarting = False
                self.fingerprint = msg.get("fingerprint")
                self._ready_event.set()
                if self.restarts:
                    log.warning("understanding engine ready again (restart %d)", self.restarts)
            elif kind == "fatal":
                self.fatal = msg.get("error")
                self._ready_event.set()

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> asyncio.Queue:
        if not self.alive or not self.ready:
            raise EngineDead(self.fatal or ("engine restarting" if self.restarting else "engine not ready"))
        q: asyncio.Queue = asyncio.Queue()
        self.queues[req.rid] = q
        self.inp.send_pyobj(req)
        return q

    def abort(self, rid: str) -> None:
        if rid in self.queues and self.alive and self.inp is not None:
            self.inp.send_pyobj(Abort(rid))

    def done(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def shutdown(self) -> None:
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        try:
            if self.alive and self.inp is not None:
                self.inp.send_pyobj(Shutdown())
        except Exception:
            pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
        if self._task:
            self._task.cancel()
        self.ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        try:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
        except OSError:
            pass
