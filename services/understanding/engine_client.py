"""HTTP-process side of the engine: starts the engine rank processes under the kit's Supervisor, submits
requests over ZMQ and routes the per-step outputs to per-request asyncio queues.

One start of the engine is an *incarnation* (`EngineIncarnation`, the supervisor's unit): its rank processes,
its own ZMQ sockets and TP rendezvous port, and a reader thread that hands every message to the event loop.
When any rank dies (crash, OOM kill, a CUDA error that made it exit) or reports a fatal error, every in-flight
request gets an `engine_dead` output (the HTTP layer answers 503), the remaining ranks are killed and the
Supervisor starts a fresh incarnation after its backoff. The restart budget (`RestartPolicy`: K failures in
T seconds) ends the restarts: the engine stays down and /health says why. A first start that fails is not
retried at all: `on_start_failure` lets the server exit non-zero with the engine's error. The shared-memory
KV pool belongs to the HTTP process and is untouched by all of this (same name and generation).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import shutil
import threading
import uuid
from typing import Callable, Optional

import zmq

from services.contract.health import EnginePhase
from services.kit.engine_thread import EngineThread
from services.kit.proc import start_without_main
from services.kit.restart import RestartPolicy
from services.kit.rundirs import owned_tempdir
from services.kit.supervisor import Supervisor
from services.base.netutil import free_port

from .config import EngineConfig
from .engine import run_engine, run_engine_thread
from .protocol import (Abort, EngineStats, Fatal, Ready, RequestOutput, Shutdown, Starting, Step, SubmitRequest,
                       WeightsReply)

log = logging.getLogger("u1serve.understanding.client")
MAX_PENDING_OUTPUTS = 4096     # step outputs one request may have waiting for its reader before it is aborted


class EngineDead(RuntimeError):
    pass


class EngineIncarnation:
    """One start of the engine: rank processes + sockets + reader thread (a kit.supervisor Unit)."""

    def __init__(self, base: EngineConfig, sock_dir: str, ctx: zmq.Context, deliver: Callable):
        tag = uuid.uuid4().hex[:8]
        self.cfg = dataclasses.replace(base, in_addr=f"ipc://{sock_dir}/in-{tag}",
                                       out_addr=f"ipc://{sock_dir}/out-{tag}", dist_port=free_port())
        self._deliver = deliver
        self._lock = threading.Lock()       # the PUSH socket is used by the loop and by stop()
        self._closed = threading.Event()
        self._stopping = False              # told to stop (shutdown), not a crash
        self.fatal: Optional[str] = None
        self.phase = EnginePhase.STARTING   # rank 0's Starting messages move it on (/health "phase")
        self._out = ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self.cfg.out_addr)
        self._in = ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.SNDHWM, 0)   # admission control bounds what is in flight, not the socket
        self._in.connect(self.cfg.in_addr)
        if self.cfg.engine_unit == "thread":      # the fused mode: the loop is a thread of this process
            self.procs = [EngineThread(run_engine_thread, (self.cfg,), "u1-und-engine-0")]
        else:
            mpctx = mp.get_context("spawn")
            self.procs = [mpctx.Process(target=run_engine, args=(rank, self.cfg), daemon=True,
                                        name=f"u1-und-engine-{rank}") for rank in range(self.cfg.tp)]
        for p in self.procs:
            start_without_main(p)
        self._reader = threading.Thread(target=self._read, name=f"und-engine-reader-{tag}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while not self._closed.is_set():
                if not self._out.poll(100):
                    continue
                msg = self._out.recv_pyobj()
                if isinstance(msg, Fatal):
                    self.fatal = msg.error or "engine reported a fatal error"
                self._deliver(self, msg)
        except zmq.ZMQError:
            pass
        finally:
            self._out.close(linger=0)

    def send(self, obj) -> bool:
        with self._lock:
            if self._closed.is_set():
                return False
            self._in.send_pyobj(obj)
            return True

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    # ---- kit.supervisor.Unit ---------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.fatal is None and all(p.is_alive() for p in self.procs)

    def exit_reason(self) -> str:
        dead = [f"{p.name} exit code {p.exitcode}" for p in self.procs if not p.is_alive()]
        unit = "thread" if self.cfg.engine_unit == "thread" else "process"
        reason = f"engine {unit} died ({', '.join(dead)})" if dead else "engine reported a fatal error"
        return f"{reason}: {self.fatal}" if self.fatal else reason

    def stopped_on_purpose(self) -> bool:
        return self._stopping

    def stop(self, grace_s: float = 10.0) -> None:
        """Kill what is left; after `stop_gracefully()` first ask the ranks to exit (they free their GPU)."""
        if self._stopping and not self._closed.is_set():
            with contextlib.suppress(zmq.ZMQError):
                self.send(Shutdown())
            for p in self.procs:
                p.join(timeout=grace_s)
        with self._lock:
            self._closed.set()
            self._in.close(linger=0)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)

    def stop_gracefully(self) -> None:
        """The next stop() is a planned one (the server shuts down), not a crash."""
        self._stopping = True


class EngineClient:
    def __init__(self, cfg: EngineConfig, policy: RestartPolicy = RestartPolicy(),
                 on_ready: Optional[Callable[["EngineClient"], None]] = None,
                 on_start_failure: Optional[Callable[[str], None]] = None):
        self.base_cfg = cfg
        self.on_ready = on_ready or (lambda client: None)
        self.on_start_failure = on_start_failure or (lambda why: None)
        self._dir = owned_tempdir("u1und-")     # ZMQ sockets; a dead owner's are removed at the next start
        self._ctx = zmq.Context()
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = EngineStats(kv_total=cfg.kv_cache_tokens)
        self.kv_cache_tokens = cfg.kv_cache_tokens
        self.max_model_len = cfg.max_model_len
        self.ever_ready = False
        self.on_weights: Callable[[dict], None] = lambda msg: None   # rank 0's replies to weights ops
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        if cfg.engine_unit == "thread":   # a dead engine thread is not restarted in place: the process is
            policy = RestartPolicy(max_failures=1)
        self.supervisor = Supervisor("understanding engine", self._spawn, policy=policy,
                                     on_death=self._on_death, on_give_up=self._on_give_up)

    # ---- supervisor callbacks (watcher thread) -> event loop -------------------------------------------
    def _spawn(self) -> EngineIncarnation:
        return EngineIncarnation(self.base_cfg, self._dir, self._ctx, self._deliver)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:             # the loop is closed: the server is gone
            pass

    def _deliver(self, unit: EngineIncarnation, msg) -> None:
        self._to_loop(self._on_message, unit, msg)

    def _on_death(self, reason: str) -> None:
        self._to_loop(self._fail_inflight, reason)

    def _on_give_up(self, why: str) -> None:
        if self.supervisor.state == Supervisor.FAILED and not self.ever_ready:
            self._to_loop(self.on_start_failure, why)

    # ---- event loop ------------------------------------------------------------------------------------
    def _on_message(self, unit: EngineIncarnation, msg: Starting | Ready | Step | WeightsReply | Fatal) -> None:
        if unit.closed or unit is not self.supervisor.unit:
            return                       # a late message of a dead incarnation
        if isinstance(msg, Step):
            self.stats = msg.stats
            for o in msg.outs:
                q = self.queues.get(o.rid)
                if q is not None and q.qsize() >= MAX_PENDING_OUTPUTS:
                    self._fell_behind(o.rid, q)
                elif q is not None:
                    q.put_nowait(o)
        elif isinstance(msg, WeightsReply):
            self.on_weights(msg.result)
        elif isinstance(msg, Starting):
            unit.phase = EnginePhase(msg.phase)
            log.info("understanding engine start: %s", msg.phase)   # in the log too: /health shows only the latest
        elif isinstance(msg, Ready):
            self.kv_cache_tokens, self.max_model_len = msg.kv_cache_tokens, msg.max_model_len
            self.supervisor.mark_ready(unit)
            first = not self.ever_ready
            self.ever_ready = True
            if first:
                log.info("engine ready (kv cache %d tokens, context %d)", self.kv_cache_tokens, self.max_model_len)
            self.on_ready(self)

    def _fell_behind(self, rid: str, q: asyncio.Queue) -> None:
        """A request's reader stopped taking its outputs (a stream whose client does not read): abort it rather
        than queue without bound; its handler gets the abort and frees what it holds."""
        self.abort(rid)
        self.queues.pop(rid, None)
        q.put_nowait(RequestOutput(rid, [], "abort", error=f"{MAX_PENDING_OUTPUTS} outputs waited for a reader that "
                                   "took none: aborted (slow reader)", error_code="stream_backlog"))
        log.warning("request %s aborted: its reader fell %d outputs behind", rid, MAX_PENDING_OUTPUTS)

    def _fail_inflight(self, reason: str) -> None:
        """The engine died: every in-flight request fails with engine_dead (their handlers release what they
        hold); the next incarnation starts empty."""
        self.stats = EngineStats(kv_total=self.kv_cache_tokens)
        queues, self.queues = self.queues, {}
        for rid, q in queues.items():
            q.put_nowait(RequestOutput(rid, [], "error", error=f"{reason}; retry the request",
                                       error_code="engine_dead"))
        if queues:
            log.error("engine died: failed %d in-flight request(s)", len(queues))

    def fail_inflight(self, reason: str) -> None:
        """Every request in flight fails now (engine_dead, 503), from any thread: the fused process is exiting."""
        self._on_death(reason)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.supervisor.start()

    @property
    def ready(self) -> bool:
        unit = self.supervisor.unit
        return self.supervisor.ready and unit is not None and unit.alive()

    @property
    def phase(self) -> EnginePhase:
        """Where the engine is on its way to ready (services/contract/health.py)."""
        unit = self.supervisor.unit
        if self.ready:
            return EnginePhase.READY
        return unit.phase if unit is not None else EnginePhase.STARTING

    @property
    def pids(self) -> list[int]:
        unit = self.supervisor.unit
        return unit.pids if unit is not None else []

    def status(self) -> dict:
        """Supervisor state for /health: state, restarts, last_error, failure (why it stays down)."""
        return self.supervisor.status()

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, req: SubmitRequest) -> asyncio.Queue:
        unit = self.supervisor.unit
        if not self.ready or unit is None:
            s = self.supervisor.status()
            raise EngineDead(s["failure"] or f"engine {s['state']}")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[req.rid] = q
        if not unit.send(req):
            self.queues.pop(req.rid, None)
            raise EngineDead("engine restarting")
        return q

    def abort(self, rid: str) -> None:
        unit = self.supervisor.unit
        if rid in self.queues and unit is not None:
            unit.send(Abort(rid))

    def done(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def shutdown(self) -> None:
        unit = self.supervisor.unit
        if unit is not None:
            unit.stop_gracefully()
        await asyncio.to_thread(self.supervisor.stop)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
