"""HTTP-process side of the engine: starts the engine processes, submits requests over ZMQ and routes
the per-step outputs to per-request asyncio queues."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import tempfile
import uuid
from typing import Optional

import zmq
import zmq.asyncio

from .engine import EngineConfig, run_engine
from .protocol import Abort, EngineStats, RequestOutput, Shutdown, SubmitRequest

log = logging.getLogger("u1serve.understanding.client")


class EngineDead(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineClient:
    def __init__(self, cfg: EngineConfig):
        self._dir = tempfile.mkdtemp(prefix="u1und-")
        tag = uuid.uuid4().hex[:8]
        cfg = dataclasses.replace(cfg, in_addr=f"ipc://{self._dir}/in-{tag}",
                                  out_addr=f"ipc://{self._dir}/out-{tag}", dist_port=_free_port())
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.out = self.ctx.socket(zmq.PULL)
        self.out.bind(cfg.out_addr)
        self._sync_ctx = zmq.Context()
        self.inp = self._sync_ctx.socket(zmq.PUSH)   # plain socket: sends never wait on the event loop
        self.inp.setsockopt(zmq.LINGER, 0)
        self.inp.connect(cfg.in_addr)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = EngineStats(kv_total=cfg.kv_cache_tokens)
        self.ready = False
        self.fatal: Optional[str] = None
        self.fingerprint: Optional[str] = None
        self.kv_cache_tokens = cfg.kv_cache_tokens
        self.max_model_len = cfg.max_model_len
        self.procs: list[mp.Process] = []
        self._task: Optional[asyncio.Task] = None
        self._ready_event = asyncio.Event()

    def start(self) -> None:
        mpctx = mp.get_context("spawn")
        for rank in range(self.cfg.tp):
            p = mpctx.Process(target=run_engine, args=(rank, self.cfg), daemon=True,
                              name=f"u1-und-engine-{rank}")
            p.start()
            self.procs.append(p)
        self._task = asyncio.get_running_loop().create_task(self._pump())
        asyncio.get_running_loop().create_task(self._watch())

    @property
    def alive(self) -> bool:
        return self.fatal is None and all(p.is_alive() for p in self.procs)

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return self.ready

    async def _watch(self) -> None:
        """Fail every in-flight request promptly if an engine process dies."""
        while True:
            await asyncio.sleep(0.5)
            if self.procs and not self.alive:
                if self.fatal is None:
                    dead = [p.name for p in self.procs if not p.is_alive()]
                    self.fatal = f"engine process died ({', '.join(dead)})"
                self.ready = False
                self._ready_event.set()
                for rid, q in list(self.queues.items()):
                    q.put_nowait(RequestOutput(rid, [], "error", error=self.fatal, error_code="engine_dead"))
                return

    async def _pump(self) -> None:
        while True:
            msg = await self.out.recv_pyobj()
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
                self.fingerprint = msg.get("fingerprint")
                self._ready_event.set()
            elif kind == "fatal":
                self.fatal = msg.get("error")
                self._ready_event.set()

    def submit(self, req: SubmitRequest) -> asyncio.Queue:
        if not self.alive or not self.ready:
            raise EngineDead(self.fatal or "engine not ready")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[req.rid] = q
        self.inp.send_pyobj(req)
        return q

    def abort(self, rid: str) -> None:
        if rid in self.queues and self.alive:
            self.inp.send_pyobj(Abort(rid))

    def done(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def shutdown(self) -> None:
        try:
            if self.alive:
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
